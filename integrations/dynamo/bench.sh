#!/usr/bin/env bash
# Load through Dynamo's frontend onto two dsa-kv-dynamo workers with aiperf (NVIDIA's load
# generator, from the registry): requests/s, time to first token and inter-token latency
# percentiles, and the prefix hit rate, with KV routing and with round-robin, at several
# concurrencies. Each (routing, concurrency) run gets a fresh cluster (empty caches);
# every request's tokens are checked against the unpaged model by the workers.
#   integrations/dynamo/bench.sh [--out DIR] [--concurrency "1 4 16"] [--requests N]
# The workload: prompts of 512 tokens whose first 384 are one of 24 shared prefixes
# (aiperf's prefix prompts), 32 output tokens each (end-of-sequence ignored), streaming
# chat completions.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/target/bench"
concurrency="1 4 16"
requests=96
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift ;;
    --concurrency) concurrency=$2; shift ;;
    --requests) requests=$2; shift ;;
    *) echo "usage: $0 [--out DIR] [--concurrency LIST] [--requests N]" >&2; exit 2 ;;
  esac
  shift
done
venv=${DYNAMO_VENV:-$here/target/dynamo-venv}
aiperf_venv=${AIPERF_VENV:-$here/target/aiperf-venv}
source "$here/scripts/cluster.sh"
if [ ! -x "$venv/bin/python" ]; then install_frontend "$venv"; fi
if [ ! -x "$aiperf_venv/bin/aiperf" ]; then
  python3 -m venv "$aiperf_venv"
  "$aiperf_venv/bin/pip" install -q --disable-pip-version-check aiperf==0.13.0
fi
(cd "$here" && cargo build --release --locked --bin dsa-kv-dynamo)
rm -rf "$out" && mkdir -p "$out"

for mode in kv round-robin; do
  for c in $concurrency; do
    run="$out/$mode-c$c"
    start_cluster "$run" "$mode" 2
    echo "== aiperf: $mode routing, concurrency $c, $requests requests"
    "$aiperf_venv/bin/aiperf" profile --model dsa-kv-reference --url "$CLUSTER_URL" \
      --endpoint-type chat --streaming --tokenizer "$run/model" \
      --concurrency "$c" --request-count "$requests"  \
      --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
      --prefix-prompt-length 384 --num-prefix-prompts 24 \
      --output-tokens-mean 32 --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
      --random-seed 7 --artifact-dir "$run/aiperf" --ui-type none \
      >"$run/aiperf.log" 2>&1 || { tail -30 "$run/aiperf.log"; fail "aiperf failed"; }
    stop_cluster
  done
done

python3 - "$out" $concurrency <<'EOF'
import glob, json, os, sys
out, levels = sys.argv[1], sys.argv[2:]
rows = []
def metric(m, name, stat):
    v = m.get(name, {})
    return v.get(stat) if isinstance(v, dict) else None
for mode in ["kv", "round-robin"]:
    for c in levels:
        run = f"{out}/{mode}-c{c}"
        exports = glob.glob(f"{run}/aiperf/**/profile_export_aiperf.json", recursive=True)
        m = json.load(open(exports[0]))
        m = m.get("records", m)
        workers = [json.load(open(p)) for p in sorted(glob.glob(f"{run}/worker-*.json"))]
        prompt = sum(w["counts"]["prompt_tokens"] for w in workers)
        cached = sum(w["counts"]["cached_tokens"] for w in workers)
        rows.append({
            "routing": mode, "concurrency": int(c),
            "requests": metric(m, "request_count", "avg"),
            "errors": metric(m, "error_request_count", "avg") or 0,
            "requests_per_s": metric(m, "request_throughput", "avg"),
            "output_tokens_per_s": metric(m, "output_token_throughput", "avg"),
            "ttft_ms": {s: metric(m, "time_to_first_token", s) for s in ["p50", "p90", "p99"]},
            "itl_ms": {s: metric(m, "inter_token_latency", s) for s in ["p50", "p90", "p99"]},
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "requests_per_worker": [w["counts"]["admitted"] for w in workers],
            # The runtime's time per step, over both workers: the coordinator (schedule,
            # commit) and the devices (the reference model's host forward, cache copies).
            "manager_us_per_step": sum(w["manager_us"] for w in workers) / max(1, sum(w["counts"]["steps"] for w in workers)),
            "device_us_per_step": sum(w["device_us"] for w in workers) / max(1, sum(w["counts"]["steps"] for w in workers)),
            "exact": all(w["exact"] for w in workers),
            "verified": sum(w["verification"]["verified"] for w in workers),
        })
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
f = lambda x: "-" if x is None else f"{x:.1f}"
lines = ["| routing | conc. | req/s | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | prefix hit | per worker | µs/step: coordinator, model | exact (verified) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    lines.append(f"| {r['routing']} | {r['concurrency']} | {f(r['requests_per_s'])} | {f(r['output_tokens_per_s'])} | "
                 f"{' / '.join(f(r['ttft_ms'][s]) for s in ['p50','p90','p99'])} | "
                 f"{' / '.join(f(r['itl_ms'][s]) for s in ['p50','p90','p99'])} | {r['prefix_hit_rate']:.3f} | "
                 f"{'/'.join(map(str, r['requests_per_worker']))} | {r['manager_us_per_step']:.0f}, {r['device_us_per_step']:.0f} | "
                 f"{r['exact']} ({r['verified']}) |")
open(f"{out}/summary.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
bad = [r for r in rows if not r["exact"] or r["errors"]]
if bad:
    sys.exit(f"FAILED: runs with errors or inexact tokens: {bad}")
EOF
