#!/bin/bash
# install-guest.sh: the guest kernel and initramfs `clade run --image` and `clade template
# build --image/--dockerfile` boot, installed where clade looks for them by default:
# `$CLADE_HOME/guest/{vmlinuz,initrd}` (CLADE_HOME default: ~/.local/share/clade).
#
#   vmlinuz  Debian's stock kernel (the linux-image-amd64 package, fetched once from the
#            distribution's archive with apt: tests/nested/fetch-kernel.sh)
#   initrd   Clade's initramfs: the static clade-agent as /init, busybox, and the virtio,
#            vsock and ext4 modules of that kernel (tests/nested/build-guest-initramfs.sh)
#
# Needs apt (Debian or Ubuntu), cpio, binutils and the Rust toolchain; run once.
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=../tests/nested/lib.sh
. "$REPO_ROOT/tests/nested/lib.sh"
"$REPO_ROOT/tests/nested/fetch-kernel.sh" >/dev/null
"$REPO_ROOT/tests/nested/build-guest-initramfs.sh" >/dev/null
load_kernel_env
DEST="${CLADE_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/clade}/guest"
mkdir -p "$DEST"
cp "$KVMLINUZ" "$DEST/vmlinuz.tmp" && mv "$DEST/vmlinuz.tmp" "$DEST/vmlinuz"
cp "$GUEST_CPIO" "$DEST/initrd.tmp" && mv "$DEST/initrd.tmp" "$DEST/initrd"
echo "guest kernel $KVER and Clade's initramfs installed in $DEST"
