#!/bin/bash
# GPU session: is the slow NIXL GPU path our VMM pools? Build here:
#   cargo build --release --all-features --example nixl_ipc_probe --example disagg
#   mkdir -p .gpu; cp target/release/examples/{nixl_ipc_probe,disagg} .gpu/; strip .gpu/*
#   NIXL_HOME=$PWD/.gpu/nixl .ci/nixl_setup.sh --cuda     # NIXL + UCX's CUDA modules
# then run `bash .gpu/run.sh` there with .gpu carried (copy this file to .gpu/run.sh).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/nixl/.nixl_cu13.mesonpy.libs NIXL_PLUGIN_DIR=$PWD/nixl/.nixl_cu13.mesonpy.libs/plugins
unset UCX_TLS
mkdir -p $OUT/r
UCX_PROTO_INFO=y timeout 120 ./nixl_ipc_probe > $OUT/r/probe_proto.txt 2>&1; echo "probe rc=$?"
grep -h "^write" $OUT/r/probe_proto.txt; grep -h "from cuda/GPU0 to cuda" -A5 $OUT/r/probe_proto.txt | grep -v "+--" | head -4
for i in 1 2; do timeout 120 ./nixl_ipc_probe --mib 172 > $OUT/r/probe_172_$i.txt 2>&1; echo "rc=$?"; cat $OUT/r/probe_172_$i.txt; done
for i in 1 2; do timeout 200 ./disagg --backend cuda --transport nixl --bench-blocks 64 --layers 61 --json --bench-two-processes > $OUT/r/bench_nixl_2proc_$i.txt 2>&1; echo "rc=$?"; grep '^{' $OUT/r/bench_nixl_2proc_$i.txt; done
