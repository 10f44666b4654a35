#!/usr/bin/env bash
# dsa-kv behind NVIDIA Dynamo, end to end on loopback: Dynamo's OpenAI frontend
# (`python -m dynamo.frontend`, KV router) in front of two `dsa-kv-dynamo` workers, no etcd
# or NATS (file discovery, TCP requests, ZMQ events). Checks with curl:
#   1. chat and completions, streaming and not, each ending the way OpenAI clients expect;
#   2. a repeated prompt reaches the worker that holds it (`cached_tokens` > 0) while
#      distinct prompts spread over both workers;
#   3. a client that disconnects mid-stream has its request cancelled on the worker, its
#      pages freed (the worker's report: cancelled >= 1, no cancellation left more slots
#      in use);
#   4. at shutdown every request's tokens were bit-exact against the unpaged model.
# Then, with --bench, aiperf at several concurrencies with KV routing and with round-robin
# (bench.sh). `--model deepseek-v4-flash` runs the same checks with the workers serving the
# DeepSeek-V4 reference model (Flash's layer structure, 256-token blocks; a repeated
# prompt resumes at its last whole block, where a window tail is kept). Usage, from
# anywhere:
#   integrations/dynamo/e2e.sh [--bench] [--out DIR] [--model dsa|deepseek-v4-flash]
# Needs the Python environment of the README (DYNAMO_VENV, default target/dynamo-venv
# next to this script; created on first use) and builds the worker in release mode.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/target/e2e"
bench=0
model=dsa
while [ $# -gt 0 ]; do
  case $1 in
    --bench) bench=1 ;;
    --out) out=$2; shift ;;
    --model) model=$2; shift ;;
    *) echo "usage: $0 [--bench] [--out DIR] [--model dsa|deepseek-v4-flash]" >&2; exit 2 ;;
  esac
  shift
done
# What the checks expect of the model: the cached part of the repeated 720-token prompt
# (whole blocks), and the GPU blocks of the default 65,536-token cache.
case $model in
  dsa) min_cached=704; blocks=1048 ;;
  deepseek-v4-flash) min_cached=512; blocks=256 ;;
  *) echo "--model $model: expected dsa or deepseek-v4-flash" >&2; exit 2 ;;
esac
venv=${DYNAMO_VENV:-$here/target/dynamo-venv}
source "$here/scripts/cluster.sh"

if [ ! -x "$venv/bin/python" ]; then
  echo "== installing Dynamo's frontend into $venv"
  install_frontend "$venv"
fi
echo "== building dsa-kv-dynamo (release)"
(cd "$here" && cargo build --release --locked --bin dsa-kv-dynamo)

rm -rf "$out" && mkdir -p "$out"
start_cluster "$out/kv" kv 2 --model "$model"
base=$CLUSTER_URL

echo "== 1. chat and completions, streaming and not"
chat() { # chat BODY -> the response
  curl -sS --max-time 60 "$base/v1/chat/completions" -H 'content-type: application/json' -d "$1"
}
comp() {
  curl -sS --max-time 60 "$base/v1/completions" -H 'content-type: application/json' -d "$1"
}
r=$(chat '{"model":"dsa-kv-reference","messages":[{"role":"user","content":"Hello there, how are you?"}],"max_tokens":16}')
check_json "$r" 'j["object"] == "chat.completion" and len(j["choices"][0]["message"]["content"]) > 0 and j["usage"]["completion_tokens"] == 16 and j["choices"][0]["finish_reason"] == "length"' "chat"
r=$(chat '{"model":"dsa-kv-reference","messages":[{"role":"user","content":"Tell me a story."}],"max_tokens":12,"stream":true,"stream_options":{"include_usage":true}}')
check_sse "$r" 12 "chat, streaming"
r=$(comp '{"model":"dsa-kv-reference","prompt":"The quick brown fox","max_tokens":10}')
check_json "$r" 'j["object"] == "text_completion" and len(j["choices"][0]["text"]) > 0 and j["usage"]["completion_tokens"] == 10' "completions"
r=$(comp '{"model":"dsa-kv-reference","prompt":"Once upon a time","max_tokens":9,"stream":true,"stream_options":{"include_usage":true}}')
check_sse "$r" 9 "completions, streaming"
# A prompt beyond the context length: a client error that says so, not a hang.
big=$(python3 -c 'import json; print(json.dumps({"model":"dsa-kv-reference","prompt":"x"*5000,"max_tokens":4}))')
code=$(curl -sS -o "$out/bad.json" -w '%{http_code}' --max-time 60 "$base/v1/completions" \
  -H 'content-type: application/json' -d "$big")
echo "   a 5000-token prompt (context 4096): HTTP $code $(head -c 300 "$out/bad.json")"
[ "$code" -ge 400 ] && [ "$code" -lt 500 ] || fail "a prompt beyond the context length got HTTP $code"
grep -q "context length" "$out/bad.json" || fail "the error does not name the context length"

echo "== 2. a repeated prompt goes to its holder; distinct prompts spread"
long=$(python3 -c 'import random; r=random.Random(5); print(" ".join("".join(r.choice("abcdefghij") for _ in range(5)) for _ in range(120)))')
body=$(python3 -c 'import json,sys; print(json.dumps({"model":"dsa-kv-reference","prompt":sys.argv[1],"max_tokens":4}))' "$long")
comp "$body" >/dev/null
sleep 1 # the KV events reach the router
# Three more times: the KV router sends each to the worker holding it (round-robin
# would send one of them to the other worker, which holds nothing of it).
for k in 1 2 3; do
  r=$(comp "$body")
  check_json "$r" "j['usage']['prompt_tokens_details']['cached_tokens'] >= $min_cached" "repeated prompt ($k), served from the cache"
done
for i in $(seq 1 12); do
  comp "{\"model\":\"dsa-kv-reference\",\"prompt\":\"distinct prompt number $i: $(printf 'z%.0s' $(seq 1 $((i * 7))))\",\"max_tokens\":4}" >/dev/null
done

echo "== 3. the load each worker publishes (Dynamo's gauges, from the runtime's stats)"
for i in 0 1; do
  m=$(curl -sS --max-time 10 "http://127.0.0.1:${CLUSTER_METRICS_PORTS[$i]}/metrics")
  total=$(grep -E '^dynamo_component_total_blocks\{' <<<"$m" | awk '{print $NF}' | head -1 || true)
  echo "   worker $i: total_blocks ${total:-missing}, $(grep -E '^dynamo_component_gpu_cache_usage_percent\{' <<<"$m" | head -1)"
  [ "${total:-0}" = "$blocks" ] || fail "worker $i does not publish its $blocks blocks (the runtime's GPU slots)"
done

echo "== 4. a client that disconnects cancels its request; while it runs, its worker's load shows it"
# The client reads 40 streamed chunks of a request for 4000 tokens, then closes its
# connection (python3's http.client: no timing guess).
python3 - "$base" >"$out/disconnect.log" 2>&1 <<'PY' &
import http.client, json, sys, time
host, port = sys.argv[1].removeprefix("http://").split(":")
c = http.client.HTTPConnection(host, int(port), timeout=60)
c.request("POST", "/v1/completions", json.dumps({"model": "dsa-kv-reference",
          "prompt": "A very long answer, please", "max_tokens": 4000, "stream": True}),
          {"content-type": "application/json"})
r = c.getresponse()
n = 0
while n < 40:
    line = r.readline()
    if not line:
        sys.exit("the stream ended before 40 chunks")
    n += line.startswith(b"data: ")
print("read", n, "chunks; holding the connection for 2 s, then closing it", flush=True)
time.sleep(2)
r.close()
c.close()
PY
client=$!
sleep 1.5
busy=0
for i in 0 1; do
  u=$(curl -sS --max-time 10 "http://127.0.0.1:${CLUSTER_METRICS_PORTS[$i]}/metrics" \
    | grep -E '^dynamo_component_gpu_cache_usage_percent\{' | awk '{print $NF}' | head -1 || true)
  echo "   worker $i: gpu_cache_usage_percent ${u:-missing}"
  python3 -c "import sys; sys.exit(0 if float('${u:-0}') > 0 else 1)" && busy=$((busy + 1))
done
[ "$busy" -ge 1 ] || fail "no worker's published load shows the running request"
wait "$client" || { cat "$out/disconnect.log"; fail "the disconnecting client failed"; }
sleep 2

stop_cluster
echo "== 5. the workers' reports"
python3 - "$out/kv" <<'EOF'
import json, sys, glob
reports = [json.load(open(p)) for p in sorted(glob.glob(sys.argv[1] + "/worker-*.json"))]
assert len(reports) == 2, f"{len(reports)} reports"
for i, r in enumerate(reports):
    c, v = r["counts"], r["verification"]
    print(f"   worker {i}: admitted {c['admitted']}, length {c['length']}, cancelled {c['cancelled']}, "
          f"tokens {c['tokens_out']}, verified {v['verified']} exact {v['exact']}, slots released by "
          f"cancellations {c['slots_released']}, leaks {c['cancel_leaks']}, prefix hit rate {r['prefix_hit_rate']:.3f}")
    assert r["exact"], f"worker {i} not exact: {v}"
    assert c["cancel_leaks"] == 0, c
    assert c["admitted"] > 0, f"worker {i} got no request: the router did not spread"
assert sum(r["counts"]["cancelled"] for r in reports) >= 1, "no request was cancelled"
assert sum(r["kv_events"]["events"] for r in reports) > 0, "no KV event was published"
assert all(r["kv_events"]["send_errors"] == 0 and r["kv_events"]["lost_batches"] == 0 for r in reports)
assert sum(r["counts"]["slots_released"] for r in reports) > 0, "the cancellation freed nothing"
print("   OK")
EOF
echo "== e2e passed (logs and reports in $out)"

if [ "$bench" = 1 ]; then
  "$here/bench.sh" --out "$out/bench"
fi
