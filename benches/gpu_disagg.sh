#!/bin/bash
# GPU session for issue 14 (prefill/decode over NIXL on the H200). Build here:
#   cargo build --release --all-features --example disagg; mkdir -p .gpu; cp target/release/examples/disagg .gpu/; strip .gpu/disagg
#   NIXL_HOME=$PWD/.gpu/nixl .ci/nixl_setup.sh --cuda     # the UCX CUDA modules too (30 MiB)
# then run `bash .gpu/run.sh` there with .gpu carried (copy this file to .gpu/run.sh).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/nixl/.nixl_cu13.mesonpy.libs NIXL_PLUGIN_DIR=$PWD/nixl/.nixl_cu13.mesonpy.libs/plugins
unset UCX_TLS
O=${OUT:-/tmp/out}; mkdir -p $O
run() { local name=$1; shift; echo "=== $name: $*" >> $O/log.txt; timeout 240 "$@" > $O/$name.out 2> $O/$name.err; echo "rc=$?" >> $O/log.txt; tail -2 $O/$name.out >> $O/log.txt; }
run cuda_nixl ./disagg --backend cuda --transport nixl
run cuda_nixl_drop ./disagg --backend cuda --transport nixl --drop index_key --requests 1
run cuda_nixl_drop_draft ./disagg --backend cuda --transport nixl --drop draft --requests 1
run bench_cuda_nixl ./disagg --backend cuda --transport nixl --bench-blocks 64 --layers 61
run bench_host_nixl ./disagg --backend host --transport nixl --bench-blocks 64 --layers 61
{ echo "=== NCCL on this machine"; ldconfig -p | grep -i nccl; ls /usr/lib/x86_64-linux-gnu | grep -i nccl; find / -xdev -name 'libnccl*' 2>/dev/null | head; nvidia-smi -L; } >> $O/log.txt 2>&1
cat $O/log.txt
