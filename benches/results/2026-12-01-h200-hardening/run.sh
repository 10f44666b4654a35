#!/bin/bash
# GPU session for the hardened NCCL transport (authenticated pairing, windows, InFlight
# drill) on one H200; built as in benches/gpu_nccl.sh (nccl_transfer with
# --all-features, so the fault-injection drill runs).
cd "$(dirname "$0")"
O=${OUT:-/tmp/out}; mkdir -p $O
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_DEBUG=WARN DSA_KV_REQUIRE_NCCL=1
run() { local name=$1; shift; echo "=== $name: $*" >> $O/log.txt; local t0=$(date +%s%N); timeout 150 "$@" > $O/$name.out 2> $O/$name.err; echo "rc=$? ms=$(( ($(date +%s%N) - t0) / 1000000 ))" >> $O/log.txt; tail -3 $O/$name.out >> $O/log.txt; grep -E "prefill\]|decode\]|error|panicked" $O/$name.err | tail -12 >> $O/log.txt; }
{ nvidia-smi -L; } >> $O/log.txt 2>&1
run nccl_test ./nccl_transfer --nocapture --test-threads 1
run cuda_nccl ./disagg --backend cuda --transport nccl
run cuda_nccl_drop ./disagg --backend cuda --transport nccl --drop index_key --requests 1
run cuda_nccl_drop_draft ./disagg --backend cuda --transport nccl --drop draft --requests 1
run bench_cuda_nccl_64 ./disagg --backend cuda --transport nccl --bench-blocks 64 --layers 61 --json
run host_nccl ./disagg --backend host --transport nccl --requests 1
tar czf $O/outputs.tgz -C $O --exclude outputs.tgz .
cat $O/log.txt
