#!/bin/bash
# build-guest-initramfs.sh: the nested (L2) guest's initramfs.
#
#   /init          static clade-agent (guest-agent crate)
#   /bin/busybox   Debian busybox-static, plus applet symlinks
#   /lib/modules/<KVER>/*.ko        virtio, virtio-mmio, vsock (+ transport), virtio-blk,
#                                   virtio-rng and their dependencies, uncompressed
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
DEFAULT_GUEST_MODULES="virtio virtio_ring virtio_mmio vsock vmw_vsock_virtio_transport_common
    vmw_vsock_virtio_transport virtio_blk virtio_rng"
read -r -d '' -a GUEST_MODULES <<<"${NESTED_GUEST_MODULES:-$DEFAULT_GUEST_MODULES}" || true
MODDEST="$ROOT/lib/modules/$KVER"
MODSCRATCH="$NESTED_OUT/guest-modules"
rm -rf "$MODSCRATCH"
mkdir -p "$MODSCRATCH"

# Module name (dashes as underscores, like the kernel) -> file in the package.
declare -A MODFILE=()
while IFS= read -r -d '' f; do
    b=${f##*/}
    b=${b%%.ko*}
    MODFILE[${b//-/_}]=$f
done < <(find "$KMODDIR" -type f \( -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz' \) -print0)
[ ${#MODFILE[@]} -gt 0 ] || die "no modules under $KMODDIR"

# Built-in modules (listed in modules.builtin) satisfy dependencies without a file.
declare -A BUILTIN=()
if [ -f "$KROOT/lib/modules/$KVER/modules.builtin" ]; then
    while IFS= read -r f; do
        b=${f##*/}
        b=${b%.ko}
        BUILTIN[${b//-/_}]=1
    done <"$KROOT/lib/modules/$KVER/modules.builtin"
fi

# plain_module NAME: the module as an uncompressed .ko in the scratch dir (finit_module
# would need MODULE_INIT_COMPRESSED_FILE and kernel support for compressed ones).
plain_module() {
    local name=$1 src=${MODFILE[$1]} out="$MODSCRATCH/$1.ko"
    if [ ! -f "$out" ]; then
        case "$src" in
        *.ko) cp "$src" "$out" ;;
        *.ko.xz) require_cmd xz xz-utils; xz -dc "$src" >"$out" ;;
        *.ko.zst) require_cmd zstd zstd; zstd -qdc "$src" >"$out" ;;
        *.ko.gz) gzip -dc "$src" >"$out" ;;
        esac
    fi
    echo "$out"
}

# module_depends NAME: the comma-separated `depends=` field of the module's .modinfo.
module_depends() {
    local ko info
    ko=$(plain_module "$1")
    info="$MODSCRATCH/$1.modinfo"
    objcopy -O binary --only-section=.modinfo "$ko" "$info" ||
        die "objcopy: cannot read .modinfo of $ko"
    tr '\0' '\n' <"$info" | sed -n 's/^depends=//p' | head -n1
}

LOAD_ORDER=()
declare -A VISIT=()
# visit NAME: depth-first, dependencies before the module itself.
visit() {
    local name=${1//-/_} dep deps
    case ${VISIT[$name]:-} in
    done) return ;;
    active) die "module dependency cycle through $name" ;;
    esac
    if [ -z "${MODFILE[$name]:-}" ]; then
        [ -n "${BUILTIN[$name]:-}" ] && { VISIT[$name]="done"; return; }
        die "module $name: not in $KPKG and not built in"
    fi
    VISIT[$name]="active"
    deps=$(module_depends "$name")
    for dep in ${deps//,/ }; do
        visit "$dep"
    done
    VISIT[$name]="done"
    LOAD_ORDER+=("$name")
}
for m in "${GUEST_MODULES[@]}"; do
    visit "$m"
done

{
    echo "# Written by tests/nested/build-guest-initramfs.sh: load in this order (finit_module)."
    for m in "${LOAD_ORDER[@]}"; do
        cp "$MODSCRATCH/$m.ko" "$MODDEST/$m.ko"
        echo "$m.ko"
    done
} >"$MODDEST/load-order"
log "guest modules (load order): ${LOAD_ORDER[*]}"

make_cpio "$ROOT" "$GUEST_CPIO"
log "guest initramfs: $GUEST_CPIO ($(du -h "$GUEST_CPIO" | cut -f1))"
