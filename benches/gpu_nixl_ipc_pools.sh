#!/bin/bash
# GPU session for the IPC-capable pools (`--backend cuda-ipc`). Build here:
#   cargo build --release --all-features --example disagg
#   cargo test --release --all-features -p dsa-kv-cuda --lib --no-run     # prints the lib test binary
#   mkdir -p .gpu; cp target/release/examples/disagg .gpu/; cp target/release/deps/dsa_kv_cuda-<hash> .gpu/lib_tests; strip .gpu/*
#   NIXL_HOME=$PWD/.gpu/nixl .ci/nixl_setup.sh --cuda
# then run `bash .gpu/run.sh` there with .gpu carried (copy this file to .gpu/run.sh).
cd "$(dirname "$0")"
mkdir -p $OUT/r
timeout 240 ./lib_tests --ignored --test-threads=1 > $OUT/r/cuda_lib_tests.txt 2>&1; echo "cuda lib tests rc=$?"; grep "test result" $OUT/r/cuda_lib_tests.txt; grep -E "FAILED|panicked" $OUT/r/cuda_lib_tests.txt | head -5; grep ipc_pools $OUT/r/cuda_lib_tests.txt
export LD_LIBRARY_PATH=$PWD/nixl/.nixl_cu13.mesonpy.libs NIXL_PLUGIN_DIR=$PWD/nixl/.nixl_cu13.mesonpy.libs/plugins
unset UCX_TLS
for i in 1 2; do timeout 200 ./disagg --backend cuda-ipc --transport nixl --bench-blocks 64 --layers 61 --json --bench-two-processes > $OUT/r/bench_ipc_nixl_2proc_$i.txt 2>&1; echo "bench ipc rc=$?"; grep '^{' $OUT/r/bench_ipc_nixl_2proc_$i.txt; done
UCX_PROTO_INFO=y timeout 200 ./disagg --backend cuda-ipc --transport nixl --bench-blocks 16 --layers 61 --bench-two-processes > $OUT/r/proto.txt 2>&1; grep -h "from cuda/GPU0 to cuda" -A5 $OUT/r/proto.txt | grep -v "+--" | head -3
timeout 200 ./disagg --backend cuda-ipc --transport nixl > $OUT/r/cuda_ipc_nixl.txt 2>&1; echo "model ipc nixl rc=$?"; tail -1 $OUT/r/cuda_ipc_nixl.txt
timeout 200 ./disagg --backend cuda-ipc --transport nixl --drop index_key --requests 1 > $OUT/r/cuda_ipc_nixl_drop.txt 2>&1; echo "drill rc=$?"
timeout 200 ./disagg --backend cuda --transport nixl > $OUT/r/cuda_nixl.txt 2>&1; echo "model vmm nixl rc=$?"; tail -1 $OUT/r/cuda_nixl.txt
rm -f $OUT/r/proto.txt
