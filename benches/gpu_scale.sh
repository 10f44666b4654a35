#!/bin/bash
# The production-scale step bench on one H200 (run from the repository root on the GPU
# machine, with .gpu/scale/scale_bench built here by
# `cargo build --release --example scale_bench` and stripped). Writes only
# $OUT/scale.jsonl (one JSON line per point), $OUT/scale.svg (the plot) and
# $OUT/scale_log.txt (progress and errors). About 4 minutes at most.
#
# 1. The sweep (at most 165 s): DeepSeek-V3.2 (61 layers + MTP), a 100 GB GPU pool
#    (VMM), a 32 GB pinned host tier (128 GiB RAM on that machine), the GPU pool 90 %
#    full of stale prefixes first; context 4K..128K at batch 256, batch 64..1024 at 32K;
#    per point 50 warm-up steps and 400 timed steps; --forward kernels (our quantize and
#    scatter kernels write every new token's KV on all 62 layers, inputs already on the
#    GPU).
# 2. The same step with the synthetic writer (at most 55 s): KV generated on the host for
#    every layer, one small point (context 4K, batch 16, 20 GB pool, no fill, 2 GB host tier),
#    to show what host-side KV generation costs next to the cache manager.
set -u
OUT=${OUT:-.gpu/scale/out}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
B=.gpu/scale/scale_bench
LOG=$OUT/scale_log.txt
: > "$OUT/scale.jsonl"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv; free -g; nproc; } > "$LOG" 2>&1
echo "== sweep: --forward kernels" >> "$LOG"
timeout 165 $B --backend cuda --forward kernels --pool-gb 100 --host-gb 32 \
  --steps 400 --warmup 50 --svg "$OUT/scale.svg" >> "$OUT/scale.jsonl" 2>> "$LOG"
echo "sweep rc=$?" >> "$LOG"
echo "== one point: --forward synthetic" >> "$LOG"
timeout 55 $B --backend cuda --forward synthetic --pool-gb 20 --host-gb 2 --fill 0 \
  --only context --contexts 4096 --fixed-batch 16 --steps 40 --warmup 5 \
  >> "$OUT/scale.jsonl" 2>> "$LOG"
echo "synthetic rc=$?" >> "$LOG"
exit 0
