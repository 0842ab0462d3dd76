#!/bin/bash
# measure-image-build.sh [DIR | --image PATH]: how long a template takes from a container
# image on this machine (native tier: the template VM is the project's test guest, so what
# is measured is Clade's part — unpack, ext4, import, snapshot — not a Linux boot).
#
# Makes an OCI layout whose one gzipped layer is DIR (default /usr/lib/python3), or takes
# the image at PATH (a layout or an archive, e.g. build/rootfs/debian-image.tar, the Debian
# image tests/nested/build-rootfs.sh makes), then:
#   1. clade template build --image LAYOUT        (the image converted: per-GiB figure)
#   2. clade template build --dockerfile (FROM it, ENV/WORKDIR only) twice: the first
#      converts it into the build cache, the second finds it there (a cached image)
# Prints each wall time. Needs a release build (cargo build --release) and the native
# test guest (target/native-guest, built by the tests).
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=""
if [ "${1:-}" = --image ]; then
    IMAGE=$(realpath "${2:?--image needs a path}")
    [ -e "$IMAGE" ] || { echo "no image at $IMAGE" >&2; exit 1; }
fi
SRC=${1:-/usr/lib/python3}
CLADE="$REPO_ROOT/target/release/clade"
GUEST="$REPO_ROOT/target/native-guest/release/native-guest"
[ -x "$CLADE" ] || { echo "build clade first: cargo build --release" >&2; exit 1; }
[ -f "$GUEST" ] || { echo "build the native test guest first (cargo test builds it)" >&2; exit 1; }
W=$(mktemp -d /tmp/clade-measure-image.XXXXXX)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/ctx/img/blobs/sha256"
if [ -n "$IMAGE" ]; then
    rm -rf "$W/ctx/img"
    ln -s "$IMAGE" "$W/ctx/img"
    # (its size as stored: an uncompressed image's is about what it unpacks to)
    MIB=$(( $(du -sbL "$IMAGE" | cut -f1) >> 20 ))
    echo "image: $IMAGE, $MIB MiB stored"
else
blob() { # FILE -> "sha256:<hex> <size>", the file stored under its digest
    local h
    h=$(sha256sum "$1" | cut -d' ' -f1)
    cp "$1" "$W/ctx/img/blobs/sha256/$h"
    echo "sha256:$h $(stat -c %s "$1")"
}
tar -C "$SRC" -cf "$W/layer.tar" .
diff_id=$(sha256sum "$W/layer.tar" | cut -d' ' -f1)
gzip -1 -c "$W/layer.tar" >"$W/layer.tar.gz"
read -r ldig lsize < <(blob "$W/layer.tar.gz")
printf '{"architecture":"amd64","os":"linux","config":{"Env":["A=1"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' "$diff_id" >"$W/config.json"
read -r cdig csize < <(blob "$W/config.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"%s","size":%s}]}' \
    "$cdig" "$csize" "$ldig" "$lsize" >"$W/manifest.json"
read -r mdig msize < <(blob "$W/manifest.json")
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s}]}' "$mdig" "$msize" >"$W/ctx/img/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' >"$W/ctx/img/oci-layout"
MIB=$(( $(stat -c %s "$W/layer.tar") >> 20 ))
echo "image: $SRC, one layer, $MIB MiB unpacked ($(( lsize >> 20 )) MiB gzipped)"
fi
printf 'FROM img\nENV B=2\nWORKDIR /srv\n' >"$W/ctx/Dockerfile"
build() { # NAME ARGS...
    local n=$1 t0 t1
    shift
    t0=$(date +%s.%N)
    "$CLADE" template build "$n" --test-device --kernel "$GUEST" --cmdline steps=vsock \
        --mem 64 --state-dir "$W/state" "$@" >"$W/$n.out" 2>"$W/$n.err" || { cat "$W/$n.err"; exit 1; }
    t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" -v m="$MIB" -v n="$n" \
        'BEGIN { printf "%-22s %6.2f s  (%.1f s per GiB unpacked)\n", n, b - a, (b - a) * 1024 / (m > 0 ? m : 1) }'
    grep -E "^image|^FROM" "$W/$n.err" | sed 's/^/    /' || true
}
build image-cold --image "$W/ctx/img"
build dockerfile-cold --dockerfile "$W/ctx/Dockerfile"
build dockerfile-cached --dockerfile "$W/ctx/Dockerfile"
