#!/bin/bash
# build-outer.sh: the outer (L1) VM's initramfs.
#
#   /init                 outer-init.sh (load KVM modules, run clade, report, power off)
#   /bin/busybox          Debian busybox-static, plus applet symlinks
#   /lib/modules/*.ko     irqbypass, ccp, kvm, kvm-amd from the Debian kernel package
#   /lib/modules/extra/   NESTED_L1_MODULES and their dependencies + load-order (optional)
#   /bin/clade            static clade (vmm crate)
#   /guest/vmlinuz        the Debian kernel, booted again as the nested guest
#   /guest/initrd.cpio    build/nested/guest.cpio (build-guest-initramfs.sh)
#   /etc/nested.env       settings for /init (see below)
#
# Output: build/nested/outer.cpio (uncompressed newc).
#
# Environment (all optional; run.sh passes them through):
#   NESTED_CLADE_CMD   replaces the command /init runs (default: CLADE_CMD in outer-init.sh)
#   NESTED_L1_TEST     host path of a script to run in L1 instead of the command (installed as
#                      /test/l1-test.sh; gets CLADE_CMD and L1_TIMEOUT in its environment;
#                      its exit status is reported as CLADE-EXIT)
#   NESTED_L1_EXTRA    host directory whose contents are copied into the L1 root
#   NESTED_L1_TIMEOUT  inner timeout (s) for the command/scenario (default 480)
#   NESTED_STANDIN     "qemu": stage qemu-system-x86_64 and run it with -accel kvm on the same
#                      guest kernel/initramfs instead of clade (checks the pipeline while
#                      `clade run` cannot boot Linux yet)
#   NESTED_SKIP_CLADE  1: do not build or stage clade (only useful with a stand-in)
#   NESTED_L1_MODULES  more modules for L1, loaded by /init after KVM's (space separated;
#                      run.sh --disk sets "virtio_pci virtio_blk" for the outer disk)
#   NESTED_L1_BINS     host programs to stage in L1 at their host paths, with their shared
#                      libraries (space separated names, e.g. "nft ip": the sandbox
#                      service's firewall tool, and iproute2 for a scenario's own set-up)
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

require_cmd cpio cpio
load_kernel_env
[ -f "$GUEST_CPIO" ] || die "$GUEST_CPIO missing: run tests/nested/build-guest-initramfs.sh first"

ROOT="$NESTED_OUT/outer-root"
rm -rf "$ROOT"
mkdir -p "$ROOT"/{bin,dev,proc,sys,tmp,etc,guest,lib/modules}

# --- clade -----------------------------------------------------------------------------
if [ "${NESTED_SKIP_CLADE:-0}" = 1 ]; then
    log "NESTED_SKIP_CLADE=1: not building clade"
else
    log "building static clade"
    cargo_static -p clade --bin clade >&2 || die "cargo build -p clade --bin clade failed"
    CLADE="$STATIC_BIN_DIR/clade"
    [ -x "$CLADE" ] || die "$CLADE missing after build"
    if command -v file >/dev/null 2>&1 && file "$CLADE" | grep -q 'dynamically linked'; then
        die "$CLADE is dynamically linked; it would not run in the initramfs"
    fi
    install_stripped "$CLADE" "$ROOT/bin/clade"
fi

# --- busybox, KVM modules, nested guest ------------------------------------------------
install_busybox "$ROOT"
add_console_node "$ROOT"
for ko in virt/lib/irqbypass.ko drivers/crypto/ccp/ccp.ko arch/x86/kvm/kvm.ko arch/x86/kvm/kvm-amd.ko; do
    [ -f "$KMODDIR/$ko" ] || die "module $ko not in the kernel package ($KMODDIR)"
    cp "$KMODDIR/$ko" "$ROOT/lib/modules/"
done
if [ -n "${NESTED_L1_MODULES:-}" ]; then
    require_cmd objcopy binutils
    read -r -a l1_modules <<<"$NESTED_L1_MODULES"
    stage_modules "$ROOT/lib/modules/extra" "${l1_modules[@]}"
    log "L1 extra modules (load order): ${LOAD_ORDER[*]}"
fi
# stage_program PATH: a dynamically linked program, its libraries and the loader, at their
# host paths.
stage_program() {
    local prog lib
    prog=$(readlink -f "$1")
    mkdir -p "$ROOT$(dirname "$1")"
    cp "$prog" "$ROOT$1"
    for lib in $(ldd "$prog" | grep -o '/[^ ]*'); do
        mkdir -p "$ROOT$(dirname "$lib")"
        cp -L "$lib" "$ROOT$lib"
    done
}
if [ -n "${NESTED_L1_BINS:-}" ]; then
    read -r -a l1_bins <<<"$NESTED_L1_BINS"
    for b in "${l1_bins[@]}"; do
        p=$(command -v "$b") || die "NESTED_L1_BINS: '$b' is not installed on this host"
        stage_program "$p"
    done
    log "L1 programs: ${l1_bins[*]}"
fi
# The tests' S3 server (scripts/setup.sh builds it), as /usr/bin/clade-test-s3: the object
# store of durable sandboxes in the sdk scenario.
# CA certificates, as a real host has them: the object store's HTTP client loads them even
# for the plain-http S3 server.
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    mkdir -p "$ROOT/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/"
fi
S3_SERVER="$REPO_ROOT/build/tools/bin/clade-test-s3"
if [ -x "$S3_SERVER" ]; then
    stage_program "$S3_SERVER"
    mkdir -p "$ROOT/usr/bin"
    mv "$ROOT$S3_SERVER" "$ROOT/usr/bin/clade-test-s3"
    log "L1 S3 server: /usr/bin/clade-test-s3"
fi
cp "$KVMLINUZ" "$ROOT/guest/vmlinuz"
cp "$GUEST_CPIO" "$ROOT/guest/initrd.cpio"

install -m 755 "$NESTED_DIR/outer-init.sh" "$ROOT/init"

# --- settings for /init ----------------------------------------------------------------
ENV_FILE="$ROOT/etc/nested.env"
: >"$ENV_FILE"
# POSIX single-quoting (busybox sh sources it): ' becomes '\''.
setting() { printf "%s='%s'\n" "$1" "${2//\'/\'\\\'\'}" >>"$ENV_FILE"; }

case "${NESTED_STANDIN:-}" in
"") ;;
qemu)
    # Stand-in VMM: Debian's QEMU with KVM, same guest kernel, initramfs and console.
    require_cmd qemu-system-x86_64 qemu-system-x86
    Q=$(command -v qemu-system-x86_64)
    Q=$(readlink -f "$Q")
    mkdir -p "$ROOT/usr/bin" "$ROOT/usr/share/qemu"
    cp "$Q" "$ROOT/usr/bin/qemu-system-x86_64"
    # Its shared libraries and the dynamic loader, at their host paths.
    for lib in $(ldd "$Q" | grep -o '/[^ ]*'); do
        mkdir -p "$ROOT$(dirname "$lib")"
        cp -L "$lib" "$ROOT$lib"
    done
    for f in /usr/share/seabios/bios-256k.bin /usr/share/qemu/linuxboot_dma.bin \
        /usr/share/qemu/kvmvapic.bin; do
        if [ -e "$f" ]; then cp -L "$f" "$ROOT/usr/share/qemu/"; fi
    done
    NESTED_CLADE_CMD=${NESTED_CLADE_CMD:-'/usr/bin/qemu-system-x86_64 -L /usr/share/qemu -accel kvm -cpu host -m 256M -smp 1 -M pc -nographic -nodefaults -no-user-config -serial stdio -no-reboot -kernel /guest/vmlinuz -initrd /guest/initrd.cpio -append "console=ttyS0 panic=-1 quiet clade.agent=ready-poweroff"'}
    log "stand-in VMM: qemu -accel kvm (not clade)"
    ;;
*) die "unknown NESTED_STANDIN='$NESTED_STANDIN' (supported: qemu)" ;;
esac

if [ -n "${NESTED_CLADE_CMD:-}" ]; then setting CLADE_CMD "$NESTED_CLADE_CMD"; fi
if [ -n "${NESTED_L1_TIMEOUT:-}" ]; then setting L1_TIMEOUT "$NESTED_L1_TIMEOUT"; fi

if [ -n "${NESTED_L1_TEST:-}" ]; then
    [ -f "$NESTED_L1_TEST" ] || die "NESTED_L1_TEST=$NESTED_L1_TEST: no such file"
    mkdir -p "$ROOT/test"
    install -m 755 "$NESTED_L1_TEST" "$ROOT/test/l1-test.sh"
fi
if [ -n "${NESTED_L1_EXTRA:-}" ]; then
    [ -d "$NESTED_L1_EXTRA" ] || die "NESTED_L1_EXTRA=$NESTED_L1_EXTRA: no such directory"
    cp -a "$NESTED_L1_EXTRA/." "$ROOT/"
fi

make_cpio "$ROOT" "$OUTER_CPIO"
log "outer initramfs: $OUTER_CPIO ($(du -h "$OUTER_CPIO" | cut -f1))"
