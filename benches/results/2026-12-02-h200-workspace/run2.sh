#!/bin/bash
cd "$(dirname "$0")"; export CUDA_HOME=/usr/local/cuda
for i in 1 2 3; do echo "== verifier all, run $i"; timeout 90 ./verifier_tests --ignored --test-threads=1 2>&1 | grep -E "^test |called|start:"; done
echo "== under compute-sanitizer: OOM then out-of-range"
timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 2 --show-backtrace no ./verifier_tests --ignored --test-threads=1 a_runtime_larger an_out_of_range 2>&1 | grep -v "^\s*$" | grep -v "OUT_OF_MEMORY\|^=========\s*$" | tail -8
echo "== cuda lib tests"; timeout 120 ./lib_tests --ignored --test-threads=1 2>&1 | grep "test result"
