#!/usr/bin/env bash
# The oracle session on the GPU machine (H200, CUDA 13, torch 2.11, transformers 5.17, no
# network), from the repository root, with these carried (all git-ignored):
#   .gpu/oracles          benches/oracles/make_dumps.sh's output (dumps, block tables)
#   .gpu/wheels           the sgl-flash-mla 1.0.0 wheel (pip download --no-deps sgl-flash-mla==1.0.0)
#   target/deepgemm-src   DeepGEMM sources, CUTLASS/fmt headers and the build and smoke scripts
#                         (benches/oracles/deepgemm/prepare.sh assembles it from fetched
#                         mirrors; optional: without it DeepGEMM is skipped)
# What it runs, results under $OUT/r (bundled into $OUT/results.tgz):
#   1. tests/fixtures/hf/make_fixtures.py: the tiny HF checkpoints and HF's outputs (CPU);
#   2. DeepGEMM built from source (target/deepgemm-src/build.sh, in the background);
#   3. benches/oracles/kernels.py --flashmla --speed: FlashMLA on our pools;
#   4. kernels.py --deepgemm --speed with the first DeepGEMM build that passed its smoke test.
set -u
: "${OUT:?OUT must name the results folder}"
R=$OUT/r
mkdir -p "$R"
T0=$(date +%s)
say() { echo "[run.sh +$(( $(date +%s) - T0 ))s] $*"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$R/env.txt" 2>&1

HF=""
if [ "${HF_FIXTURES:-1}" = 1 ]; then
  say "HF fixtures"
  ( timeout 300 python3 tests/fixtures/hf/make_fixtures.py --out "$R/hf" > "$R/hf.log" 2>&1
    echo "make_fixtures rc=$?" >> "$R/hf.log" ) &
  HF=$!
fi

DG=""
if [ -x target/deepgemm-src/build.sh ]; then
  say "DeepGEMM builds (background)"
  mkdir -p "$R/deepgemm"
  # The extension is built with the system GCC, the one torch was built with: Python's
  # own build configuration names another toolchain (/opt/gcc) whose libstdc++ pieces,
  # linked into the extension beside torch's libstdc++, crash in std::locale (codecvt)
  # at the first formatted output or regex (seen 2026-12-03: every DeepGEMM build).
  ( OUT="$R/deepgemm" CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -pthread -shared" \
      DG_BUDGET_S=${DG_BUDGET_S:-330} DG_COMMITS=${DG_COMMITS:-54e2261} \
      DG_VARIANTS=${DG_VARIANTS-} DG_PERF=0 DG_SHIM=${DG_SHIM:-0} \
      bash target/deepgemm-src/build.sh > "$R/deepgemm/build_stdout.txt" 2>&1 ) &
  DG=$!
fi

say "FlashMLA"
rm -rf /tmp/fm && mkdir -p /tmp/fm
python3 -m pip install -q --no-deps --no-index --target /tmp/fm .gpu/wheels/sgl_flash_mla-*.whl > "$R/flashmla_install.txt" 2>&1
PYTHONPATH=/tmp/fm timeout 240 python3 benches/oracles/kernels.py --inputs .gpu/oracles \
  --out "$R/flashmla.json" --flashmla --speed > "$R/flashmla.txt" 2>&1
say "FlashMLA rc=$?"

if [ -n "$DG" ]; then
  wait "$DG"
  say "DeepGEMM builds done"
  V=$(python3 - "$R/deepgemm/results.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["variants"]
except Exception:
    sys.exit(0)
ok = [v for v, x in r.items() if x.get("verdict") == "PASS" and v != "shim" and not v.endswith("-probe")]
print(ok[0] if ok else "")
EOF
)
  if [ -n "$V" ]; then
    say "DeepGEMM oracle with variant $V"
    PYTHONPATH=/tmp/dgwork/$V DG_JIT_CACHE_DIR=/tmp/dgwork/jit-$V timeout 240 python3 benches/oracles/kernels.py \
      --inputs .gpu/oracles --out "$R/deepgemm.json" --deepgemm --speed > "$R/deepgemm.txt" 2>&1
    say "DeepGEMM oracle rc=$?"
  else
    say "no DeepGEMM variant passed its smoke test: see deepgemm/summary.txt"
  fi
fi
# The runtime benchmark of two builds, alternately, on this quiet 16-core host
# (.gpu/bench/runtime_old, runtime_new: `cargo bench --bench runtime --no-run` of each
# commit, stripped); criterion medians in $R/bench_*.txt.
if [ -x .gpu/bench/runtime_old ] && [ -x .gpu/bench/runtime_new ]; then
  for i in 1 2; do
    for b in old new; do
      say "runtime bench $b ($i)"
      timeout 120 .gpu/bench/runtime_$b --bench --warm-up-time 1 --measurement-time 3 \
        > "$R/bench_runtime_${b}_$i.txt" 2>&1
    done
  done
fi

if [ -n "$HF" ]; then
  wait "$HF"
  say "HF fixtures: $(tail -1 "$R/hf.log")"
fi
tar czf "$OUT/results.tgz" -C "$OUT" r
say "done"
