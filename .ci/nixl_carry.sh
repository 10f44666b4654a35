#!/usr/bin/env bash
# Copies the smallest NIXL tree that runs the UCX backend out of an unpacked nixl-cu1x wheel.
# usage: .ci/nixl_carry.sh UNPACKED_WHEEL_DIR OUT_DIR [--cuda]
# Keeps the wheel's relative layout (.nixl_cuXX.mesonpy.libs/ + nixl_cuXX.libs/) so the
# libraries' $ORIGIN run paths and UCX's module folder (nixl_cuXX.libs/ucx) keep working;
# the copies are stripped (nixl-cu13 1.5.1: about 30 MiB instead of 229). Seeds:
# libnixl_capi.so (what nixl-sys's stub API dlopens), plugins/libplugin_UCX.so, UCX's cma
# module; --cuda adds UCX's CUDA modules (cuda_copy / cuda_ipc, for MemKind::Device).
# Everything else is their ldd closure inside the wheel.
set -euo pipefail
W=$(cd "$1" && pwd)
OUT=$2
CUDA=${3:-}
M=$(cd "$W" && ls -d .nixl_cu*.mesonpy.libs)
L=$(cd "$W" && ls -d nixl_cu*.libs)
seed=("$M/libnixl_capi.so" "$M/plugins/libplugin_UCX.so" "$L/ucx/libuct_cma.so.0.0.0")
if [ "$CUDA" = --cuda ]; then
  seed+=("$L/ucx/libuct_cuda.so.0.0.0" "$L/ucx/libucm_cuda.so.0.0.0")
fi
files=$(
  (
    cd "$W"
    printf '%s\n' "${seed[@]}"
    # Resolved through the wheel's own run paths, not some other NIXL on LD_LIBRARY_PATH.
    for f in "${seed[@]}"; do env -u LD_LIBRARY_PATH ldd "$f" | awk '$3 ~ /^\//{print $3}'; done
  ) | grep -v '^$' | while read -r p; do
    case $p in
      /*) realpath -m --relative-to="$W" "$p" ;;
      *) echo "$p" ;;
    esac
  done | grep -v '^\.\./' | sort -u
)
for f in $files; do
  mkdir -p "$OUT/$(dirname "$f")"
  cp -L "$W/$f" "$OUT/$f"
  strip --strip-unneeded "$OUT/$f"
done
du -sb "$OUT" | awk '{printf "nixl_carry: %.1f MiB in ", $1/1048576}' >&2
find "$OUT" -type f | wc -l | awk '{print $1 " files"}' >&2
