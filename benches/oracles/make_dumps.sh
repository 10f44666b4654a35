#!/usr/bin/env bash
# The inputs of benches/oracles/run.sh, built here (no GPU): dumps of the reference model's
# pools through the runtime (examples/dump.rs) at several steps and layers — chunked
# prefill, decode, MTP verification with next_n 2-4, both MLA encodings — and block tables
# as the allocator places them after churn (examples/page_tables.rs), into one folder that
# travels to the GPU machine.
#   usage: benches/oracles/make_dumps.sh [DIR]   (default .gpu/oracles; .gpu/ is git-ignored)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.gpu/oracles}
rm -rf "$DIR"; mkdir -p "$DIR/dumps"
cargo build --release --example dump --example page_tables
dump() {  # name, then dump's flags
  local name=$1; shift
  target/release/examples/dump --out "$DIR/dumps/$name" "$@" > /dev/null
  echo "$name: $(python3 -c "import json,sys; m=json.load(open('$DIR/dumps/$name/manifest.json')); print(m['step'], m['layer'], m['tokens'], m['tokens_per_row'])")"
}
dump prefill_s3_l1 --step 3 --layer 1
dump prefill_s2_l0 --step 2 --layer 0
dump decode_s6_l1 --step 6 --layer 1
dump decode_s9_l0 --step 9 --layer 0
dump mtp1_s6_l1 --step 6 --layer 1 --drafts 1
dump mtp2_s6_l1 --step 6 --layer 1 --drafts 2
dump mtp3_s6_l0 --step 6 --layer 0 --drafts 3
dump bf16_prefill_s1_l1 --step 1 --layer 1 --kv-dtype bf16
dump bf16_decode_s6_l1 --step 6 --layer 1 --kv-dtype bf16
target/release/examples/page_tables --requests 64 --context 32768 > "$DIR/tables_64x32k.json"
tar czf "$DIR/dumps.tgz" -C "$DIR" dumps && rm -rf "$DIR/dumps"
du -sh "$DIR"
