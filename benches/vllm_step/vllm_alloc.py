#!/usr/bin/env python3
"""vLLM's per-step KV-cache allocation loop for the 256-request MTP decode step.

The vLLM side of `benches/vllm_step/run.py`: the same 256 requests as our
`benches/common/step256.rs` (request i has a prompt of 1000 + (7 i mod 2000) tokens
with ids t + 3000 i, 3 MTP drafts, 1 draft accepted + 1 sampled token per step), run
through vLLM's own `KVCacheManager` imported from an installed vLLM (nothing of vLLM is
copied here). Prints one JSON line: per-step times (ns) of every round, medians, means,
and the median of each part of the step.

How the manager is built (what vLLM's engine core and scheduler would build for
DeepSeek-V3.2 with `--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'`
and default prefix caching, read from vLLM 0.33's `VllmConfig`, `EngineCore` and
`Scheduler`):

* one `KVCacheConfig` group of full attention: `MLAAttentionSpec` (1 KV head, the
  576-wide latent, bf16; the manager only reads the block size), block size 64, every
  target layer and the MTP layer in it; 187,500 blocks (12,000,000 tokens, the size of
  our runtime's cache in the same step);
* `KVCacheManager(enable_caching=True, ...)`, scheduler and hash block size 64,
  `max_model_len` 163,840 (DeepSeek-V3.2); for MTP vLLM passes `use_eagle=False` and
  `num_hash_lookahead_tokens=1` (lookahead block hashes replace the EAGLE last-block
  drop for a single MTP module), `num_prefill_lookahead=1`;
* requests carry vLLM's block hasher for the default `sha256` hash (pickle + SHA-256),
  chained per 64-token block, the hash covering one token after its block;
* `vllm.utils.gc_utils.freeze_gc_heap()` after the manager is built, as `EngineCore`
  does after building its scheduler (the requests arrive later and stay in the young
  generations).

Setup (untimed): the 256 requests are created and prefilled the way the scheduler
admits a waiting request (`get_computed_blocks`, then `allocate_slots` for the whole
prompt with the lookahead), the prefill's sampled token is appended, its blocks cached,
and 3 drafts set, so that every request decodes.

One timed step, for the 256 running requests, is exactly these vLLM calls, in the order
`Scheduler.schedule()` and `Scheduler.update_from_output()` make them for a decoding
request with speculative tokens (everything else those two functions do -- budgets,
encoder inputs, structured output, stop checks, building the `SchedulerOutput`, stats --
is not part of it):

1. allocate: `kv_cache_manager.new_step_starts()`; per request the scheduler's
   `num_new_tokens = num_tokens_with_spec + num_output_placeholders -
   num_computed_tokens` (= 1 sampled + 3 drafts = 4), then
   `kv_cache_manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=3)`
   (vLLM's `num_lookahead_tokens` is `num_speculative_tokens` for MTP), and the
   scheduler's reset of `request.spec_token_ids`;
2. block_ids: per request `new_blocks.get_block_ids(allow_none=True)` (what
   `_make_cached_request_data` sends the workers: the step's new block ids; the
   workers append them to their block tables), then the per-step drains of the
   manager (`take_new_block_ids`, `take_kv_cache_block_copies`,
   `take_boundary_state_offloads`);
3. update: `_update_after_schedule`'s counters (`num_computed_tokens += 4`,
   `num_in_flight_tokens += 4`, `is_prefill_chunk`), then per request what
   `update_from_output` does with 2 generated tokens (1 accepted draft + the bonus
   token): `num_in_flight_tokens -= 4`, `num_computed_tokens -= 2` (the rejected
   drafts), `request.append_output_token_ids(token)` once per token (which hashes any
   newly full block), `kv_cache_manager.cache_blocks(request, num_computed_tokens -
   num_in_flight_tokens)`, and the next step's 3 drafts (`update_draft_token_ids`).

Sequences grow by 2 tokens per step; the state is rebuilt (untimed) every 100 steps,
as our bench does, so every timed step sees 1,000-3,200-token sequences.

    /work/vllm-venv/bin/python benches/vllm_step/vllm_alloc.py --steps 100 --rounds 1

With --serve it stays up, prints {"ready": true} once vLLM is imported, and answers each
line of stdin with one JSON line: `build` builds a fresh state (untimed), `steps N`
times N more steps on it. run.py alternates small chunks of steps with our side this
way, without paying vLLM's import (~15 s) more than once.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

SEQS = 256
DRAFTS = 3
ACCEPTED = 1  # drafts accepted per step; plus 1 sampled (bonus) token
BLOCK = 64
REBUILD = 100
NUM_BLOCKS = 12_000_000 // BLOCK
MAX_MODEL_LEN = 163_840  # DeepSeek-V3.2
MAX_NUM_BATCHED_TOKENS = 8192
DRAFT_TOKENS = [1, 2, 3]
GENERATED = [1, 9]  # the accepted draft (token 1) and the sampled token 9


def prompt(i: int) -> list[int]:
    return [t + i * 3000 for t in range(1000 + (i * 7) % 2000)]


class Vllm:
    """The vLLM pieces, imported once."""

    def __init__(self) -> None:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.gc_utils import freeze_gc_heap
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            KVCacheConfig,
            KVCacheGroupSpec,
            MLAAttentionSpec,
        )
        from vllm.v1.request import Request, RequestStatus

        self.version = vllm.__version__
        self.torch_version = torch.__version__
        self.SamplingParams = SamplingParams
        self.freeze_gc_heap = freeze_gc_heap
        self.KVCacheManager = KVCacheManager
        self.Request = Request
        self.RUNNING = RequestStatus.RUNNING
        hash_fn = get_hash_fn_by_name("sha256")  # CacheConfig's default
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn, 1)
        spec = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
        )
        # 61 target layers + the MTP layer, one group.
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(62)]
        self.config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )

    def manager(self):
        return self.KVCacheManager(
            kv_cache_config=self.config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            max_in_flight_tokens=MAX_NUM_BATCHED_TOKENS,
            enable_caching=True,
            use_eagle=False,
            num_hash_lookahead_tokens=1,
            num_prefill_lookahead=1,
            log_stats=False,
            enable_kv_cache_events=False,
        )


def build(v: Vllm):
    """A fresh manager and 256 prefilled, decoding requests (untimed)."""
    gc.unfreeze()
    gc.collect()
    mgr = v.manager()
    v.freeze_gc_heap()
    reqs = []
    for i in range(SEQS):
        r = v.Request(
            request_id=str(i),
            prompt_token_ids=prompt(i),
            sampling_params=v.SamplingParams(max_tokens=900_000),
            pooling_params=None,
            block_hasher=v.hasher,
        )
        # Admission of a waiting request: prefix-cache lookup, then the whole prompt.
        hit_blocks, hit, _ = mgr.get_computed_blocks(r)
        new = r.num_tokens - hit
        blocks = mgr.allocate_slots(
            r, new, hit, hit_blocks, num_lookahead_tokens=DRAFTS
        )
        assert blocks is not None, "pool too small"
        r.status = v.RUNNING
        r.num_computed_tokens = hit + new
        # The prefill's output: one sampled token, blocks cached, drafts proposed.
        r.append_output_token_ids(9)
        mgr.cache_blocks(r, r.num_computed_tokens)
        r.spec_token_ids = list(DRAFT_TOKENS)
        reqs.append(r)
    return mgr, reqs


def step(mgr, reqs, clock=time.perf_counter_ns):
    """One decode step of the 256 requests; returns (allocate, block_ids, update) ns."""
    t0 = clock()
    # 1. Scheduler.schedule(): the running-request loop.
    mgr.new_step_starts()
    scheduled = []
    for r in reqs:
        n = r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
        blocks = mgr.allocate_slots(r, n, num_lookahead_tokens=DRAFTS)
        if blocks is None:
            raise RuntimeError("allocate_slots refused: pool too small")
        scheduled.append((r, n, blocks))
        r.spec_token_ids = []
    t1 = clock()
    # 2. The step's new block ids (CachedRequestData.new_block_ids), the drains.
    new_block_ids = [blocks.get_block_ids(allow_none=True) for _, _, blocks in scheduled]
    mgr.take_new_block_ids()
    mgr.take_kv_cache_block_copies()
    mgr.take_boundary_state_offloads()
    t2 = clock()
    # 3. Scheduler._update_after_schedule(), then update_from_output().
    for r, n, _ in scheduled:
        r.num_computed_tokens += n
        r.num_in_flight_tokens += n
        r.is_prefill_chunk = r.num_computed_tokens < (
            r.num_tokens + r.num_output_placeholders
        )
    for r, n, _ in scheduled:
        r.num_in_flight_tokens -= n
        r.num_computed_tokens -= DRAFTS - ACCEPTED
        for token in GENERATED:
            r.append_output_token_ids(token)
        mgr.cache_blocks(r, r.num_computed_tokens - r.num_in_flight_tokens)
        r.spec_token_ids = list(DRAFT_TOKENS)
    t3 = clock()
    assert len(new_block_ids) == SEQS
    return t1 - t0, t2 - t1, t3 - t2


def run_round(v: Vllm, steps: int) -> dict:
    walls, parts = [], {"allocate": [], "block_ids": [], "update": []}
    mgr, reqs = build(v)
    for i in range(steps):
        if i > 0 and i % REBUILD == 0:
            del mgr, reqs
            mgr, reqs = build(v)
        a, b, u = step(mgr, reqs)
        walls.append(a + b + u)
        parts["allocate"].append(a)
        parts["block_ids"].append(b)
        parts["update"].append(u)
    # Every request decoded: 1 sampled token at prefill + 2 per step since the rebuild.
    last = (steps - 1) % REBUILD + 1
    assert all(r.num_tokens == len(prompt(int(r.request_id))) + 1 + 2 * last for r in reqs)
    assert all(r.num_computed_tokens == r.num_tokens - 1 for r in reqs)
    return {
        "median_us": statistics.median_low(walls) / 1e3,
        "mean_us": statistics.fmean(walls) / 1e3,
        "step_ns": walls,
        "part_medians_us": {k: statistics.median_low(p) / 1e3 for k, p in parts.items()},
    }


def report(v: Vllm, steps: int, rounds: int) -> dict:
    """`rounds` rounds of `steps` steps, as one JSON object."""
    done = [run_round(v, steps) for _ in range(rounds)]
    every = [w for r in done for w in r["step_ns"]]
    return {
        "side": "vllm",
        "what": "KVCacheManager per-step allocation loop (see the script's docstring)",
        "vllm": v.version,
        "torch": v.torch_version,
        "python": sys.version.split()[0],
        "requests": SEQS,
        "drafts": DRAFTS,
        "num_lookahead_tokens": DRAFTS,
        "steps": steps,
        "gc_enabled": gc.isenabled(),
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
        "rounds": done,
        "median_us": statistics.median_low(every) / 1e3,
        "mean_us": statistics.fmean(every) / 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=1, help="rounds, each from a fresh state")
    ap.add_argument(
        "--serve",
        action="store_true",
        help="stay up and answer `build` / `steps N` lines on stdin (see above)",
    )
    args = ap.parse_args()
    v = Vllm()
    if not args.serve:
        print(json.dumps(report(v, args.steps, args.rounds)))
        return
    print(json.dumps({"ready": True}), flush=True)
    mgr = reqs = None
    for line in sys.stdin:
        match line.split():
            case ["build"]:
                del mgr, reqs
                mgr, reqs = build(v)
                out = {"built": True}
            case ["steps", n]:
                assert reqs is not None, "`build` before `steps`"
                parts = [step(mgr, reqs) for _ in range(int(n))]
                out = {
                    "step_ns": [sum(p) for p in parts],
                    "part_ns": {
                        k: [p[i] for p in parts]
                        for i, k in enumerate(("allocate", "block_ids", "update"))
                    },
                }
            case _:
                sys.exit(f"unknown request {line!r}: `build` or `steps N`")
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
