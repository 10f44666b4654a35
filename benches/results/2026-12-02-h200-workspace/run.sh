#!/bin/bash
# The workspace split checked on one H200: the CUDA crate's tests, the GPU drills, the
# model's exactness, serve on CUDA (model and synthetic writer: the CUDA backend's own
# synthetic writer now), tp with two device actors on one GPU, the NCCL transport (now
# in dsa-kv-cuda) and the kernel bench.
cd "$(dirname "$0")"
O=${OUT:-/tmp/out}; mkdir -p $O/r
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
run() { local name=$1; local t=$2; shift 2; echo "=== $name: $*" >> $O/r/log.txt; local t0=$(date +%s%N); timeout $t "$@" > $O/r/$name.out 2> $O/r/$name.err; echo "rc=$? ms=$(( ($(date +%s%N) - t0) / 1000000 ))" >> $O/r/log.txt; grep -E "test result|FAILED|panicked" $O/r/$name.out | tail -5 >> $O/r/log.txt; tail -2 $O/r/$name.err >> $O/r/log.txt; }
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; } > $O/r/env.txt 2>&1
run cuda_lib_tests 150 ./lib_tests --ignored --test-threads=1
run verifier_gpu 100 ./verifier_tests --ignored --test-threads=1
run forward_boundary_gpu 60 ./forward_boundary_tests --ignored --test-threads=1
run exactness_gpu 150 ./exactness_tests --ignored --test-threads=1
run serve_model_cuda 90 ./serve --quick --backend cuda --json --out /tmp/sm
run serve_model_cuda_graphs 90 ./serve --quick --backend cuda --cuda-graphs --json --out /tmp/smg
run serve_synthetic_cuda 90 ./serve --quick --source synthetic --backend cuda --verify all --json --out /tmp/sq
run tp_two_actors_one_gpu 60 ./tp --gpus 0,0 --json
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_DEBUG=WARN DSA_KV_REQUIRE_NCCL=1
run nccl_test 120 ./nccl_transfer --nocapture --test-threads 1
run disagg_cuda_nccl 90 ./disagg --backend cuda --transport nccl --json
run disagg_cuda_nccl_drop 60 ./disagg --backend cuda --transport nccl --drop index_key --requests 1 --json
run gpu_bench 120 ./gpu_bench
cat $O/r/log.txt
tar czf $O/results.tgz -C $O r
