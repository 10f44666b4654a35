# Shared by e2e.sh and bench.sh (sourced): Dynamo's frontend and N dsa-kv-dynamo workers
# on loopback, and small checks. Expects $here (the crate) and $venv (the Python
# environment with Dynamo's frontend).

fail() { echo "FAILED: $*" >&2; exit 1; }

# install_frontend VENV: Dynamo's frontend from the registry. `ai-dynamo`'s own
# dependencies include a package only a vendor index serves, so it is installed without
# them, followed by the few its frontend imports.
install_frontend() {
  python3 -m venv "$1"
  "$1/bin/pip" install -q --disable-pip-version-check ai-dynamo-runtime==1.6.1
  "$1/bin/pip" install -q --disable-pip-version-check --no-deps ai-dynamo==1.6.1
  "$1/bin/pip" install -q --disable-pip-version-check aiohttp msgspec prometheus-client pyzmq \
    pyyaml packaging zstandard tqdm certifi
}

# Every process of the cluster: file discovery in one directory, TCP requests, ZMQ
# events, all on 127.0.0.1.
cluster_env() {
  export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV="$1/discovery"
  export DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq
  export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1
  export DYN_EVENT_PLANE_HOST=127.0.0.1
  export DYN_LOG=${DYN_LOG:-info}
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
# A free port below 32768: Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a 16-bit signed integer.
free_low_port() {
  python3 -c '
import random, socket
for _ in range(1000):
    p = random.randint(20000, 32767)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    print(p)
    break'
}

CLUSTER_PIDS=()
# Whatever way the script ends, nothing of the cluster outlives it.
kill_cluster() {
  for p in "${CLUSTER_PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  CLUSTER_PIDS=()
}
trap kill_cluster EXIT
# start_cluster DIR ROUTER_MODE WORKERS [WORKER FLAGS...]: starts the workers (each
# writes DIR/worker-I.json at shutdown, logs to DIR/worker-I.log, serves its metrics on
# 127.0.0.1:CLUSTER_METRICS_PORTS[I]) and the frontend on a free port (CLUSTER_URL), and
# waits until the frontend lists the model with every worker registered.
start_cluster() {
  local dir=$1 mode=$2 n=$3
  shift 3
  mkdir -p "$dir"
  cluster_env "$dir"
  local bin="${CARGO_TARGET_DIR:-$here/target}/release/dsa-kv-dynamo"
  CLUSTER_METRICS_PORTS=()
  for i in $(seq 0 $((n - 1))); do
    # Each worker's system server (/metrics, /health) on a port of its own.
    local mport
    mport=$(free_low_port)
    CLUSTER_METRICS_PORTS+=("$mport")
    DYN_SYSTEM_PORT=$mport \
      "$bin" --model-dir "$dir/model" --report "$dir/worker-$i.json" "$@" \
      >"$dir/worker-$i.log" 2>&1 &
    CLUSTER_PIDS+=($!)
  done
  local port
  port=$(free_port)
  "$venv/bin/python" -m dynamo.frontend --http-host 127.0.0.1 --http-port "$port" \
    --router-mode "$mode" >"$dir/frontend.log" 2>&1 &
  CLUSTER_PIDS+=($!)
  CLUSTER_URL="http://127.0.0.1:$port"
  CLUSTER_DIR=$dir
  local t=0
  until curl -sf "$CLUSTER_URL/v1/models" 2>/dev/null | grep -q dsa-kv-reference; do
    sleep 1
    t=$((t + 1))
    for p in "${CLUSTER_PIDS[@]}"; do
      kill -0 "$p" 2>/dev/null || { tail -n 20 "$dir"/*.log; fail "a process of the cluster exited"; }
    done
    [ $t -lt 180 ] || { tail -n 20 "$dir"/*.log; fail "the frontend did not list the model in 180 s"; }
  done
  # Every worker registered (each writes its instance into the discovery directory).
  t=0
  until [ "$(grep -l 'dsa-kv engine started' "$dir"/worker-*.log 2>/dev/null | wc -l)" -eq "$n" ]; do
    sleep 1
    t=$((t + 1))
    [ $t -lt 120 ] || fail "not every worker started"
  done
  sleep 2
  echo "   cluster up: frontend $CLUSTER_URL ($mode routing), $n workers, logs in $dir"
}

# stop_cluster: SIGINT to the workers (they unregister, drain, and write their reports),
# then the frontend.
stop_cluster() {
  local n=$((${#CLUSTER_PIDS[@]} - 1))
  for p in "${CLUSTER_PIDS[@]:0:$n}"; do kill -INT "$p" 2>/dev/null || true; done
  for p in "${CLUSTER_PIDS[@]:0:$n}"; do
    local t=0
    while kill -0 "$p" 2>/dev/null; do
      sleep 1
      t=$((t + 1))
      [ $t -lt 90 ] || { kill -9 "$p"; fail "a worker did not stop in 90 s"; }
    done
  done
  kill -INT "${CLUSTER_PIDS[$n]}" 2>/dev/null || true
  sleep 1
  kill -9 "${CLUSTER_PIDS[$n]}" 2>/dev/null || true
  CLUSTER_PIDS=()
}

# check_json RESPONSE PYTHON_CONDITION WHAT: the condition holds of the JSON `j`.
check_json() {
  python3 - "$1" "$2" "$3" <<'PY' || fail "$3"
import json, sys
text, cond, what = sys.argv[1:]
try:
    j = json.loads(text)
except ValueError:
    sys.exit(f"{what}: not JSON: {text[:500]}")
if not eval(cond):
    sys.exit(f"{what}: {cond} does not hold of {json.dumps(j)[:800]}")
print(f"   {what}: ok ({json.dumps(j.get('usage'))})")
PY
}

# check_sse RESPONSE TOKENS WHAT: an event stream of chunks ending in [DONE], text in
# them, one finish_reason, and usage with TOKENS completion tokens.
check_sse() {
  python3 - "$1" "$2" "$3" <<'PY' || fail "$3"
import json, sys
text, want, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lines = [l[6:] for l in text.splitlines() if l.startswith("data: ")]
if not lines or lines[-1] != "[DONE]":
    sys.exit(f"{what}: the stream does not end in [DONE]: {text[-300:]}")
chunks = [json.loads(l) for l in lines[:-1]]
pieces, reasons, usage = [], [], None
for c in chunks:
    for ch in c.get("choices", []):
        d = ch.get("delta", {}).get("content") if "delta" in ch else ch.get("text")
        if d:
            pieces.append(d)
        if ch.get("finish_reason"):
            reasons.append(ch["finish_reason"])
    if c.get("usage"):
        usage = c["usage"]
if len(reasons) != 1:
    sys.exit(f"{what}: finish reasons {reasons}")
if not usage or usage["completion_tokens"] != want:
    sys.exit(f"{what}: usage {usage}, want {want} completion tokens")
text = "".join(pieces)
if not text:
    sys.exit(f"{what}: no text")
print(f"   {what}: ok ({len(chunks)} chunks, {len(text)} characters, finish {reasons[0]}, usage {usage})")
PY
}
