#!/usr/bin/env bash
# build.sh -- run on the GPU machine (H200, CUDA 13.0 at /usr/local/cuda, torch 2.11+cu130,
# no network) from anywhere; it works on the carry folder it lives in (made by prepare.sh):
#   <carry>/dg-<commit>/...          DeepGEMM source trees (no third-party headers)
#   <carry>/third-party/cutlass-<pin>/include, fmt-<pin>/include
#   <carry>/smoke.py, segv_trace.c
#
# Build it with the GCC torch was built with: CC=/usr/bin/gcc CXX=/usr/bin/g++
# LDSHARED="/usr/bin/g++ -pthread -shared" (benches/oracles/run.sh sets them). On the H200
# machine Python's build configuration names /opt/gcc, whose libstdc++ pieces end up in the
# extension beside torch's libstdc++ and crash it in std::locale at the first formatted
# output (2026-12-03: every build and variant crashed so, SIGSEGV in codecvt / regex; with the
# system GCC 13.3 every smoke test passed).
#
# What it does (everything under the scratch dir $DG_WORK, default /tmp/dgwork):
#   1. environment report
#   2. in parallel: `python3 setup.py build` of every DeepGEMM commit (develop layout, like
#      DeepGEMM's develop.sh), extra variants of the primary commit (rtapi = DeepGEMM's own
#      DG_JIT_USE_RUNTIME_API switch, cxx20 = host code built as C++20 like vLLM does,
#      noregex = std::regex removed from the JIT host code), and the AOT ctypes shim
#   3. in parallel: smoke.py for every built variant (JIT debug output unbuffered, faulthandler,
#      LD_PRELOAD'ed native backtrace on SIGSEGV/SIGABRT) and for the shim
#   4. for the first variant that died on a signal: addr2line on the native backtrace, a
#      cuda-gdb batch backtrace (CUDA_LAUNCH_BLOCKING=1), an NVRTC rerun and compute-sanitizer
#      (each only while the time budget allows)
#   5. writes at most 3 files to $OUT: summary.txt, results.json, logs.tar.gz
#
# Knobs (environment):
#   OUT            results folder (required)
#   DG_COMMITS     commits to build (default: every dg-* folder, MANIFEST order)
#   DG_PRIMARY     commit that gets the extra variants (default: first of DG_COMMITS)
#   DG_VARIANTS    extra variants for the primary (rtapi, cxx20; default none)
#   DG_EXT         0 = skip the DeepGEMM extension builds (default 1)
#   DG_SHIM        1 = build + test an AOT shim (default 0; not carried)
#   DG_SHIM_COMMIT commit whose kernel headers the shim compiles (default: DG_PRIMARY)
#   DG_DIAG        1 = debugging reruns on a crash (default 1)
#   DG_PERF        1 = also time a B=64 decode batch on passing variants (default 1)
#   DG_UPSTREAM    1 = also run upstream tests/test_attention.py::test_paged_mqa_logits
#                  (DG_MQA_NUM_CASES=2) for passing default variants (default 0, slow)
#   DG_BUDGET_S    wall-clock budget in seconds (default 540, keep under the 600 s call limit)
#   DG_WORK        scratch dir (default /tmp/dgwork)
#   PYTHON         interpreter that holds torch (default python3)
set -u -o pipefail

T0=$(date +%s)
BUDGET=${DG_BUDGET_S:-540}
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
say() { echo "[build.sh +$(elapsed)s] $*"; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${OUT:?OUT must point to the results folder}"
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
W=${DG_WORK:-/tmp/dgwork}
rm -rf "$W"
mkdir -p "$W/logs"
LOGS=$W/logs
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export HOME=${HOME:-/root}

if [[ -n "${DG_COMMITS:-}" ]]; then
    COMMITS=$DG_COMMITS
else
    COMMITS=$(awk '$1=="deepgemm"{print $2}' "$HERE/MANIFEST.txt" 2>/dev/null)
    [[ -z "$COMMITS" ]] && COMMITS=$(cd "$HERE" && ls -d dg-* | sed 's/^dg-//')
fi
PRIMARY=${DG_PRIMARY:-$(echo $COMMITS | awk '{print $1}')}
EXTRA_VARIANTS=${DG_VARIANTS-}
SHIM=${DG_SHIM:-0}
if [[ ${DG_EXT:-1} == 0 ]]; then
    COMMITS=""
    EXTRA_VARIANTS=""
fi
SHIM_COMMIT=${DG_SHIM_COMMIT:-$PRIMARY}
DIAG=${DG_DIAG:-1}
PERF=${DG_PERF:-1}
UPSTREAM=${DG_UPSTREAM:-0}
say "commits: $COMMITS | primary: $PRIMARY | extra variants: ${EXTRA_VARIANTS:-none} | shim: $SHIM ($SHIM_COMMIT) | budget ${BUDGET}s"

# ------------------------------------------------------------------------------------------------
# 1. Environment report
# ------------------------------------------------------------------------------------------------
{
    set +e
    echo "== date/uname"; date -u; uname -a; head -2 /etc/os-release
    echo "== nvidia-smi"; nvidia-smi
    echo "== tools"; for t in nvcc cuda-gdb compute-sanitizer cuobjdump gdb addr2line gcc g++ ninja cmake; do printf '%-18s %s\n' "$t" "$(command -v $t)"; done
    nvcc --version; gcc --version | head -1; g++ --version | head -1
    echo "== python/torch"
    $PYTHON - <<'EOF'
import sys, torch, torch.utils.cpp_extension as ce
print(sys.version)
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cxx11abi', torch.compiled_with_cxx11_abi(), torch.__file__)
print('device', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0),
      'sms', torch.cuda.get_device_properties(0).multi_processor_count)
print('CUDA_HOME (torch)', ce.CUDA_HOME)
print('torch._C._GLIBCXX_USE_CXX11_ABI', torch._C._GLIBCXX_USE_CXX11_ABI)
try:
    print('torch built with', torch.__config__.show().splitlines()[:12])
except Exception as e:
    print('config', e)
EOF
    $PYTHON -m pip list 2>/dev/null | grep -i -E "^(torch|nvidia|pybind|setuptools|wheel|ninja|packaging|cuda)"
    echo "== limits"; ulimit -a
    echo "== HOME=$HOME CUDA_HOME=$CUDA_HOME"
    ls -la "$CUDA_HOME"/lib64/libnvrtc* "$CUDA_HOME"/lib64/libcudart* 2>&1 | head
    head -3 /proc/meminfo; nproc
} > "$LOGS/env.txt" 2>&1
NUM_SMS=$($PYTHON -c "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)" 2>/dev/null || echo 132)
say "environment recorded (num_sms=$NUM_SMS)"

# Native backtrace helper
gcc -shared -fPIC -O1 -g -o "$W/segv_trace.so" "$HERE/segv_trace.c" -ldl > "$LOGS/segv_trace_build.log" 2>&1 \
    || say "WARNING: could not build segv_trace.so (see logs)"
PRELOAD=""
[[ -f "$W/segv_trace.so" ]] && PRELOAD="$W/segv_trace.so"

# ------------------------------------------------------------------------------------------------
# 2. Builds (parallel)
# ------------------------------------------------------------------------------------------------
prep_tree() {   # $1 commit  $2 variant name -> $W/$2
    local c=$1 v=$2 src=$HERE/dg-$1 dst=$W/$2
    cp -r "$src" "$dst"
    local cut fmt
    cut=$(head -c 7 "$src/.cutlass_pin"); fmt=$(head -c 7 "$src/.fmt_pin")
    mkdir -p "$dst/third-party"
    rm -rf "$dst/third-party/cutlass" "$dst/third-party/fmt"
    ln -s "$HERE/third-party/cutlass-$cut" "$dst/third-party/cutlass"
    ln -s "$HERE/third-party/fmt-$fmt" "$dst/third-party/fmt"
    # develop layout (DeepGEMM's develop.sh): JIT include root = deep_gemm/include
    ln -sfn "$dst/third-party/cutlass/include/cutlass" "$dst/deep_gemm/include/cutlass"
    ln -sfn "$dst/third-party/cutlass/include/cute" "$dst/deep_gemm/include/cute"
}

build_variant() {   # $1 commit  $2 variant kind (default|rtapi|cxx20|noregex)
    local c=$1 kind=$2 v
    v=$c; [[ $kind != default ]] && v=$c-$kind
    local log=$LOGS/build_$v.log
    echo "$v" >> "$W/variants"
    prep_tree "$c" "$v"
    local extra_env=()
    case $kind in
        rtapi) extra_env=(DG_JIT_USE_RUNTIME_API=1) ;;
        cxx20) sed -i "s/'-std=c++17'/'-std=c++20'/" "$W/$v/setup.py" ;;
        noregex) $PYTHON "$HERE/patch_noregex.py" "$W/$v" >> "$log" 2>&1 || { echo "patch failed" >> "$log"; echo 3 > "$W/build_rc_$v"; return; } ;;
    esac
    (
        cd "$W/$v" || exit 1
        local t0=$(date +%s)
        env DG_USE_LOCAL_VERSION=0 CFLAGS="-g1" ${extra_env[@]+"${extra_env[@]}"} \
            timeout -k 10 "${DG_BUILD_TIMEOUT:-330}" $PYTHON setup.py build
        local rc=$?
        echo "build rc=$rc in $(( $(date +%s) - t0 ))s"
        if [[ $rc -eq 0 ]]; then
            so=$(find build -name "_C*.so" -type f | head -n 1)
            if [[ -n "$so" ]]; then ln -sf "$W/$v/$so" deep_gemm/; else echo "no _C*.so found"; rc=4; fi
        fi
        echo $rc > "$W/build_rc_$v"
    ) >> "$log" 2>&1
}

build_shim() {
    local c=$SHIM_COMMIT src=$HERE/dg-$SHIM_COMMIT log=$LOGS/build_shim.log d=$W/shim
    mkdir -p "$d"
    local api
    if [[ -f "$src/deep_gemm/include/deep_gemm/scheduler/sm90_paged_mqa_logits.cuh" ]]; then api=2
    elif grep -q "smxx_paged_mqa_logits_metadata" "$src/deep_gemm/include/deep_gemm/impls/sm90_fp8_paged_mqa_logits.cuh" 2>/dev/null; then api=1
    else echo "shim: commit $c has an unsupported kernel layout" > "$log"; echo 3 > "$W/build_rc_shim"; return; fi
    echo "$c" > "$d/commit"; echo "$api" > "$d/api"
    local cut; cut=$(head -c 7 "$src/.cutlass_pin")
    local flags=(-std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr --expt-extended-lambda
                 --diag-suppress=39,161,174,177,186,940 --ptxas-options=--register-usage-level=10
                 -Xcompiler -fPIC -Xcompiler -fvisibility=hidden
                 -I"$src/deep_gemm/include" -I"$HERE/third-party/cutlass-$cut/include"
                 -DDG_SHIM_API=$api -DSHIM_NUM_SMS=$NUM_SMS -DSHIM_MAX_BATCH=${DG_SHIM_MAX_BATCH:-512})
    local parts=("meta:-DDG_SHIM_PART=0" "n1h64_2d:-DDG_SHIM_PART=1 -DSHIM_NEXT_N=1 -DSHIM_HEADS=64 -DSHIM_2D=1"
                 "n2h64_2d:-DDG_SHIM_PART=1 -DSHIM_NEXT_N=2 -DSHIM_HEADS=64 -DSHIM_2D=1")
    [[ $api == 1 ]] && parts+=("n2h64_1d:-DDG_SHIM_PART=1 -DSHIM_NEXT_N=2 -DSHIM_HEADS=64 -DSHIM_2D=0")
    local t0=$(date +%s) pids=() names=()
    {
        echo "shim: commit $c api $api"
        for p in "${parts[@]}"; do
            local name=${p%%:*} defs=${p#*:}
            # shellcheck disable=SC2086
            ( timeout -k 10 300 nvcc "${flags[@]}" $defs -c "$HERE/shim/dg_paged_shim.cu" -o "$d/$name.o" \
                > "$d/$name.log" 2>&1; echo $? > "$d/$name.rc" ) &
            pids+=($!); names+=("$name")
        done
        wait "${pids[@]}"
        local rc=0
        for n in "${names[@]}"; do echo "--- part $n rc=$(cat "$d/$n.rc")"; cat "$d/$n.log"; [[ $(cat "$d/$n.rc") == 0 ]] || rc=1; done
        if [[ $rc == 0 ]]; then
            nvcc -shared -cudart shared -o "$d/libdgshim.so" "$d"/*.o || rc=1
            nm -D "$d/libdgshim.so" | grep dgshim_
        fi
        echo "shim build rc=$rc in $(( $(date +%s) - t0 ))s"
        echo $rc > "$W/build_rc_shim"
    } > "$log" 2>&1
}

: > "$W/variants"
bpids=()
for c in $COMMITS; do
    [[ -d "$HERE/dg-$c" ]] || { say "missing $HERE/dg-$c"; continue; }
    build_variant "$c" default & bpids+=($!)
done
for k in $EXTRA_VARIANTS; do build_variant "$PRIMARY" "$k" & bpids+=($!); done
[[ $SHIM == 1 ]] && { build_shim & bpids+=($!); }
say "waiting for ${#bpids[@]} parallel builds"
wait
sync
for f in "$W"/build_rc_*; do say "$(basename "$f"): $(cat "$f")"; done

# ------------------------------------------------------------------------------------------------
# 3. Smoke tests (parallel)
# ------------------------------------------------------------------------------------------------
smoke_env() {   # $1 variant -> prints env assignments
    local v=$1
    echo "PYTHONPATH=$W/$v DG_JIT_CACHE_DIR=$W/jit-$v DG_JIT_DEBUG=1 DG_JIT_PRINT_COMPILER_COMMAND=1"
    echo "PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 DG_USE_TEMP_CUBLASLT_WORKSPACE=1"
}

run_smoke() {   # $1 variant  $2 timeout  [extra smoke args...]
    local v=$1 t=$2; shift 2
    local extra=("$@")
    [[ $PERF == 1 && ( $v == "$PRIMARY" || $v == shim ) ]] && extra+=(--perf)
    local backend=(--backend dg)
    [[ $v == shim ]] && backend=(--backend shim --shim "$W/shim/libdgshim.so")
    if [[ $v != shim ]]; then
        # C++-exception probe first (separate process): a DG_HOST_ASSERT must surface as RuntimeError
        echo "$v-probe" >> "$W/variants"
        (
            # shellcheck disable=SC2046
            env $(smoke_env "$v") LD_PRELOAD="$PRELOAD" SEGV_TRACE_FILE="$LOGS/segv_$v-probe.txt" \
                timeout -k 10 120 $PYTHON "$HERE/smoke.py" --backend dg --label "$v-probe" --probe-only \
                --marks "$LOGS/marks_$v-probe.txt" --json "$W/res_$v-probe.json"
            echo $? > "$W/smoke_rc_$v-probe"
        ) > "$LOGS/smoke_$v-probe.log" 2>&1
    fi
    (
        # shellcheck disable=SC2046
        env $(smoke_env "$v") LD_PRELOAD="$PRELOAD" SEGV_TRACE_FILE="$LOGS/segv_$v.txt" \
            timeout -k 10 "$t" $PYTHON "$HERE/smoke.py" "${backend[@]}" --label "$v" \
            --marks "$LOGS/marks_$v.txt" --json "$W/res_$v.json" ${extra[@]+"${extra[@]}"}
        echo $? > "$W/smoke_rc_$v"
    ) > "$LOGS/smoke_$v.log" 2>&1
}

spids=()
SMOKE_T=$(( $(left) - 150 )); (( SMOKE_T > 300 )) && SMOKE_T=300; (( SMOKE_T < 60 )) && SMOKE_T=60
for v in $(cat "$W/variants"); do
    [[ $(cat "$W/build_rc_$v" 2>/dev/null) == 0 ]] || continue
    run_smoke "$v" "$SMOKE_T" & spids+=($!)
done
if [[ $SHIM == 1 ]]; then
    echo shim >> "$W/variants"
    [[ $(cat "$W/build_rc_shim" 2>/dev/null) == 0 ]] && { run_smoke shim "$SMOKE_T" & spids+=($!); }
fi
say "waiting for ${#spids[@]} smoke runs (timeout ${SMOKE_T}s each)"
wait
for f in "$W"/smoke_rc_*; do say "$(basename "$f"): $(cat "$f") | last mark: $(tail -n 1 "$LOGS/marks_${f##*smoke_rc_}.txt" 2>/dev/null)"; done

# ------------------------------------------------------------------------------------------------
# 4. Diagnostics for the first variant that died on a signal
# ------------------------------------------------------------------------------------------------
symbolize() {   # $1 segv trace file -> symbolized lines for our own modules
    local f=$1
    grep -E '^#[0-9]+ ' "$f" | while read -r idx mod off sym; do
        case "$mod" in
            *_C*.so|*deep_gemm*|*libdgshim*|*libtorch*|*libc10*|*libcuda*|*libstdc++*)
                printf '%s %s %s %s => %s\n' "$idx" "$(basename "$mod")" "$off" "$sym" \
                    "$(addr2line -f -C -i -e "$mod" "$off" 2>/dev/null | tr '\n' ' ')" ;;
            *) printf '%s %s %s %s\n' "$idx" "$(basename "$mod")" "$off" "$sym" ;;
        esac
    done
}

CRASHED=""
for v in $(cat "$W/variants"); do
    rc=$(cat "$W/smoke_rc_$v" 2>/dev/null || echo none)
    if [[ $rc =~ ^[0-9]+$ ]] && (( rc > 128 && rc != 137 )); then
        [[ -s "$LOGS/segv_$v.txt" ]] && symbolize "$LOGS/segv_$v.txt" > "$LOGS/segv_${v}_symbolized.txt" 2>&1
        base=${v%-probe}
        [[ $base == shim || $base == *-nvrtc ]] && continue
        [[ -z "$CRASHED" ]] && CRASHED=$base
        [[ $base == "$PRIMARY" ]] && CRASHED=$base
    fi
done

if [[ $DIAG == 1 && -n "$CRASHED" ]]; then
    v=$CRASHED
    say "diagnostics for crashed variant $v ($(left)s left)"
    if (( $(left) > 150 )) && command -v cuda-gdb >/dev/null; then
        say "cuda-gdb batch run"
        (
            # shellcheck disable=SC2046
            export $(smoke_env "$v") CUDA_LAUNCH_BLOCKING=1
            timeout -k 10 $(( $(left) > 260 ? 200 : $(left) - 60 )) cuda-gdb -batch -nx \
                -ex 'set pagination off' -ex 'set confirm off' -ex 'set print thread-events off' \
                -ex 'set cuda break_on_launch none' -ex 'set auto-solib-add off' -ex run \
                -ex 'sharedlibrary _C' -ex 'sharedlibrary libstdc' -ex 'sharedlibrary libc[.]so' \
                -ex 'sharedlibrary libcuda[.]so' -ex 'sharedlibrary libcudart' -ex 'sharedlibrary libc10' \
                -ex bt -ex 'info sharedlibrary' -ex 'thread apply all bt 20' -ex 'x/8i $pc' -ex 'info registers' \
                --args $PYTHON "$HERE/smoke.py" --backend dg --label "$v-gdb" --marks "$LOGS/marks_${v}-gdb.txt" --skip-nojit
        ) > "$LOGS/cudagdb_$v.log" 2>&1
        say "cuda-gdb done rc=$?"
    fi
    if (( $(left) > 120 )); then
        say "NVRTC rerun"
        (
            # shellcheck disable=SC2046
            env $(smoke_env "$v") DG_JIT_CACHE_DIR="$W/jit-$v-nvrtc" DG_JIT_USE_NVRTC=1 CUDA_LAUNCH_BLOCKING=1 \
                LD_PRELOAD="$PRELOAD" SEGV_TRACE_FILE="$LOGS/segv_${v}-nvrtc.txt" \
                timeout -k 10 $(( $(left) > 200 ? 120 : $(left) - 70 )) $PYTHON "$HERE/smoke.py" --backend dg \
                --label "$v-nvrtc" --marks "$LOGS/marks_${v}-nvrtc.txt" --json "$W/res_${v}-nvrtc.json" --skip-nojit --only-2d
            echo $? > "$W/smoke_rc_${v}-nvrtc"
        ) > "$LOGS/smoke_${v}-nvrtc.log" 2>&1
        [[ -s "$LOGS/segv_${v}-nvrtc.txt" ]] && symbolize "$LOGS/segv_${v}-nvrtc.txt" > "$LOGS/segv_${v}-nvrtc_symbolized.txt" 2>&1
        echo "${v}-nvrtc" >> "$W/variants"
    fi
    if (( $(left) > 100 )) && command -v compute-sanitizer >/dev/null; then
        say "compute-sanitizer memcheck"
        (
            # shellcheck disable=SC2046
            export $(smoke_env "$v")
            timeout -k 10 $(( $(left) - 50 )) compute-sanitizer --tool memcheck --show-backtrace host \
                --print-limit 20 --target-processes application-only \
                $PYTHON "$HERE/smoke.py" --backend dg --label "$v-sanitizer" --marks "$LOGS/marks_${v}-sanitizer.txt" --skip-nojit --only-2d
        ) > "$LOGS/sanitizer_$v.log" 2>&1
        say "compute-sanitizer done rc=$?"
    fi
fi

# Optional: upstream test on passing default variants
if [[ $UPSTREAM == 1 ]]; then
    for c in $COMMITS; do
        [[ $(cat "$W/smoke_rc_$c" 2>/dev/null) == 0 ]] || continue
        (( $(left) > 150 )) || break
        say "upstream test_paged_mqa_logits for $c"
        (
            cd "$W/$c/tests" || exit 1
            # shellcheck disable=SC2046
            env $(smoke_env "$c") DG_JIT_DEBUG=0 DG_MQA_NUM_CASES=2 timeout -k 10 $(( $(left) - 90 )) \
                $PYTHON -c "import torch, random; torch.manual_seed(0); random.seed(0); import test_attention as t; t.test_paged_mqa_logits()"
            echo "rc=$?"
        ) > "$LOGS/upstream_$c.log" 2>&1
    done
fi

# ------------------------------------------------------------------------------------------------
# 5. Results
# ------------------------------------------------------------------------------------------------
# JIT sources (small) for the record; cubins are left out
for d in "$W"/jit-*; do
    [[ -d "$d" ]] || continue
    find "$d" -name kernel.cu -size -200k | while read -r f; do
        mkdir -p "$LOGS/jit/$(basename "$d")"; cp "$f" "$LOGS/jit/$(basename "$d")/$(basename "$(dirname "$f")").cu"
    done
done
cp "$HERE/MANIFEST.txt" "$LOGS/" 2>/dev/null

W="$W" LOGS="$LOGS" ELAPSED=$(elapsed) $PYTHON - "$OUT" <<'EOF'
import json, os, sys, glob
W, LOGS, out = os.environ['W'], os.environ['LOGS'], sys.argv[1]
def rd(p, default=None):
    try:
        return open(p).read().strip()
    except OSError:
        return default
variants = [v for v in rd(f'{W}/variants', '').split() if v]
res, lines = {}, []
for v in dict.fromkeys(variants):
    r = dict(build_rc=rd(f'{W}/build_rc_{v}'), smoke_rc=rd(f'{W}/smoke_rc_{v}'))
    marks = rd(f'{LOGS}/marks_{v}.txt', '')
    r['last_mark'] = marks.splitlines()[-1] if marks else None
    try:
        r['smoke'] = json.load(open(f'{W}/res_{v}.json'))
    except Exception:
        r['smoke'] = None
    rc = r['smoke_rc']
    if r['build_rc'] not in (None, '0') and rc is None:
        verdict = f'BUILD FAILED (rc={r["build_rc"]})'
    elif rc is None:
        verdict = 'NOT RUN'
    elif rc == '0':
        verdict = 'PASS'
    elif rc == '1':
        verdict = 'FAIL (numerics)'
    elif rc == '2':
        verdict = 'EXCEPTION'
    elif rc in ('124', '137'):
        verdict = 'TIMEOUT'
    elif rc.isdigit() and int(rc) > 128:
        verdict = f'CRASH signal {int(rc) - 128}'
    else:
        verdict = f'rc={rc}'
    r['verdict'] = verdict
    res[v] = r
    line = f'{v:22s} {verdict:22s} last: {r["last_mark"]}'
    s = r['smoke'] or {}
    for c in s.get('cases', []):
        if 'diff_vs_simulated' in c:
            line += f'\n{"":24s}{c["label"]:12s} ok={c.get("ok")} diff_sim={c["diff_vs_simulated"]:.2e} diff_bf16={c["diff_vs_bf16_ref"]:.2e} clean={c.get("clean_mask_ok")}'
    for p in s.get('perf', []) or []:
        line += f'\n{"":24s}perf B={p["B"]} N={p["N"]}: {p["us"]:.1f} us {p["tflops"]:.0f} TFLOPS {p["gbps"]:.0f} GB/s'
    if s.get('error'):
        line += f'\n{"":24s}error: {s["error"].strip().splitlines()[-1][:300]}'
    sym = rd(f'{LOGS}/segv_{v}_symbolized.txt')
    if sym:
        line += '\n' + '\n'.join(f'{"":24s}{l}' for l in sym.splitlines()[:25])
    lines.append(line)
env = rd(f'{LOGS}/env.txt', '')
json.dump(dict(elapsed_s=int(os.environ['ELAPSED']), variants=res), open(f'{out}/results.json', 'w'), indent=1, default=str)
with open(f'{out}/summary.txt', 'w') as f:
    f.write(f'DeepGEMM paged MQA logits build/smoke summary (elapsed {os.environ["ELAPSED"]}s)\n\n')
    f.write('\n'.join(lines) + '\n\n')
    gdb = sorted(glob.glob(f'{LOGS}/cudagdb_*.log'))
    for g in gdb:
        txt = open(g, errors='replace').read().splitlines()
        bt = [l for l in txt if l.startswith('#') or 'signal' in l.lower()][:40]
        f.write(f'--- {os.path.basename(g)} (frames)\n' + '\n'.join(bt) + '\n')
    for s in sorted(glob.glob(f'{LOGS}/sanitizer_*.log')):
        txt = open(s, errors='replace').read().splitlines()
        f.write(f'--- {os.path.basename(s)} (tail)\n' + '\n'.join(txt[-25:]) + '\n')
    f.write('\n--- env (head)\n' + '\n'.join(env.splitlines()[:60]) + '\n')
print(open(f'{out}/summary.txt').read())
EOF

tar -czf "$OUT/logs.tar.gz" -C "$W" logs 2>/dev/null || say "WARNING: tar failed"
ls -la "$OUT"
say "done"
