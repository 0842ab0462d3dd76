#!/bin/bash
# build-rootfs.sh: the sandbox root filesystem, as a Clade base layer.
#
#   1. debootstrap --variant=minbase --include=python3 bookworm  (as root; needs the
#      Debian packages debootstrap and e2fsprogs, see packages.txt)
#   2. trim it (apt lists and caches, docs, man pages, locales other than C) and make an
#      ext4 image of it (mkfs.ext4 -d, no partition table: the guest mounts /dev/vda)
#   3. `clade disk create --from` that image: a frozen base layer (only non-zero 64 KiB
#      blocks are stored) that every sandbox's overlay shares
#
# Outputs (under build/rootfs/, cached: a second run with the same inputs does nothing):
#   tree/         the debootstrap tree (kept only while building)
#   rootfs.ext4   the raw ext4 image
#   base.cdsk     the base layer (devices/../disk/FORMAT.md)
#   stamp         what the outputs were built from; delete it (or --force) to rebuild
#
# Usage: tests/nested/build-rootfs.sh [--force]
# Environment: ROOTFS_OUT (default build/rootfs), DEBIAN_MIRROR (default: the first Debian
# URI in this machine's apt sources), ROOTFS_SUITE (bookworm), ROOTFS_INCLUDE (python3),
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
INCLUDE=${ROOTFS_INCLUDE:-python3}
SLACK_MIB=${ROOTFS_SLACK_MIB:-256}
TREE="$OUT/tree"
IMG="$OUT/rootfs.ext4"
BASE="$OUT/base.cdsk"
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

if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -f "$IMG" ]; then
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
rm -rf --one-file-system "$TREE"
T2=$(now)

# --- base layer --------------------------------------------------------------------------
rm -f "$BASE"
"$CLADE" disk create --from "$IMG" "$BASE" >&2 || die "clade disk create --from failed"
"$CLADE" disk info "$BASE" >&2
T3=$(now)
echo "$WANT" >"$STAMP"
log "rootfs: ${USED_MIB} MiB of files in a ${SIZE_MIB} MiB ext4 image; base layer $BASE ($(du -h "$BASE" | cut -f1) allocated)"
log "timings: debootstrap $(elapsed "$T0" "$T1")s, image $(elapsed "$T1" "$T2")s, layer $(elapsed "$T2" "$T3")s"
