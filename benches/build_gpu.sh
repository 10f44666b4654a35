#!/bin/bash
# Builds everything the GPU session needs on this (GPU-less) machine and copies the
# stripped binaries into .gpu/ (ignored by git; carry it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --all-features --examples
# The CUDA backend's own tests: the lib tests of dsa-kv-cuda.
lib_tests=$(cargo test --release --all-features -p dsa-kv-cuda --lib --no-run --message-format=json 2>/dev/null |
  python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])')
# The executable of target $2 built by `cargo $1` (test: an integration test; bench).
artifact() {
  local release=--release
  [ "$1" = bench ] && release=
  cargo "$1" $release --all-features --"${3:-test}" "$2" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2"
}
verifier=$(artifact test verifier)
forward_boundary=$(artifact test forward_boundary)
exactness=$(artifact test exactness)
v4_runtime=$(artifact test v4_runtime)
runtime_bench=$(artifact bench runtime bench)
mkdir -p .gpu
cp "$lib_tests" .gpu/lib_tests
cp "$verifier" .gpu/verifier_tests
cp "$forward_boundary" .gpu/forward_boundary_tests
cp "$exactness" .gpu/exactness_tests
cp "$v4_runtime" .gpu/v4_runtime_tests
cp "$runtime_bench" .gpu/runtime_bench
cp "${CARGO_TARGET_DIR:-target}"/release/examples/{serve,gpu_bench,tp} .gpu/
strip .gpu/lib_tests .gpu/verifier_tests .gpu/forward_boundary_tests .gpu/exactness_tests .gpu/v4_runtime_tests .gpu/runtime_bench .gpu/serve .gpu/gpu_bench .gpu/tp
ls -la .gpu
