#!/usr/bin/env python3
"""FlashMLA's legacy SM90 MODEL1 sparse decode (DeepSeek-V4) on our V4 pools.

Inputs: the folder `examples/v4_dump.rs` writes (the window pool, the ratio-4 and
ratio-128 compressed pools, laid out as `V4Plan` says: per page the rows' 576 data bytes,
then their 8 scale bytes, the page padded to a multiple of 576; and per layer the batch's
`indices` / `topk_length` into the window pool and `extra_indices` / `extra_topk_length`
into the compressed pool, as `metadata::v4` computes them).

For each layer (ratio 4: window + 150 selected compressed entries; ratio 128: window +
every visible entry), with a seeded bf16 query (64 heads, 512 wide) and an attention sink:
* this script decodes every row it reads from the pool's own bytes (e4m3 x 2^(scale - 127)
  per 64 NoPE values, then 64 bf16 RoPE values), checked first against the rows our Rust
  codec decoded (`expect_*_rows`, exact);
* the float64 formula: s = scale q.k over the union of both index sets, out =
  softmax(s) . V (V = K, 512 wide) x exp(lse) / (exp(lse) + exp(sink));
* FlashMLA's output must meet its own decode-test criteria against that formula in the
  kernel's precision (probabilities rounded to bf16 before P.V): every element within
  1e-3 absolute or 2.01/128 relative, cosine difference under 5e-6;
* mutations that must fail the same criteria: two used window pages swapped in the pool;
  the extra indices shifted by one page.

Writes one JSON object to --out; exit 0 even when a check fails (the JSON says which).
"""
import argparse
import json
import os
import sys
import traceback

import numpy as np
import torch

ABS, REL, COS = 1e-3, 2.01 / 128, 5e-6


def cos_diff(x, y):
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum().item()
    return 0.0 if den == 0 else 1.0 - 2.0 * (x * y).sum().item() / den


def close(ans, ref):
    ans, ref = ans.double(), ref.double()
    err = (ans - ref).abs()
    rel = err / (ref.abs() + 1e-6)
    inside = (err < ABS) | (rel < REL)
    cd = cos_diff(ans, ref)
    return {
        "pass": bool(inside.all().item()) and abs(cd) < COS,
        "cos_diff": cd,
        "max_abs_err": err.max().item(),
        "elements_outside": int((~inside).sum().item()),
    }


def decode_rows(pool, entries, page_bytes, idx):
    """Rows `idx` (kernel rows: page x entries + i) of a MODEL1 pool, float64 [n, 512]."""
    idx = np.asarray(idx, dtype=np.int64)
    page, i = idx // entries, idx % entries
    base = page * page_bytes
    data_off = base + i * 576
    scale_off = base + entries * 576 + i * 8
    data = np.stack([pool[o:o + 576] for o in data_off])
    scales = np.stack([pool[o:o + 8] for o in scale_off])
    nope = torch.from_numpy(data[:, :448].copy()).view(torch.float8_e4m3fn).double()
    exp = torch.from_numpy(scales[:, :7].astype(np.float64) - 127.0)
    nope = nope * torch.pow(2.0, exp).repeat_interleave(64, dim=1)
    rope = torch.from_numpy(data[:, 448:576].copy()).view(torch.bfloat16).double()
    return torch.cat([nope, rope], dim=1)


def reference(q, rows, scale, sink, bf16_p):
    """q [h, 512], rows [n, 512] -> out [h, 512] (float64)."""
    s = (q.double() @ rows.T) * scale
    lse = torch.logsumexp(s, dim=1, keepdim=True)
    p = torch.exp(s - lse)
    if bf16_p:
        p = p.bfloat16().double()
    out = p @ rows
    return out / (1.0 + torch.exp(sink.double()[:, None] - lse))


def pool_view(buf, geo, dev):
    t = torch.from_numpy(buf).to(dev)
    e, pb, n = geo["entries"], geo["page_bytes"], geo["pages"]
    return t.as_strided((n, e, 1, 584), (pb, 584, 584, 1))


def run_layer(meta, pools, layer, dev, mutate=None):
    import flash_mla

    qs = [r[layer] for r in meta["queries"]]
    b, h = len(qs), 64
    g = torch.Generator().manual_seed(7 + layer)
    q = torch.randn(b, 1, h, 512, generator=g).bfloat16()
    sink = torch.randn(h, generator=g).float()
    scale = 512 ** -0.5
    extra_name = "c4" if qs[0]["ratio"] == 4 else "c128"
    window = pools["window"].copy()
    extra_idx = np.array([x["extra_indices"] for x in qs], dtype=np.int32)
    note = None
    if mutate == "swap_window_pages":
        used = sorted({i // 64 for x in qs for i in x["indices"][: x["topk_length"]]})
        a, c = used[0], used[-1]
        pb = meta["window"]["page_bytes"]
        pa, pc = window[a * pb:(a + 1) * pb].copy(), window[c * pb:(c + 1) * pb].copy()
        window[a * pb:(a + 1) * pb], window[c * pb:(c + 1) * pb] = pc, pa
        note = [int(a), int(c)]
    elif mutate == "shift_extra_indices":
        e = meta[extra_name]["entries"]
        limit = meta[extra_name]["pages"] * e
        extra_idx = np.where(extra_idx >= 0, (extra_idx + e) % limit, extra_idx)
    idx = torch.tensor([x["indices"] for x in qs], dtype=torch.int32, device=dev).view(b, 1, -1)
    tl = torch.tensor([x["topk_length"] for x in qs], dtype=torch.int32, device=dev)
    xl = torch.tensor([x["extra_topk_length"] for x in qs], dtype=torch.int32, device=dev)
    xi = torch.from_numpy(extra_idx).to(dev).view(b, 1, -1)
    sched = flash_mla.get_mla_metadata()[0]
    out, _ = flash_mla.flash_mla_with_kvcache(
        q.to(dev), pool_view(window, meta["window"], dev), None, None, 512, sched,
        softmax_scale=scale, indices=idx, attn_sink=sink.to(dev),
        extra_k_cache=pool_view(pools[extra_name], meta[extra_name], dev),
        extra_indices_in_kvcache=xi, topk_length=tl, extra_topk_length=xl,
        is_fp8_kvcache=True, use_legacy=True,
    )
    out = out.float().cpu()
    results = []
    for j, x in enumerate(qs):
        # The reference reads the unmutated pools through the unmutated indices.
        rows = torch.cat([
            decode_rows(pools["window"], 64, meta["window"]["page_bytes"],
                        x["indices"][: x["topk_length"]]),
            decode_rows(pools[extra_name], meta[extra_name]["entries"],
                        meta[extra_name]["page_bytes"],
                        x["extra_indices"][: x["extra_topk_length"]]),
        ])
        ref_k = reference(q[j, 0], rows, scale, sink, bf16_p=True)
        ref_f = reference(q[j, 0], rows, scale, sink, bf16_p=False)
        r = close(out[j, 0], ref_k)
        r["vs_plain_formula"] = close(out[j, 0], ref_f)
        r["rows"] = int(rows.shape[0])
        r["q_position"] = x["q"]
        results.append(r)
    return {"pass": all(r["pass"] for r in results), "requests": results,
            "extra": extra_name, "mutated_pages": note}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    meta = json.load(open(os.path.join(a.inputs, "meta.json")))
    pools = {k: np.fromfile(os.path.join(a.inputs, k + ".bin"), dtype=np.uint8)
             for k in ("window", "c4", "c128")}
    report = {"model": meta["model"], "window_stats": meta["window_stats"]}
    # Our decoder against the Rust codec's rows.
    q0 = meta["queries"][0][0]
    w = decode_rows(pools["window"], 64, meta["window"]["page_bytes"], q0["indices"][:4])
    c = decode_rows(pools["c4"], 64, meta["c4"]["page_bytes"], q0["extra_indices"][:4])
    report["decoder_agrees_with_codec"] = bool(
        torch.equal(w.float(), torch.tensor(meta["expect_window_rows"]).float())
        and torch.equal(c.float(), torch.tensor(meta["expect_c4_rows"]).float()))
    dev = "cuda"
    for layer in (0, 1):
        for mutate in (None, "swap_window_pages", "shift_extra_indices"):
            key = f"layer{layer}_{mutate or 'ours'}"
            try:
                report[key] = run_layer(meta, pools, layer, dev, mutate)
            except Exception:
                report[key] = {"pass": False, "error": traceback.format_exc()[-3000:]}
            print(key, "pass" if report[key].get("pass") else "FAIL",
                  [round(r["cos_diff"], 9) for r in report[key].get("requests", [])],
                  report[key].get("error", "")[-500:], flush=True)
    verdict = (report["decoder_agrees_with_codec"]
               and report["layer0_ours"].get("pass") and report["layer1_ours"].get("pass")
               and not any(report[f"layer{l}_{m}"].get("pass")
                           for l in (0, 1) for m in ("swap_window_pages", "shift_extra_indices")))
    report["verdict"] = "pass" if verdict else "fail"
    print("verdict", report["verdict"], "decoder", report["decoder_agrees_with_codec"])
    json.dump(report, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
