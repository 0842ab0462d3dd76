#!/bin/bash
# build-rootfs.sh: the sandbox root filesystem, as a Clade base layer.
#
#   1. debootstrap --variant=minbase bookworm with python3 and what E2B's base template
#      has (sudo, curl, git, pip, venv, procps, iproute2, less, unzip) (as root; needs the
#      Debian packages debootstrap and e2fsprogs, see packages.txt)
#   2. trim it (apt lists and caches, docs, man pages, locales other than C) and make an
#      ext4 image of it (mkfs.ext4 -d, no partition table: the guest mounts /dev/vda)
#   3. `clade disk create --from` that image: a frozen base layer (only non-zero 64 KiB
#      blocks are stored) that every sandbox's overlay shares
#   4. the same tree as a container image (an OCI archive, one uncompressed layer, the
#      config of Debian's official image): what `clade template build base` is built FROM
#      where no registry can be reached (--build-arg BASE=that archive)
#
# Outputs (under build/rootfs/, cached: a second run with the same inputs does nothing):
#   tree/         the debootstrap tree (kept only while building)
#   rootfs.ext4   the raw ext4 image
#   base.cdsk     the base layer (devices/../disk/FORMAT.md)
#   debian-image.tar  the OCI archive (its size is a multiple of 512: it can be a disk)
#   stamp         what the outputs were built from; delete it (or --force) to rebuild
#
# Usage: tests/nested/build-rootfs.sh [--force]
# Environment: ROOTFS_OUT (default build/rootfs), DEBIAN_MIRROR (default: the first Debian
# URI in this machine's apt sources), ROOTFS_SUITE (bookworm), ROOTFS_INCLUDE (the list above),
# ROOTFS_SLACK_MIB (free space in the image, default 256), CLADE (a clade binary to use;
# default: the static build that build-outer.sh also uses).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

FORCE=0
case "${1:-}" in
--force) FORCE=1 ;;
"") ;;
-h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
*) die "unknown argument: $1" ;;
esac

OUT=${ROOTFS_OUT:-$REPO_ROOT/build/rootfs}
SUITE=${ROOTFS_SUITE:-bookworm}
INCLUDE=${ROOTFS_INCLUDE:-python3,sudo,curl,ca-certificates,git,python3-pip,python3-venv,procps,iproute2,less,unzip}
SLACK_MIB=${ROOTFS_SLACK_MIB:-256}
TREE="$OUT/tree"
IMG="$OUT/rootfs.ext4"
BASE="$OUT/base.cdsk"
IMAGE="$OUT/debian-image.tar"
STAMP="$OUT/stamp"

# The mirror this machine's apt already uses (deb822 or one-line sources).
default_mirror() {
    local f uri
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
        [ -f "$f" ] || continue
        uri=$(sed -n -E 's/^URIs:[[:space:]]*([^[:space:]]+\/debian)\/?$/\1/p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+\/debian)\/?[[:space:]].*/\2/p' "$f" | head -n1)
        if [ -n "$uri" ]; then
            echo "$uri"
            return
        fi
    done
}
MIRROR=${DEBIAN_MIRROR:-$(default_mirror)}
[ -n "$MIRROR" ] || die "no Debian mirror in /etc/apt/sources*; set DEBIAN_MIRROR"

# Everything that changes the result; the cache is valid while this is unchanged.
SCRIPT_SUM=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
WANT="suite=$SUITE include=$INCLUDE slack=$SLACK_MIB script=$SCRIPT_SUM"
if [ -z "${CLADE:-}" ]; then
    # The static build build-outer.sh makes too (same flags: built once).
    log "building clade"
    cargo_static -p clade --bin clade >&2 || die "cargo build failed"
    CLADE="$STATIC_BIN_DIR/clade"
fi
[ -x "$CLADE" ] || die "$CLADE is not executable"

if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -f "$IMG" ] && [ -f "$IMAGE" ]; then
    if [ -f "$BASE" ] && "$CLADE" disk info "$BASE" >/dev/null 2>&1; then
        log "rootfs cached: $BASE ($(du -h "$BASE" | cut -f1) allocated)"
        exit 0
    fi
    # The image is there but the layer is missing or unreadable (e.g. a format change).
    log "re-making the base layer from the cached $IMG"
    rm -f "$BASE"
    "$CLADE" disk create --from "$IMG" "$BASE" >&2 || die "clade disk create --from failed"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "debootstrap needs root"
require_cmd debootstrap debootstrap
require_cmd mkfs.ext4 e2fsprogs
require_cmd e2fsck e2fsprogs

rm -f "$STAMP"
mkdir -p "$OUT"
T0=$(now)
if [ -d "$TREE" ]; then
    # A tree mounted into by an interrupted debootstrap must not be deleted through.
    for m in proc sys dev/pts dev; do umount "$TREE/$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$TREE"
fi
log "debootstrap $SUITE (minbase, +$INCLUDE) from $MIRROR"
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$TREE" "$MIRROR" >"$OUT/debootstrap.log" 2>&1 ||
    { tail -n 30 "$OUT/debootstrap.log" >&2; die "debootstrap failed (log: $OUT/debootstrap.log)"; }
T1=$(now)

# --- trim and configure ------------------------------------------------------------------
rm -rf "$TREE"/var/cache/apt/archives/*.deb "$TREE"/var/cache/apt/*.bin \
    "$TREE"/var/lib/apt/lists/* "$TREE"/usr/share/doc/* "$TREE"/usr/share/man/* \
    "$TREE"/usr/share/info/* "$TREE"/var/log/*.log "$TREE"/var/log/apt/*
find "$TREE/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
echo clade-sandbox >"$TREE/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 clade-sandbox\n' >"$TREE/etc/hosts"
# The agent mounts the root itself (clade.root=); nothing else to mount.
echo '# clade-agent mounts /dev/vda as / (kernel command line clade.root=/dev/vda)' >"$TREE/etc/fstab"
mkdir -p "$TREE/mnt/root"
echo "$WANT" >"$TREE/etc/clade-rootfs"

# --- ext4 image --------------------------------------------------------------------------
USED_MIB=$(du -s -m --apparent-size "$TREE" | cut -f1)
SIZE_MIB=$(((USED_MIB * 12 / 10 + SLACK_MIB + 63) / 64 * 64))
rm -f "$IMG" "$IMG.tmp"
truncate -s "${SIZE_MIB}M" "$IMG.tmp"
# 4 KiB blocks; no resize inode or lazy init (nothing left for the guest to initialise in
# the background); root owns everything.
mkfs.ext4 -q -F -L clade-root -b 4096 -m 0 -E lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0 \
    -O ^resize_inode -d "$TREE" "$IMG.tmp" || die "mkfs.ext4 failed"
e2fsck -f -n "$IMG.tmp" >/dev/null || die "e2fsck found problems in the new image"
mv "$IMG.tmp" "$IMG"

# --- the OCI archive ---------------------------------------------------------------------
# One uncompressed layer (nothing to inflate where it is read), numeric owners and
# xattrs kept; blobs named by their sha256, as an image layout holds them.
LAYOUT="$OUT/layout"
rm -rf "$LAYOUT" "$IMAGE" "$IMAGE.tmp"
mkdir -p "$LAYOUT/blobs/sha256"
tar --numeric-owner --xattrs --xattrs-include='*' --sort=name -C "$TREE" -cf "$LAYOUT/layer.tar" . ||
    die "tar of the tree failed"
blob() { # FILE: moves FILE to its digest's name; prints "sha256:<hex> <size>"
    local h size
    h=$(sha256sum "$1" | cut -d' ' -f1)
    size=$(stat -c %s "$1")
    mv "$1" "$LAYOUT/blobs/sha256/$h"
    echo "sha256:$h $size"
}
read -r LAYER_DIGEST LAYER_SIZE < <(blob "$LAYOUT/layer.tar")
printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":["bash"]},"rootfs":{"type":"layers","diff_ids":["%s"]}}' \
    "$LAYER_DIGEST" >"$LAYOUT/config.json"
read -r CONFIG_DIGEST CONFIG_SIZE < <(blob "$LAYOUT/config.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
    "$CONFIG_DIGEST" "$CONFIG_SIZE" "$LAYER_DIGEST" "$LAYER_SIZE" >"$LAYOUT/manifest.json"
read -r MANIFEST_DIGEST MANIFEST_SIZE < <(blob "$LAYOUT/manifest.json")
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"%s"}}]}' \
    "$MANIFEST_DIGEST" "$MANIFEST_SIZE" "$SUITE" >"$LAYOUT/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' >"$LAYOUT/oci-layout"
tar -C "$LAYOUT" -cf "$IMAGE.tmp" oci-layout index.json blobs || die "tar of the image layout failed"
rm -rf "$LAYOUT"
mv "$IMAGE.tmp" "$IMAGE"
rm -rf --one-file-system "$TREE"
T2=$(now)

# --- base layer --------------------------------------------------------------------------
rm -f "$BASE"
"$CLADE" disk create --from "$IMG" "$BASE" >&2 || die "clade disk create --from failed"
"$CLADE" disk info "$BASE" >&2
T3=$(now)
echo "$WANT" >"$STAMP"
log "rootfs: ${USED_MIB} MiB of files in a ${SIZE_MIB} MiB ext4 image; base layer $BASE ($(du -h "$BASE" | cut -f1) allocated); OCI archive $IMAGE ($(du -h "$IMAGE" | cut -f1))"
log "timings: debootstrap $(elapsed "$T0" "$T1")s, ext4 image and OCI archive $(elapsed "$T1" "$T2")s, layer $(elapsed "$T2" "$T3")s"
