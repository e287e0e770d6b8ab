#!/bin/bash
# Build UCX 1.13.1 with its CUDA transports (cuda_copy, cuda_ipc) into a relocatable PREFIX.
#
# Debian's UCX (libucx0 1.13.1) is built without CUDA, so duet's transfer layer hands GPU pools
# to UCX through pinned host pools. The direct path (transfer/xfer_ctx.c, --transfer.device_pools)
# and its test, tests/unit/test_transfer_cuda.c, need a UCX with CUDA transports. This builds the
# same UCX version as Debian's, so duet's binaries use it through LD_LIBRARY_PATH without a
# rebuild.
#
# A CUDA 13 toolkit on a machine without a GPU needs three workarounds:
#  - UCX's configure wants nvml.h, which a toolkit without cuda-nvml-dev lacks: taken from the
#    PyPI wheel nvidia-nvml-dev (headers only) when $CUDA_HOME/include has none.
#  - it also wants to link libnvidia-ml, which comes with the NVIDIA driver: when this machine has
#    none, a stub that exports the NVML names libuct_cuda uses is linked against. The stub is never
#    installed; at run time the driver's libnvidia-ml.so.1 is loaded.
#  - UCX's test app test_cuda_hook does not compile against CUDA 13 (cuCtxCreate_v4 takes more
#    arguments), so only the libraries, the modules and ucx_info are built and installed.
# The installed tree is stripped, has no static libraries, libtool or pkg-config files, finds its
# own libraries and modules through $ORIGIN-relative RUNPATHs, and carries libcudart (and
# libnuma, which a GPU machine may lack), so it can be copied to the GPU machine as it is.
#
# Usage: tools/build_ucx_cuda.sh PREFIX        (tools/build_ucx_cuda.sh --help for details)
set -euo pipefail

ucx_tag=v1.13.1
ucx_version=1.13.1
ucx_url=https://github.com/openucx/ucx
nvml_wheel=nvidia-nvml-dev==13.0.87
# NVML functions libuct_cuda 1.13.1 calls (nvml.h maps the plain names to the _v2 ones), plus
# nvmlInit, which configure links against.
nvml_names=(nvmlInit nvmlInit_v2 nvmlShutdown nvmlErrorString
            nvmlDeviceGetHandleByIndex nvmlDeviceGetHandleByIndex_v2 nvmlDeviceGetFieldValues
            nvmlDeviceGetNvLinkRemotePciInfo nvmlDeviceGetNvLinkRemotePciInfo_v2)
# Built and installed in this order; the rest of the tree (perftest, test apps, examples, bindings)
# is left out.
build_dirs=(src/ucm src/ucs src/uct src/ucp src/tools/info)

usage() {
    cat <<EOF
Usage: tools/build_ucx_cuda.sh PREFIX

Builds UCX $ucx_version with CUDA transports (cuda_copy, cuda_ipc) and installs libucp, libuct,
libucs, libucm, the modules (lib/ucx: uct_cuda, ucm_cuda, uct_cma) and bin/ucx_info into PREFIX
(created; must be empty or absent). The tree is relocatable and bundles libcudart (and libnuma
when the build machine has it); the GPU machine needs only the NVIDIA driver. Without a GPU the
build works; the CUDA transports are then only listed on the GPU machine.

Environment:
  UCX_SRC=DIR   a clean UCX $ucx_version source tree or git checkout to build instead of cloning
                $ucx_url at $ucx_tag (it is copied; DIR is not modified)
  CUDA_HOME     CUDA toolkit (default /usr/local/cuda)
  JOBS          parallel make jobs (default: nproc)
  WORK          build directory (default: a new mktemp directory, removed after a successful
                build; kept with its logs after a failure)

Installs autoconf, automake, libtool and patchelf with apt when missing (as root; otherwise it
names them and stops). Takes about 10-20 minutes on 2 cores.

Then: LD_LIBRARY_PATH=PREFIX/lib, UCX_TLS without tcp (e.g. sm,self,cuda_copy,cuda_ipc) and
the workers' --transfer.device-pools auto for duet to move device pools directly.
EOF
}

die() { echo "build_ucx_cuda: $*" >&2; exit 1; }
step() { printf '== %s  (%s)\n' "$*" "$(elapsed)"; }
elapsed() { printf '%dm%02ds' $((SECONDS / 60)) $((SECONDS % 60)); }

case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    '') usage >&2; exit 2 ;;
    -*) die "unknown option $1 (see --help)" ;;
esac
[ $# -eq 1 ] || die "expected one argument, PREFIX (see --help)"

CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
JOBS=${JOBS:-$(nproc)}
UCX_SRC=${UCX_SRC:-}
SECONDS=0

# --- checks that need nothing installed ----------------------------------------------------------
if [ ! -f "$CUDA_HOME/include/cuda.h" ] || [ ! -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
    die "no CUDA toolkit at CUDA_HOME=$CUDA_HOME (cuda.h / cuda_runtime.h missing)"
fi
if [ -d "$CUDA_HOME/lib64" ]; then cuda_libdir=$CUDA_HOME/lib64; else cuda_libdir=$CUDA_HOME/lib; fi
ls "$cuda_libdir"/libcudart.so.* >/dev/null 2>&1 || die "no libcudart.so.* in $cuda_libdir"
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "JOBS must be a positive number, not '$JOBS'"
if [ -n "$UCX_SRC" ]; then
    [ -f "$UCX_SRC/configure.ac" ] || die "UCX_SRC=$UCX_SRC is not a UCX source tree (no configure.ac)"
    ver=$(sed -n 's/^define(\[ucx_ver_\(major\|minor\|patch\)\], *\([0-9]*\)).*/\2/p' \
          "$UCX_SRC/configure.ac" | paste -sd.)
    [ "$ver" = "$ucx_version" ] ||
        die "UCX_SRC=$UCX_SRC is UCX '${ver:-unknown}', not $ucx_version (Debian's version, whose ABI duet is built against)"
    [ ! -e "$UCX_SRC/config.status" ] ||
        die "UCX_SRC=$UCX_SRC has been configured already (config.status); give a clean tree or run 'make distclean' there"
fi

PREFIX=$1
if [ -e "$PREFIX" ]; then
    [ -d "$PREFIX" ] || die "PREFIX $PREFIX exists and is not a directory"
    [ -z "$(ls -A "$PREFIX")" ] || die "PREFIX $PREFIX is not empty; remove it or choose another"
fi
mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)

# --- tools ---------------------------------------------------------------------------------------
step "checking tools"
missing=()
need() { command -v "$1" >/dev/null 2>&1 || missing+=("$2"); }
need cc build-essential
need make build-essential
need autoconf autoconf
need automake automake
need libtoolize libtool
need patchelf patchelf
[ -n "$UCX_SRC" ] || need git git
if [ ${#missing[@]} -gt 0 ]; then
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    [ "$(id -u)" -eq 0 ] ||
        die "missing packages: ${missing[*]} (install them: sudo apt-get install ${missing[*]})"
    echo "   apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
        die "apt-get install ${missing[*]} failed"
fi

# --- build directory -----------------------------------------------------------------------------
if [ -n "${WORK:-}" ]; then
    mkdir -p "$WORK"
    WORK=$(cd "$WORK" && pwd)
    own_work=0
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/build_ucx_cuda.XXXXXX")
    own_work=1
fi
mkdir -p "$WORK/logs"
ok=0
finish() {
    if [ "$ok" -eq 1 ]; then
        [ "$own_work" -eq 0 ] || rm -rf "$WORK"
    else
        echo "build_ucx_cuda: failed after $(elapsed); build directory and logs kept in $WORK" >&2
    fi
}
trap finish EXIT

# run NAME DIR CMD...: runs CMD in DIR with its output in $WORK/logs/NAME.log; on failure shows
# the end of that log and stops.
run() {
    local name=$1 dir=$2 rc=0
    shift 2
    (cd "$dir" && "$@") >"$WORK/logs/$name.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "build_ucx_cuda: '$*' failed (exit $rc) in $dir; end of $WORK/logs/$name.log:" >&2
        tail -n 30 "$WORK/logs/$name.log" | sed 's/^/    /' >&2
        exit 1
    fi
}

echo "   prefix $PREFIX, CUDA $CUDA_HOME, $JOBS jobs, build directory $WORK"

# --- source --------------------------------------------------------------------------------------
src=$WORK/ucx-$ucx_version
rm -rf "$src"
if [ -n "$UCX_SRC" ]; then
    step "copying UCX source from $UCX_SRC"
    mkdir -p "$src"
    tar -C "$UCX_SRC" --exclude=./.git -cf - . | tar -C "$src" -xf - ||
        die "copying $UCX_SRC to $src failed"
else
    step "cloning $ucx_url at $ucx_tag"
    run clone "$WORK" git clone -q --depth 1 --branch "$ucx_tag" "$ucx_url" "$src"
fi

# --- nvml ----------------------------------------------------------------------------------------
cppflags=()
ldflags=()
nvml=$WORK/nvml
if printf '#include <nvml.h>\n' | cc -E -I"$CUDA_HOME/include" -x c - >/dev/null 2>&1; then
    step "nvml.h found"
else
    step "nvml.h not in $CUDA_HOME/include: taking it from the PyPI wheel $nvml_wheel"
    python3 -m pip --version >/dev/null 2>&1 ||
        die "need python3 with pip to fetch nvml.h (or put nvml.h, from CUDA's cuda-nvml-dev package, into $CUDA_HOME/include)"
    mkdir -p "$nvml/wheel" "$nvml/include"
    run pip-nvml "$WORK" python3 -m pip download -q --no-deps --only-binary=:all: \
        -d "$nvml/wheel" "$nvml_wheel"
    run unzip-nvml "$WORK" python3 - "$nvml/wheel" "$nvml/include" <<'PY'
import glob, os, sys, zipfile
wheels = glob.glob(os.path.join(sys.argv[1], "*.whl"))
if not wheels:
    sys.exit("no wheel downloaded")
with zipfile.ZipFile(wheels[0]) as z:
    names = [n for n in z.namelist() if n.endswith("/include/nvml.h")]
    if not names:
        sys.exit("no include/nvml.h in " + wheels[0])
    with open(os.path.join(sys.argv[2], "nvml.h"), "wb") as f:
        f.write(z.read(names[0]))
PY
    cppflags+=("-I$nvml/include")
fi

nvml_stub=0
if printf 'char nvmlInit(void);\nint main(void) { return nvmlInit(); }\n' |
    cc -x c - -o "$WORK/nvml-link-test" -L"$cuda_libdir" -L"$cuda_libdir/stubs" -lnvidia-ml \
        >/dev/null 2>&1; then
    step "libnvidia-ml found"
else
    step "no libnvidia-ml to link against: building a link-time stub (not installed)"
    mkdir -p "$nvml/lib"
    {
        echo "/* Link-time stand-in for the NVIDIA driver's libnvidia-ml.so.1, written by"
        echo " * tools/build_ucx_cuda.sh. Never loaded: at run time the driver's library is. */"
        for n in "${nvml_names[@]}"; do
            if [ "$n" = nvmlErrorString ]; then
                echo "const char *$n(int r) { (void)r; return \"nvml stub\"; }"
            else
                echo "int $n(void) { return 999; /* NVML_ERROR_UNKNOWN */ }"
            fi
        done
    } >"$nvml/nvml_stub.c"
    run nvml-stub "$nvml" cc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 \
        -o lib/libnvidia-ml.so.1 nvml_stub.c
    ln -sf libnvidia-ml.so.1 "$nvml/lib/libnvidia-ml.so"
    ldflags+=("-L$nvml/lib")
    nvml_stub=1
fi
rm -f "$WORK/nvml-link-test"

# --- build ---------------------------------------------------------------------------------------
step "autogen.sh"
run autogen "$src" ./autogen.sh

step "configure"
configure_env=()
[ ${#cppflags[@]} -eq 0 ] || configure_env+=("CPPFLAGS=${cppflags[*]}")
[ ${#ldflags[@]} -eq 0 ] || configure_env+=("LDFLAGS=${ldflags[*]}")
run configure "$src" ./configure --prefix="$PREFIX" --with-cuda="$CUDA_HOME" --without-rocm \
    --without-verbs --without-rdmacm --without-knem --without-xpmem --without-ugni --without-go \
    --without-java --without-gdrcopy --disable-doxygen-doc --disable-logging --disable-debug \
    --disable-assertions --disable-params-check --enable-mt "${configure_env[@]}"
grep -qx "HAVE_CUDA_TRUE=''" "$src/config.log" ||
    die "configure did not enable CUDA; see $WORK/logs/configure.log and $src/config.log"

for d in "${build_dirs[@]}"; do
    step "make -C $d"
    run "make-${d//\//-}" "$src" make -j"$JOBS" -C "$d"
done
for d in "${build_dirs[@]}"; do
    step "make -C $d install"
    run "install-${d//\//-}" "$src" make -C "$d" install
done

# --- post-install --------------------------------------------------------------------------------
step "checking the modules"
for m in libuct_cuda libucm_cuda libuct_cma; do
    [ -f "$PREFIX/lib/ucx/$m.so.0" ] || die "$PREFIX/lib/ucx/$m.so.0 was not built; see $WORK/logs"
done
if [ "$nvml_stub" -eq 1 ]; then
    # A name missing from the stub would leave libuct_cuda without libnvidia-ml.so.1 in NEEDED
    # or with an unresolvable symbol; catch that here rather than on the GPU machine.
    mapfile -t need_nvml < <(nm -D --undefined-only "$PREFIX/lib/ucx/libuct_cuda.so.0" |
                            awk '$2 ~ /^nvml/ { print $2 }')
    for n in "${need_nvml[@]}"; do
        printf '%s\n' "${nvml_names[@]}" | grep -qx "$n" ||
            die "libuct_cuda needs $n, which the nvml stub lacks: add it to nvml_names in $0"
    done
fi

step "stripping; removing static libraries, .la, pkg-config files and share/"
find "$PREFIX/lib" \( -name '*.a' -o -name '*.la' \) -delete
rm -rf "$PREFIX/share" "$PREFIX/lib/pkgconfig"
find "$PREFIX/lib" -type f -name '*.so*' -exec strip --strip-unneeded {} +
strip --strip-unneeded "$PREFIX/bin/ucx_info"

step "setting \$ORIGIN-relative RUNPATHs"
# shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader, not the shell
{
    find "$PREFIX/lib" -maxdepth 1 -type f -name '*.so*' -exec patchelf --set-rpath '$ORIGIN' {} \;
    find "$PREFIX/lib/ucx" -maxdepth 1 -type f -name '*.so*' -exec patchelf --set-rpath '$ORIGIN/..' {} \;
    patchelf --set-rpath '$ORIGIN/../lib' "$PREFIX/bin/ucx_info"
}

step "bundling runtime libraries"
cudart=$(readelf -d "$PREFIX/lib/ucx/libuct_cuda.so.0" |
         sed -n 's/.*(NEEDED).*\[\(libcudart\.so[.0-9]*\)\].*/\1/p')
[ -n "$cudart" ] || die "libuct_cuda.so.0 does not name libcudart in NEEDED"
for dir in "$CUDA_HOME/lib64" "$CUDA_HOME/lib"; do
    if [ -e "$dir/$cudart" ]; then
        cp -L "$dir/$cudart" "$PREFIX/lib/$cudart"
        break
    fi
done
[ -e "$PREFIX/lib/$cudart" ] || die "$cudart not found in $CUDA_HOME/lib64 or $CUDA_HOME/lib"
echo "   $cudart from $CUDA_HOME"
numa=$(ldd "$PREFIX/lib/libucs.so.0" | awk '$1 == "libnuma.so.1" && $3 ~ /^\// { print $3 }')
if [ -n "$numa" ]; then
    cp -L "$numa" "$PREFIX/lib/libnuma.so.1"
    echo "   libnuma.so.1 from $numa"
else
    echo "   libnuma.so.1: not used by libucs or not on this machine; not bundled"
fi

step "checking ucx_info"
info=$(LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/ucx_info" -v) ||
    die "$PREFIX/bin/ucx_info -v failed"
if ! grep -qx "# Version $ucx_version" <<<"$info" || ! grep -q -- '--with-cuda' <<<"$info"; then
    die "ucx_info -v does not report UCX $ucx_version built --with-cuda:"$'\n'"$info"
fi

ok=1
size=$(du -sh "$PREFIX" | cut -f1)
cat <<EOF
== done in $(elapsed): UCX $ucx_version with CUDA transports in $PREFIX ($size)

Use it (the tree can be moved or copied to the GPU machine as it is):
  export LD_LIBRARY_PATH=$PREFIX/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
  $PREFIX/bin/ucx_info -d | grep -E 'cuda_copy|cuda_ipc'    # on a GPU machine: both listed
The GPU machine needs the NVIDIA driver (libcuda.so.1, libnvidia-ml.so.1); $cudart is bundled.

duet's workers move device pools through UCX only with --transfer.device-pools auto (default off:
with UCX 1.13.1 that path measured slower than staging, bench/RESULTS.md) and a UCX_TLS that
leaves tcp out, e.g.
  UCX_TLS=sm,self,cuda_copy,cuda_ipc
With tcp allowed they stage through pinned host pools: UCX 1.13's new protocol layer, which duet
switches on for device memory, crashes in ucp_am_send_nbx over tcp.
EOF
