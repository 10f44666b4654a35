#!/bin/bash
# The launch macro, the pool drop fix and the model crate's split checked on one H200:
# the CUDA crate's GPU tests (each kernel against its host reference, pools, and the new
# a_pool_dropped_with_work_queued_waits_for_it), the GPU drills (three times, one process
# each), the model's exactness, serve on CUDA (model eager and with graphs, synthetic
# writer with every layer verified), tp with two device actors on one GPU, the NCCL
# transport and disagg over it, the kernel bench, and the OOM-then-out-of-range pair under
# compute-sanitizer.
cd "$(dirname "$0")"
O=${OUT:-/tmp/out}; R=/tmp/h200-house; rm -rf $R; mkdir -p $O $R
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
run() { local name=$1; local t=$2; shift 2; if (( SECONDS + t > 520 )); then echo "=== $name: skipped (the 520 s budget of this script)" >> $R/log.txt; return; fi; echo "=== $name: $*" >> $R/log.txt; local t0=$(date +%s%N); timeout $t "$@" > $R/$name.out 2> $R/$name.err; echo "rc=$? ms=$(( ($(date +%s%N) - t0) / 1000000 ))" >> $R/log.txt; grep -E "test result|FAILED|panicked" $R/$name.out | tail -5 >> $R/log.txt; tail -2 $R/$name.err >> $R/log.txt; cp $R/log.txt $O/log.txt; }
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; } > $R/env.txt 2>&1
run cuda_lib_tests 90 ./lib_tests --ignored --test-threads=1
run verifier_gpu 60 ./verifier_tests --ignored --test-threads=1
run verifier_gpu_2 60 ./verifier_tests --ignored --test-threads=1
run verifier_gpu_3 60 ./verifier_tests --ignored --test-threads=1
run forward_boundary_gpu 45 ./forward_boundary_tests --ignored --test-threads=1
run exactness_gpu 120 ./exactness_tests --ignored --test-threads=1
run serve_model_cuda 45 ./serve --quick --backend cuda --json --out /tmp/sm
run serve_model_cuda_graphs 45 ./serve --quick --backend cuda --cuda-graphs --json --out /tmp/smg
run serve_synthetic_cuda 75 ./serve --quick --source synthetic --backend cuda --verify all --json --out /tmp/sq
run tp_two_actors_one_gpu 45 ./tp --gpus 0,0 --json
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_DEBUG=WARN DSA_KV_REQUIRE_NCCL=1 NCCL_NVLS_ENABLE=0
run nccl_test 60 ./nccl_transfer --nocapture --test-threads 1
run disagg_cuda_nccl 45 ./disagg --backend cuda --transport nccl --json
run disagg_cuda_nccl_drop 45 ./disagg --backend cuda --transport nccl --drop index_key --requests 1 --json
run gpu_bench 60 ./gpu_bench
run sanitizer_oom_then_oor 90 $CUDA_HOME/bin/compute-sanitizer --tool memcheck --print-limit 2 --show-backtrace no ./verifier_tests --ignored --test-threads=1 a_runtime_larger an_out_of_range
echo "sanitizer: $(cat $R/sanitizer_oom_then_oor.* | grep -ci "illegal address") lines naming an illegal address; $(cat $R/sanitizer_oom_then_oor.* | grep "ERROR SUMMARY")" >> $R/log.txt
cat $R/log.txt
cp $R/log.txt $R/gpu_bench.out $O/
tar czf $O/results.tgz -C /tmp h200-house
