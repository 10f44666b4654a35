#!/usr/bin/env bash
# The NIXL runtime for the `nixl` feature's tests, on a clean Debian 12 box (root, no GPU).
#
# usage (run it, do not source it; it prints the exports on stdout, progress on stderr):
#   exports=$(.ci/nixl_setup.sh [--cuda]) && eval "$exports"
# (an assignment, not `eval "$(...)"`, so that `set -e` sees a failure.)
#
# Idempotent:
# 1. libclang (nixl-sys's build script runs bindgen, which dlopens it): `apt-get install
#    libclang-dev` when no libclang.so is there.
# 2. The NIXL runtime from PyPI: `pip download --no-deps nixl-cu13==1.5.1` (files only: the
#    wheel Requires torch and numpy, which the C API does not use; 1.5.1 because nixl 1.5.2's
#    meta wheel asks for nixl-cu13==1.5.2, which is not published), unpacked, trimmed to
#    what the UCX backend loads (.ci/nixl_carry.sh, about 30 MiB) into
#    NIXL_HOME (default: $CARGO_TARGET_DIR/nixl, else ./target/nixl). A `.ok` marker
#    caches it: delete NIXL_HOME to redo it.
# 3. Prints: export NIXL_HOME, LD_LIBRARY_PATH (prepended), NIXL_PLUGIN_DIR, and UCX_TLS
#    (tcp,self unless already set: no RDMA here, and it does not need ptrace between the
#    test's two processes, as UCX's default cma transport does).
#
# Env: NIXL_HOME, NIXL_WHEEL (default nixl-cu13==1.5.1), CARGO_TARGET_DIR.
# --cuda: also carry UCX's CUDA modules (GPU memory through NIXL; a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."

CUDA=${1:-}
NIXL_WHEEL=${NIXL_WHEEL:-nixl-cu13==1.5.1}
NIXL_HOME=${NIXL_HOME:-${CARGO_TARGET_DIR:-$PWD/target}/nixl}
log() { printf 'nixl_setup: %s\n' "$*" >&2; }
t0=$SECONDS

# 1. libclang for bindgen.
have_libclang() {
  compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null \
    || compgen -G '/usr/lib/*/libclang-[0-9]*.so*' >/dev/null \
    || { [ -n "${LIBCLANG_PATH:-}" ] && compgen -G "$LIBCLANG_PATH/libclang*.so*" >/dev/null; }
}
if ! have_libclang; then
  log "installing libclang-dev (apt-get)"
  SUDO=
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libclang-dev >&2
fi

# 2. The runtime, once.
if [ ! -e "$NIXL_HOME/.ok" ]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    log "installing python3-pip (apt-get)"
    SUDO=
    [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-pip >&2
  fi
  for tool in ldd strip; do
    command -v "$tool" >/dev/null || { log "needs $tool (binutils, libc-bin)"; exit 1; }
  done
  log "fetching $NIXL_WHEEL into $NIXL_HOME"
  rm -rf "$NIXL_HOME"
  mkdir -p "$(dirname "$NIXL_HOME")"
  tmp=$(mktemp -d "$NIXL_HOME.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  # The wheel is tagged for CPython 3.11 only, but the libraries we take do not depend on
  # Python: ask for that tag whatever python3 this is.
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64 \
    -d "$tmp" "$NIXL_WHEEL" >&2
  python3 -m zipfile -e "$tmp"/*.whl "$tmp/unpacked"
  .ci/nixl_carry.sh "$tmp/unpacked" "$NIXL_HOME" $CUDA
  printf '%s\n' "$NIXL_WHEEL" "$(cd "$tmp" && ls ./*.whl)" >"$NIXL_HOME/.ok"
  rm -rf "$tmp"
  trap - EXIT
fi

M=$(ls -d "$NIXL_HOME"/.nixl_cu*.mesonpy.libs)
missing=$(env -u LD_LIBRARY_PATH ldd "$M/libnixl_capi.so" "$M/plugins/libplugin_UCX.so" | grep 'not found' || true)
if [ -n "$missing" ]; then
  log "libraries missing from $NIXL_HOME (delete it and rerun):"
  printf '%s\n' "$missing" >&2
  exit 1
fi
log "ready in $((SECONDS - t0)) s: $(du -sh "$NIXL_HOME" | cut -f1) in $NIXL_HOME"

printf "export NIXL_HOME='%s'\n" "$NIXL_HOME"
printf "export LD_LIBRARY_PATH='%s'\n" "$M${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
printf "export NIXL_PLUGIN_DIR='%s'\n" "$M/plugins"
printf "export UCX_TLS='%s'\n" "${UCX_TLS:-tcp,self}"
