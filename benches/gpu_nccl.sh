#!/bin/bash
# GPU session for the NCCL transport (issue 14) on the H200. Build here:
#   cargo build --release --all-features --example disagg
#   cargo test --release --all-features --test nccl_transfer --no-run   # prints the binary
#   mkdir -p .gpu; cp target/release/examples/disagg .gpu/
#   cp target/release/deps/nccl_transfer-<hash> .gpu/nccl_transfer; strip .gpu/*
# then run `bash .gpu/run.sh` there with .gpu carried (copy this file to .gpu/run.sh).
# NCCL comes from the machine (libnccl.so.2 in /usr/lib/x86_64-linux-gnu). With one GPU
# both ranks share it: the decode process gets its own NCCL_HOSTID (the example and the
# test set it), and NCCL moves the bytes over sockets on loopback.
cd "$(dirname "$0")"
O=${OUT:-/tmp/out}; mkdir -p $O
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_DEBUG=WARN DSA_KV_REQUIRE_NCCL=1
run() { local name=$1; shift; echo "=== $name: $*" >> $O/log.txt; local t0=$(date +%s%N); timeout 240 "$@" > $O/$name.out 2> $O/$name.err; echo "rc=$? ms=$(( ($(date +%s%N) - t0) / 1000000 ))" >> $O/log.txt; tail -3 $O/$name.out >> $O/log.txt; tail -5 $O/$name.err >> $O/log.txt; }
{ nvidia-smi -L; ls -la /usr/lib/x86_64-linux-gnu/ | grep -i nccl; } >> $O/log.txt 2>&1
run nccl_test ./nccl_transfer --nocapture --test-threads 1
run cuda_nccl ./disagg --backend cuda --transport nccl
run cuda_nccl_drop ./disagg --backend cuda --transport nccl --drop index_key --requests 1
run cuda_nccl_drop_draft ./disagg --backend cuda --transport nccl --drop draft --requests 1
run bench_cuda_nccl_8 ./disagg --backend cuda --transport nccl --bench-blocks 8 --layers 61 --json
run bench_cuda_nccl_64 ./disagg --backend cuda --transport nccl --bench-blocks 64 --layers 61 --json
run host_nccl ./disagg --backend host --transport nccl --requests 1
cat $O/log.txt
