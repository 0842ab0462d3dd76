#!/bin/bash
# fetch-kernel.sh: download and unpack Debian's stock kernel package, the one the
# linux-image-amd64 metapackage currently depends on (exact name, never a glob).
#
# Output: build/nested/kernel/<KVER>/ (dpkg-deb -x of the package: boot/vmlinuz-<KVER>,
#         lib/modules/<KVER>/...), build/nested/kernel.env (KVER, KPKG, KROOT).
# Prints the kernel version (e.g. 6.1.0-56-amd64) on stdout. When sourced, exports KVER,
# KPKG and KROOT instead.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

META=linux-image-amd64

require_cmd apt-cache apt
require_cmd apt-get apt
require_cmd dpkg-deb dpkg

# kernel_pkg_name: the exact package named on a "Depends:" line of the metapackage.
kernel_pkg_name() {
    apt-cache depends "$META" 2>/dev/null |
        sed -n -E 's/^[[:space:]]*Depends:[[:space:]]*(linux-image-[^[:space:]]+)[[:space:]]*$/\1/p' |
        head -n1
}

PKG=$(kernel_pkg_name || true)
if [ -z "$PKG" ]; then
    log "apt-cache knows no '$META'; running apt-get update"
    apt-get update -q >&2 || die "apt-get update failed"
    PKG=$(kernel_pkg_name || true)
fi
[ -n "$PKG" ] || die "'apt-cache depends $META' names no linux-image-* package"
KVER=${PKG#linux-image-}
log "kernel package: $PKG (version $KVER)"

# The exact .deb file name apt-get download produces, from the package's Filename field.
DEB_NAME=$(apt-cache show --no-all-versions "$PKG" 2>/dev/null |
    sed -n -E 's/^Filename:[[:space:]]*(.*)$/\1/p' | head -n1)
DEB_NAME=${DEB_NAME##*/}
[ -n "$DEB_NAME" ] || die "apt-cache show $PKG gives no Filename"

DEB_DIR="$NESTED_OUT/deb"
DEB="$DEB_DIR/$DEB_NAME"
mkdir -p "$DEB_DIR"
if [ -s "$DEB" ]; then
    log "cached: $DEB"
else
    log "downloading $PKG"
    (cd "$DEB_DIR" && apt-get download -q "$PKG" >&2) || die "apt-get download $PKG failed"
    [ -s "$DEB" ] || die "apt-get download did not produce $DEB"
fi

KROOT="$NESTED_OUT/kernel/$KVER"
STAMP="$KROOT/.extracted-$DEB_NAME"
if [ -f "$STAMP" ]; then
    log "cached: $KROOT"
else
    log "extracting $DEB_NAME"
    rm -rf "$KROOT"
    mkdir -p "$KROOT"
    dpkg-deb -x "$DEB" "$KROOT" || die "dpkg-deb -x $DEB failed"
    touch "$STAMP"
fi
[ -f "$KROOT/boot/vmlinuz-$KVER" ] || die "$DEB has no boot/vmlinuz-$KVER"
[ -d "$KROOT/lib/modules/$KVER/kernel" ] || die "$DEB has no lib/modules/$KVER/kernel"

printf 'KVER=%q\nKPKG=%q\nKROOT=%q\n' "$KVER" "$PKG" "$KROOT" >"$KERNEL_ENV"

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    export KVER KPKG="$PKG" KROOT
else
    echo "$KVER"
fi
