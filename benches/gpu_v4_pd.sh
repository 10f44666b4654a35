#!/bin/bash
# GPU session for V4 P/D (issue 40): DeepSeek-V4 through the CUDA backend's windowed
# device, moved over NCCL and NIXL (one GPU: NCCL's two ranks over loopback sockets,
# NIXL's UCX with its CUDA modules), DSA beside it; the CUDA lib tests and the V4
# runtime's GPU test (the windowed pools' host tier is now pinned memory). Build here:
#   bash benches/build_gpu.sh; cp target/release/examples/disagg .gpu/; strip .gpu/disagg
#   NIXL_HOME=$PWD/.gpu/nixl .ci/nixl_setup.sh --cuda    # UCX's CUDA modules (30 MiB)
# keep only lib_tests, v4_runtime_tests, disagg and nixl in .gpu (the 64 MiB carry), copy
# this file to .gpu/run.sh and run `bash .gpu/run.sh` there with .gpu carried.
cd "$(dirname "$0")"
O=${OUT:-/tmp/out}; mkdir -p $O
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_DEBUG=WARN DSA_KV_REQUIRE_NCCL=1
run() { local name=$1; shift; echo "=== $name: $*" >> $O/log.txt; local t0=$(date +%s%N); timeout 240 "$@" > $O/$name.out 2> $O/$name.err; echo "rc=$? ms=$(( ($(date +%s%N) - t0) / 1000000 ))" >> $O/log.txt; tail -4 $O/$name.out >> $O/log.txt; grep -E "test result|FAILED|panicked|error" $O/$name.err | tail -4 >> $O/log.txt; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $O/log.txt 2>&1
run v4_cuda_nccl ./disagg --model deepseek-v4-flash --backend cuda --transport nccl --requests 2
run dsa_cuda_nccl ./disagg --backend cuda --transport nccl --requests 2
if [ -d nixl ]; then
  export LD_LIBRARY_PATH=$PWD/nixl/.nixl_cu13.mesonpy.libs NIXL_PLUGIN_DIR=$PWD/nixl/.nixl_cu13.mesonpy.libs/plugins
  unset UCX_TLS
  run v4_cuda_nixl ./disagg --model deepseek-v4-flash --backend cuda --transport nixl --requests 2
  run dsa_cuda_nixl ./disagg --backend cuda --transport nixl --requests 2
fi
run lib_tests ./lib_tests --ignored --test-threads=1
run v4_runtime ./v4_runtime_tests --ignored --test-threads=1 --nocapture
cat $O/log.txt
