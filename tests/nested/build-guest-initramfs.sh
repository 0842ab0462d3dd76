#!/bin/bash
# build-guest-initramfs.sh: the nested (L2) guest's initramfs.
#
#   /init          static clade-agent (guest-agent crate)
#   /bin/busybox   Debian busybox-static, plus applet symlinks
#   /lib/modules/  kernel modules (none yet, see the marked spot below)
#
# Output: build/nested/guest.cpio (uncompressed newc). Needs fetch-kernel.sh's output.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require_cmd cpio cpio
load_kernel_env

log "building static clade-agent"
cargo_static -p guest-agent --bin clade-agent >&2 || die "cargo build -p guest-agent failed"
AGENT="$STATIC_BIN_DIR/clade-agent"
[ -x "$AGENT" ] || die "$AGENT missing after build"

ROOT="$NESTED_OUT/guest-root"
rm -rf "$ROOT"
mkdir -p "$ROOT"/{bin,dev,proc,sys,tmp,lib/modules/"$KVER"}

install_stripped "$AGENT" "$ROOT/init"
install_busybox "$ROOT"
add_console_node "$ROOT"

# ---------------------------------------------------------------------------------------
# KERNEL MODULES (next issue): copy the virtio/vsock .ko files from the Debian package
# ($KMODDIR, e.g. drivers/virtio/virtio_mmio.ko, net/vmw_vsock/*.ko) into
# $ROOT/lib/modules/$KVER/, and write their load order (dependencies first, from each
# module's `depends=` modinfo field; the package ships no modules.dep) to
# $ROOT/lib/modules/$KVER/load-order for clade-agent to finit_module() in sequence.
GUEST_MODULES=()
for m in "${GUEST_MODULES[@]}"; do
    cp "$KMODDIR/$m" "$ROOT/lib/modules/$KVER/"
done
# ---------------------------------------------------------------------------------------

make_cpio "$ROOT" "$GUEST_CPIO"
log "guest initramfs: $GUEST_CPIO ($(du -h "$GUEST_CPIO" | cut -f1))"
