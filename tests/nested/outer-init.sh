#!/bin/busybox sh
# shellcheck shell=dash disable=SC2089,SC2090  # CLADE_CMD is a command line for eval
# outer-init.sh: /init of the outer (L1) VM, which QEMU TCG boots with an emulated AMD CPU.
# Loads the KVM modules, checks /dev/kvm, runs clade (or a scenario script) with a nested
# guest, prints `CLADE-EXIT <rc>` and a timing line, then powers the outer VM off.
# Copied into the outer initramfs by build-outer.sh; not run on the host.
#
# Console markers (parsed by run.sh):
#   NESTED-L1-INIT uptime=..      /init started
#   NESTED-KVM-READY uptime=..    /dev/kvm exists
#   NESTED-L1-FAIL <reason>       setup failed, clade not run
#   CLADE-EXIT <rc>               exit status of the clade command / scenario
#   NESTED-L1-TIME start=.. end=.. elapsed=..   (uptime seconds around the clade command)

export PATH=/bin
export HOME=/ TERM=dumb

# The command that runs the nested guest: the one place to change clade's flags.
# /etc/nested.env (written by build-outer.sh) may override it, e.g. with a stand-in VMM.
# clade.agent=ready-poweroff: the guest's clade-agent prints CLADE-GUEST-READY and powers off
# instead of serving on vsock port 52 (its default mode, for scenarios with a vsock device).
CLADE_CMD='/bin/clade run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem-mib 256 --vcpus 1 --cmdline "console=ttyS0 panic=-1 quiet clade.agent=ready-poweroff"'
# Inner safety timeout (seconds) so a hung clade still yields CLADE-EXIT and a clean poweroff.
L1_TIMEOUT=480
# Optional scenario script (later issues): run instead of CLADE_CMD, with CLADE_CMD exported.
L1_TEST=/test/l1-test.sh

KVM_MODULES="irqbypass ccp kvm kvm-amd"

uptime_s() { cut -d' ' -f1 /proc/uptime; }

finish() {
    echo "NESTED-L1-DONE uptime=$(uptime_s)"
    sync
    poweroff -f
    # Not reached unless poweroff failed.
    echo "NESTED-L1-FAIL poweroff failed"
    while :; do sleep 3600; done
}

fail() {
    echo "NESTED-L1-FAIL $*"
    finish
}

mounts() {
    mkdir -p /proc /sys /dev /tmp
    mount -t proc proc /proc
    mount -t sysfs sysfs /sys
    mount -t devtmpfs devtmpfs /dev
    mount -t tmpfs tmpfs /tmp
    # Pseudo-terminals, for `script` (a scenario runs a build on a terminal).
    mkdir -p /dev/pts
    mount -t devpts -o ptmxmode=0666 devpts /dev/pts || echo "outer init: no devpts"
    # cgroup v2, as a current distribution mounts it: `clade serve` puts each sandbox's
    # VM process in a cgroup of its own and refuses to run without one.
    mkdir -p /sys/fs/cgroup
    mount -t cgroup2 none /sys/fs/cgroup || echo "outer init: no cgroup2"
    # What udev would make: programs such as `nft -f -` open /dev/stdin.
    ln -sf /proc/self/fd /dev/fd
    ln -sf /proc/self/fd/0 /dev/stdin
    ln -sf /proc/self/fd/1 /dev/stdout
    ln -sf /proc/self/fd/2 /dev/stderr
}

load_kvm() {
    for m in $KVM_MODULES; do
        insmod "/lib/modules/$m.ko" || fail "insmod $m.ko failed"
    done
    if [ ! -c /dev/kvm ]; then
        dmesg | grep -i -E 'kvm|svm' | tail -n 20
        fail "/dev/kvm missing after loading $KVM_MODULES (does the CPU model have svm?)"
    fi
    echo "NESTED-KVM-READY uptime=$(uptime_s)"
}

# Modules build-outer.sh staged from NESTED_L1_MODULES (e.g. the outer disk's virtio_blk).
load_extra() {
    dir=/lib/modules/extra
    [ -f "$dir/load-order" ] || return 0
    grep -v '^#' "$dir/load-order" | while read -r ko; do
        [ -n "$ko" ] || continue
        insmod "$dir/$ko" || echo "NESTED-L1-WARN insmod $ko failed"
    done
    echo "NESTED-L1-MODULES $(grep -c -v '^#' "$dir/load-order") uptime=$(uptime_s)"
}

# L1's /tmp on the disk run.sh --scratch attached (nested.scratch=/dev/vdX on the kernel
# command line), once its modules are loaded; memory (the tmpfs mounted first) otherwise.
# The sdk scenario's state directories, templates and paused sandboxes outgrow a tmpfs in
# L1's memory; on a disk they are page cache L1 can write back and drop.
mount_scratch() {
    dev=$(tr ' ' '\n' </proc/cmdline | sed -n 's/^nested\.scratch=//p')
    [ -n "$dev" ] || return 0
    mount -t ext4 "$dev" /tmp || fail "the scratch disk $dev did not mount on /tmp"
    chmod 1777 /tmp
    echo "NESTED-L1-SCRATCH $dev $(df -k /tmp | awk 'NR == 2 { print $2 "K" }') uptime=$(uptime_s)"
}

run_clade() {
    t0=$(uptime_s)
    if [ -x "$L1_TEST" ]; then
        echo "NESTED-L1-RUN scenario $L1_TEST"
        export CLADE_CMD L1_TIMEOUT
        timeout "$L1_TIMEOUT" "$L1_TEST"
    else
        echo "NESTED-L1-RUN $CLADE_CMD"
        eval "timeout $L1_TIMEOUT $CLADE_CMD"
    fi
    rc=$?
    t1=$(uptime_s)
    echo "CLADE-EXIT $rc"
    echo "NESTED-L1-TIME start=$t0 end=$t1 elapsed=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')"
}

mounts
echo "NESTED-L1-INIT uptime=$(uptime_s)"
# shellcheck source=/dev/null
[ -f /etc/nested.env ] && . /etc/nested.env
load_kvm
load_extra
mount_scratch
run_clade
finish
