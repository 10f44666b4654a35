#!/bin/bash
# The GPU session (run on the GPU machine from the repository root, with .gpu/ built
# by benches/build_gpu.sh and carried): GPU tests, serve on CUDA, TP on 2 GPUs, the
# kernel benchmark, the PyTorch baseline. Results land in $OUT (default .gpu/out).
set -u
OUT=${OUT:-.gpu/out}; mkdir -p "$OUT"
L=$OUT/logs.txt
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > $OUT/env.txt 2>&1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
echo "== tests" >> $L
timeout 180 .gpu/lib_tests --ignored --test-threads=1 > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$?" >> $L
echo "== verifier drills on the GPU" >> $L
timeout 120 .gpu/verifier_tests --ignored --test-threads=1 > $OUT/gpu_verifier_tests.txt 2>&1; echo "verifier rc=$?" >> $L
echo "== exactness on the GPU (reference model)" >> $L
timeout 200 .gpu/exactness_tests --ignored --test-threads=1 --nocapture > $OUT/exactness_gpu.txt 2>&1; echo "exactness rc=$?" >> $L
echo "== exactness on the GPU (DeepSeek-V4 model)" >> $L
timeout 200 .gpu/v4_runtime_tests --ignored --test-threads=1 --nocapture > $OUT/v4_exactness_gpu.txt 2>&1; echo "v4 exactness rc=$?" >> $L
timeout 200 .gpu/serve --model deepseek-v4-flash --backend cuda --json --out /tmp/sv4 > $OUT/serve_v4_cuda.json 2>>$L; echo "serve v4 rc=$?" >> $L
echo "== serve: the model on CUDA, eager and graphs" >> $L
timeout 150 .gpu/serve --backend cuda --json --out /tmp/sm > $OUT/serve_model_cuda.json 2>>$L; echo "serve model rc=$?" >> $L
timeout 150 .gpu/serve --backend cuda --cuda-graphs --json --out /tmp/smg > $OUT/serve_model_cuda_graphs.json 2>>$L; echo "serve model graphs rc=$?" >> $L
echo "== serve quick cuda" >> $L
timeout 120 .gpu/serve --quick --source synthetic --backend cuda --json --out /tmp/sq > $OUT/serve_quick_cuda.json 2>>$L; echo "serve quick rc=$?" >> $L
echo "== tp" >> $L
timeout 150 .gpu/tp --gpus 0,1 --json > $OUT/tp.json 2>>$L; echo "tp rc=$?" >> $L
echo "== bench" >> $L
timeout 200 .gpu/gpu_bench > $OUT/gpu_bench.json 2>>$L; echo "bench rc=$?" >> $L
echo "== torch" >> $L
timeout 120 python3 benches/torch_scatter.py > $OUT/torch_scatter.json 2>>$L; echo "torch rc=$?" >> $L
echo "== serve full cuda" >> $L
timeout 150 .gpu/serve --source synthetic --backend cuda --json --out /tmp/sf > $OUT/serve_full_cuda.json 2>>$L; echo "serve full rc=$?" >> $L
exit 0
