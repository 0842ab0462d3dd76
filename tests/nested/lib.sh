# shellcheck shell=bash disable=SC2034  # variables are used by the sourcing scripts
# lib.sh: shared paths and helpers for the nested tier scripts. Source it; do not run it.
#
# All outputs go under $NESTED_OUT (<repo>/build/nested/, git-ignored). Paths are derived
# from this file's location, so the scripts work from any clone and any working directory.

NESTED_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$NESTED_DIR/../.." && pwd)"
NESTED_OUT="${NESTED_OUT:-$REPO_ROOT/build/nested}"

# Where the static (crt-static, gnu target) release binaries land.
RUST_TARGET=x86_64-unknown-linux-gnu
STATIC_BIN_DIR="$REPO_ROOT/target/$RUST_TARGET/release"

# Written by fetch-kernel.sh: KVER=<uname -r of the Debian kernel>, KPKG=<package name>,
# KROOT=<extracted package root>.
KERNEL_ENV="$NESTED_OUT/kernel.env"

GUEST_CPIO="$NESTED_OUT/guest.cpio"
OUTER_CPIO="$NESTED_OUT/outer.cpio"

log() { printf '[nested] %s\n' "$*" >&2; }
die() {
    printf '[nested] ERROR: %s\n' "$*" >&2
    exit 1
}

# require_cmd CMD PACKAGE: fail with an install hint if CMD is missing.
require_cmd() {
    command -v "$1" >/dev/null 2>&1 ||
        die "'$1' not found; install the Debian package '$2' (see tests/nested/packages.txt)"
}

# load_kernel_env: read $KERNEL_ENV (produced by fetch-kernel.sh) and check it.
load_kernel_env() {
    [ -f "$KERNEL_ENV" ] || die "$KERNEL_ENV missing: run tests/nested/fetch-kernel.sh first"
    # shellcheck source=/dev/null
    . "$KERNEL_ENV"
    if [ -z "${KVER:-}" ] || [ -z "${KROOT:-}" ]; then
        die "$KERNEL_ENV is incomplete; rerun fetch-kernel.sh"
    fi
    KVMLINUZ="$KROOT/boot/vmlinuz-$KVER"
    KMODDIR="$KROOT/lib/modules/$KVER/kernel"
    [ -f "$KVMLINUZ" ] || die "kernel image $KVMLINUZ missing; rerun fetch-kernel.sh"
}

# cargo_static ARGS...: release build of a static binary for the gnu target. --target keeps
# the crt-static flag away from build scripts and proc macros.
cargo_static() {
    require_cmd cargo "rustup toolchain"
    (cd "$REPO_ROOT" &&
        RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
            cargo build --release --target "$RUST_TARGET" "$@")
}

# install_busybox ROOT: /bin/busybox (Debian busybox-static) plus a symlink per applet.
install_busybox() {
    local root=$1 bb=/bin/busybox applet
    [ -x "$bb" ] || die "$bb missing; install the Debian package busybox-static"
    # busybox (the dynamic Debian one) would not run in an initramfs without libc.
    if command -v file >/dev/null 2>&1 && ! file -L "$bb" | grep -q 'statically linked'; then
        die "$bb is not statically linked; install busybox-static (not busybox)"
    fi
    mkdir -p "$root/bin"
    cp "$bb" "$root/bin/busybox"
    for applet in $("$bb" --list); do
        [ "$applet" = busybox ] || ln -sf busybox "$root/bin/$applet"
    done
    ln -sfn bin "$root/sbin"
}

# make_cpio ROOT OUT: uncompressed newc archive of ROOT (uncompressed boots faster under TCG),
# files sorted and owned by root so the archive is reproducible.
make_cpio() {
    local root=$1 out=$2
    (cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
        cpio -o -H newc -R 0:0 --quiet) >"$out.tmp"
    mv "$out.tmp" "$out"
}

# add_console_node ROOT: /dev/console in the archive so PID 1 has a console even if the
# kernel's built-in initramfs lacks one. Skipped (with a note) when mknod is not permitted.
add_console_node() {
    local root=$1
    mkdir -p "$root/dev"
    mknod -m 600 "$root/dev/console" c 5 1 2>/dev/null ||
        log "note: cannot mknod dev/console (not root?); relying on the kernel's built-in one"
}

# install_stripped SRC DEST: copy a binary without its debug info (release builds carry
# debug=1; smaller initramfs archives unpack faster under TCG).
install_stripped() {
    install -m 755 "$1" "$2"
    if command -v strip >/dev/null 2>&1; then
        strip --strip-debug "$2" || log "note: strip $2 failed; keeping debug info"
    fi
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# stage_modules DEST NAME...: the named modules of the kernel package and everything they
# depend on (each module's `depends=` field of its .modinfo section, depth-first; built-in
# modules need no file) as uncompressed .ko files in DEST, plus DEST/load-order listing
# them dependencies first. Sets LOAD_ORDER. Needs load_kernel_env and objcopy (binutils).
# The Debian package ships no modules.dep, hence the .modinfo walk.
stage_modules() {
    local MODDEST=$1 m f b
    shift
    local MODSCRATCH="$NESTED_OUT/modules-scratch"
    rm -rf "$MODSCRATCH"
    mkdir -p "$MODSCRATCH"

    # Module name (dashes as underscores, like the kernel) -> file in the package.
    local -A MODFILE=()
    while IFS= read -r -d '' f; do
        b=${f##*/}
        b=${b%%.ko*}
        MODFILE[${b//-/_}]=$f
    done < <(find "$KMODDIR" -type f \( -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz' \) -print0)
    [ ${#MODFILE[@]} -gt 0 ] || die "no modules under $KMODDIR"

    # Built-in modules (listed in modules.builtin) satisfy dependencies without a file.
    local -A BUILTIN=()
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
    local -A VISIT=()
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
    for m in "$@"; do
        visit "$m"
    done

    mkdir -p "$MODDEST"
    {
        echo "# Written by tests/nested/lib.sh stage_modules: load in this order (finit_module/insmod)."
        for m in "${LOAD_ORDER[@]}"; do
            cp "$MODSCRATCH/$m.ko" "$MODDEST/$m.ko"
            echo "$m.ko"
        done
    } >"$MODDEST/load-order"
    rm -rf "$MODSCRATCH"
}
