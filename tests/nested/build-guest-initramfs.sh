#!/bin/bash
# build-guest-initramfs.sh: the nested (L2) guest's initramfs.
#
#   /init          static clade-agent (guest-agent crate)
#   /bin/busybox   Debian busybox-static, plus applet symlinks
#   /lib/modules/<KVER>/*.ko        virtio, virtio-mmio, vsock (+ transport), virtio-blk, virtio-net,
#                                   virtio-balloon,
#                                   virtio-rng, ext4 (+ crc32c for its checksums) and their
#                                   dependencies, uncompressed
#   /lib/modules/<KVER>/load-order  those files in dependency order, for clade-agent
#
# Module names to include: GUEST_MODULES below (or env NESTED_GUEST_MODULES, space separated).
# The Debian package ships no modules.dep: dependencies come from each module's
# `depends=` field in its .modinfo section (objcopy), resolved depth-first.
#
# Output: build/nested/guest.cpio (uncompressed newc). Needs fetch-kernel.sh's output.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require_cmd cpio cpio
require_cmd objcopy binutils
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

# --- kernel modules ----------------------------------------------------------------------
# crc32c_generic: ext4 and jbd2 ask the crypto API for "crc32c" (metadata checksums), which
# would need modprobe to load on demand; loaded up front instead.
DEFAULT_GUEST_MODULES="virtio virtio_ring virtio_mmio vsock vmw_vsock_virtio_transport_common
    vmw_vsock_virtio_transport virtio_blk virtio_rng crc32c_generic ext4 virtio_net virtio_balloon"
read -r -d '' -a GUEST_MODULES <<<"${NESTED_GUEST_MODULES:-$DEFAULT_GUEST_MODULES}" || true
stage_modules "$ROOT/lib/modules/$KVER" "${GUEST_MODULES[@]}"
log "guest modules (load order): ${LOAD_ORDER[*]}"

make_cpio "$ROOT" "$GUEST_CPIO"
log "guest initramfs: $GUEST_CPIO ($(du -h "$GUEST_CPIO" | cut -f1))"
