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

`--mode model` (the default when meta.json's `source` is `model`: `v4_dump --source
model`): the pools hold the tiny V4 reference model's rows, and each request's last
position is traced in layers 0 (window only), 1 (ratio 4, the indexer's top-64) and 2
(ratio 128, every entry): the bf16 query and the f32 output of each of the model's 2
heads, its sinks and softmax scale, the window positions and entries it read, and the
kernel's indices computed from them by `metadata::v4`. FlashMLA takes 64 query heads:
the model's 2 are heads 0-1; heads 2-63 get seeded bf16 queries of the model's query
RMS and seeded sinks drawn as the model draws its own. Per layer, both requests in one
batch (layer 0 with `extra_k_cache=None`, else the layer's compressed pool):
* (a) this script's decoder (numpy, e4m3 by table) equals our codec's rows exactly;
* (b) FlashMLA vs the float64 formula over the pool rows, all 64 heads, FlashMLA's
  criteria (also reported per head group, and against the bf16-probability formula);
* (c) FlashMLA's heads 0-1 vs the model's own outputs, the same criteria;
* (d) the model's outputs vs the float64 formula, within a bound derived from the
  model's f32 arithmetic (`model_bound`: 512-term f32 dots, the exp polynomial's
  relative error `EXP_REL` = 2^-19, measured too, the sums; per element
  (Theta + gamma_(n+1) (1 + Theta)) sum_j p_j |v_jc|), reported separately;
* (e) mutations, each judged against the unmutated references, must fail (b) and (c):
  two used window pages swapped, the window indices shifted by one page, the extra
  indices shifted by one page.
`--fake-kernel` runs the model mode without a GPU, a host stand-in in the kernel's place
(a dry run of the script, no evidence about FlashMLA).
"""
import argparse
import json
import os
import sys
import traceback

import numpy as np

try:  # not needed by --fake-kernel dry runs of the model mode
    import torch
except ImportError:
    torch = None

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


def main_random(a, meta, pools):
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


# ---------------------------------------------------------------------------------------
# --mode model: the V4 reference model's pools, queries and outputs (numpy on the host;
# torch only for the kernel call).

U = 2.0 ** -24  # f32 unit roundoff


def gamma(n):
    """Higham's gamma_n = n u / (1 - n u): the relative bound of n f32 roundings."""
    return n * U / (1.0 - n * U)


# The model's exp (crates/dsa-kv-model/src/math.rs): k = round(x log2 e), r = x - k c1 -
# k c2 (c1 = 0.69314575 has 15 significant bits, so k c1 is exact for |k| < 2^8 and
# x - k c1 is exact by Sterbenz), then a degree-7 Taylor polynomial in r, |r| <= ln2/2,
# by Horner in f32, times 2^k (exact). Its relative error: truncation r^8/8! / e^r
# < 7.3e-9; Horner, 14 roundings on terms whose absolute sum is e^|r| <= 2 e^r:
# 2 gamma_14 < 1.67e-6; the reduction's last rounding: u |r| < 0.35 u. Together under
# 2^-19 (1.91e-6), which the script also measures on a grid.
EXP_REL = 2.0 ** -19

E4M3 = np.zeros(256)
for _b in range(256):
    _s, _e, _m = _b >> 7, (_b >> 3) & 15, _b & 7
    _v = (_m / 8.0) * 2.0 ** -6 if _e == 0 else (1 + _m / 8.0) * 2.0 ** (_e - 7)
    E4M3[_b] = np.nan if (_e == 15 and _m == 7) else (-_v if _s else _v)


def bf16_bits_to_f64(bits):
    b = np.asarray(bits, dtype=np.uint32) << 16
    return b.view(np.float32).astype(np.float64)


def f32_bits_to_f64(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32).astype(np.float64)


def to_bf16_bits(x):
    """float32 values -> bf16 bit patterns, round to nearest even (no NaNs here)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def np_decode_rows(pool, geo, idx):
    """Rows `idx` of a MODEL1 pool (per page: data rows of 576 B, then scale rows of 8 B),
    float64 [n, 512]: e4m3 x 2^(scale - 127) per 64 NoPE values, then 64 bf16."""
    idx = np.asarray(idx, dtype=np.int64)
    e, pb = geo["entries"], geo["page_bytes"]
    if len(idx) == 0:
        return np.zeros((0, 512))
    page, i = idx // e, idx % e
    data_off = page * pb + i * 576
    scale_off = page * pb + e * 576 + i * 8
    data = np.stack([pool[o:o + 576] for o in data_off])
    scales = np.stack([pool[o:o + 8] for o in scale_off])
    nope = E4M3[data[:, :448]] * np.repeat(2.0 ** (scales[:, :7].astype(np.float64) - 127), 64, axis=1)
    rope = bf16_bits_to_f64(data[:, 448:576].copy().view(np.uint16))
    return np.concatenate([nope, rope], axis=1)


def np_cos_diff(x, y):
    den = float((x * x + y * y).sum())
    return 0.0 if den == 0 else 1.0 - 2.0 * float((x * y).sum()) / den


def np_close(ans, ref):
    """FlashMLA's decode-test criteria: every element within 1e-3 absolute or 2.01/128
    relative, cosine difference under 5e-6."""
    err = np.abs(ans - ref)
    rel = err / (np.abs(ref) + 1e-6)
    inside = (err < ABS) | (rel < REL)
    cd = np_cos_diff(ans, ref)
    # Not a criterion, a diagnosis: the absolute tolerance scaled to the outputs' size
    # (FlashMLA's 1e-3 is for outputs of its test data, |out| <~ 1).
    big = max(1.0, float(np.abs(ref).max()))
    scaled = (err < ABS * big) | (rel < REL)
    return {"pass": bool(inside.all()) and abs(cd) < COS, "cos_diff": cd,
            "max_abs_err": float(err.max()), "max_abs_ref": float(np.abs(ref).max()),
            "elements_outside": int((~inside).sum()), "elements": int(err.size),
            "diag_outside_abs_scaled_to_max_ref": int((~scaled).sum()),
            "outside": [{"at": [int(i) for i in np.unravel_index(k, ans.shape)],
                         "ref": float(ref.flat[k]), "kernel": float(ans.flat[k]),
                         "abs_err": float(err.flat[k]), "rel_err": float(rel.flat[k])}
                        for k in np.flatnonzero(~inside)[:8]]}


def np_formula(q, rows, scale, sink, bf16_p=False):
    """q [h, 512], rows [n, 512] -> out [h, 512], float64: softmax over the rows, times
    exp(lse) / (exp(lse) + exp(sink)); `bf16_p` rounds the probabilities to bf16 first."""
    s = (q @ rows.T) * scale
    mx = s.max(axis=1, keepdims=True)
    lse = mx + np.log(np.exp(s - mx).sum(axis=1, keepdims=True))
    p = np.exp(s - lse)
    if bf16_p:
        p = bf16_bits_to_f64(to_bf16_bits(p.astype(np.float32)))
    return (p @ rows) / (1.0 + np.exp(sink[:, None] - lse))


def model_bound(q, rows, scale, sink):
    """The model's f32 attention vs the exact formula (the same bf16 q, the same rows, the
    same f32 scale: all exact in float64), per element: |out_f32 - out| <= bound.

    The model (attend_sink): s_j = fl(fl(q . r_j) scale), dots summed in index order;
    m = max(sink, s); e_j = exp(s_j - m); S = exp(sink - m) + sum e_j in order;
    p_j = e_j / S; out_c = sum_j p_j r_jc in order. First order in u, each step bounded:
    * score: |s^_j - s_j| <= scale gamma_512 sum_i |q_i r_ji| + u |s_j|, and the
      subtraction of m adds u |s_j - m| (the sink's u |sink - m|); m itself cancels;
      D = the largest of these per head;
    * p^_j / p_j - 1 <= Theta = expm1(2 D + 2 EXP_REL + 2 gamma_(n+1) + 2 u) (D and
      exp's error enter numerator and denominator; the sum's gamma_(n+1) and the
      division's u; the small terms doubled for the second-order ones);
    * the P.V sum: gamma_(n+1) sum_j |p^_j r_jc|.
    So bound_c = (Theta + gamma_(n+1) (1 + Theta)) sum_j p_j |r_jc|."""
    n = rows.shape[0]
    s = (q @ rows.T) * scale
    a = (np.abs(q) @ np.abs(rows).T) * scale
    m = np.maximum(s.max(axis=1), sink)
    d = gamma(512) * a + U * np.abs(s) + U * np.abs(s - m[:, None])
    dmax = np.maximum(d.max(axis=1), U * np.abs(sink - m))
    theta = np.expm1(2 * dmax + 2 * EXP_REL + 2 * gamma(n + 1) + 2 * U)
    e = np.exp(s - m[:, None])
    p = e / (e.sum(axis=1) + np.exp(sink - m))[:, None]
    w = p @ np.abs(rows)
    return (theta + gamma(n + 1) * (1 + theta))[:, None] * w, w, theta


def model_exp_f32(x):
    """The model's exp, emulated in f32 (every numpy float32 op rounds once, as Rust's)."""
    x = np.asarray(x, dtype=np.float32)
    y = (x * np.float32(1.4426950408889634)).astype(np.float64)  # f32 product, exactly
    k = (np.floor(np.abs(y) + 0.5) * np.sign(y)).astype(np.float32)  # f32::round
    r = (x - k * np.float32(0.69314575)) - k * np.float32(1.4286068e-6)
    p = np.float32(1.0) / np.float32(5040.0)
    for c in (720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0):
        p = p * r + np.float32(1.0) / np.float32(c)
    return p.astype(np.float64) * 2.0 ** k.astype(np.float64)


def exp_check():
    """The measured relative error of the model's exp on [-87, 0] against float64."""
    rng = np.random.default_rng(3)
    x = np.concatenate([np.linspace(-87.0, 0.0, 1 << 21), rng.uniform(-30.0, 0.0, 1 << 20),
                        rng.uniform(-1.0, 0.0, 1 << 20)]).astype(np.float32)
    rel = np.abs(model_exp_f32(x) / np.exp(x.astype(np.float64)) - 1.0)
    return {"max_rel_err": float(rel.max()), "stated_bound": EXP_REL,
            "pass": bool(rel.max() <= EXP_REL), "points": int(x.size)}


class Batch:
    """One layer's queries of every request, and the kernel's inputs."""

    def __init__(self, meta, pools, li, heads=64):
        self.qs = [r[li] for r in meta["queries"]]
        x0 = self.qs[0]
        self.layer, self.ratio, self.extra = x0["layer"], x0["ratio"], x0["extra"]
        mh = meta["model_heads"]
        b, self.h, self.mh = len(self.qs), heads, mh
        rng = np.random.default_rng(1000 + self.layer)
        self.q_bits = np.zeros((b, heads, 512), dtype=np.uint16)
        for j, x in enumerate(self.qs):
            mq = np.asarray(x["q_bf16_bits"], dtype=np.uint16)
            rms = float(np.sqrt((bf16_bits_to_f64(mq) ** 2).mean()))
            self.q_bits[j, :mh] = mq
            seeded = rng.standard_normal((heads - mh, 512)) * rms
            self.q_bits[j, mh:] = to_bf16_bits(seeded.astype(np.float32))
        # A layer's sinks are the same for every request: the model's for its heads, the
        # rest drawn as the model draws its own (uniform in +-sqrt(3 / model heads)).
        sinks = {tuple(x["sink_bits"]) for x in self.qs}
        assert len(sinks) == 1, "one layer, one set of sinks"
        a = np.sqrt(3.0 / mh)
        self.sink = np.concatenate([f32_bits_to_f64(self.qs[0]["sink_bits"]),
                                    rng.uniform(-a, a, heads - mh)]).astype(np.float32)
        scales = {x["softmax_scale_bits"] for x in self.qs}
        assert len(scales) == 1
        self.scale = float(f32_bits_to_f64([scales.pop()])[0])
        self.idx = np.array([x["indices"] for x in self.qs], dtype=np.int32)
        self.tl = np.array([x["topk_length"] for x in self.qs], dtype=np.int32)
        if self.extra:
            self.xidx = np.array([x["extra_indices"] for x in self.qs], dtype=np.int32)
            self.xl = np.array([x["extra_topk_length"] for x in self.qs], dtype=np.int32)
        else:
            self.xidx = self.xl = None
        self.q = bf16_bits_to_f64(self.q_bits)
        self.model_out = np.stack([f32_bits_to_f64(x["out_f32_bits"]) for x in self.qs])
        # The rows each query reads, from the pools as dumped, through its indices.
        self.rows = []
        for x in self.qs:
            r = np_decode_rows(pools["window"], meta["window"], x["indices"][:x["topk_length"]])
            if self.extra:
                r = np.concatenate([r, np_decode_rows(
                    pools[self.extra], meta[self.extra],
                    x["extra_indices"][:x["extra_topk_length"]])])
            self.rows.append(r)


def flashmla_kernel(meta, b, window, idx, extra_pool, xidx, xl, extra_none):
    """FlashMLA's legacy MODEL1 sparse decode on the GPU -> float64 [batch, heads, 512]."""
    import flash_mla

    dev = "cuda"
    n = len(b.qs)
    q = torch.from_numpy(b.q_bits.view(np.int16).copy()).view(torch.bfloat16)
    q = q.view(n, 1, b.h, 512).to(dev)
    kw = {}
    if not extra_none:
        kw = dict(extra_k_cache=pool_view(extra_pool[0], extra_pool[1], dev),
                  extra_indices_in_kvcache=torch.from_numpy(xidx).to(dev).view(n, 1, -1),
                  extra_topk_length=torch.from_numpy(xl).to(dev))
    out, _ = flash_mla.flash_mla_with_kvcache(
        q, pool_view(window, meta["window"], dev), None, None, 512,
        flash_mla.get_mla_metadata()[0], softmax_scale=b.scale,
        indices=torch.from_numpy(idx).to(dev).view(n, 1, -1),
        attn_sink=torch.from_numpy(b.sink).to(dev),
        topk_length=torch.from_numpy(b.tl).to(dev), is_fp8_kvcache=True, use_legacy=True,
        **kw)
    torch.cuda.synchronize()
    return out.float().cpu().numpy().astype(np.float64).reshape(n, b.h, 512)


def fake_kernel(meta, b, window, idx, extra_pool, xidx, xl, extra_none):
    """A stand-in for dry runs without a GPU (--fake-kernel): the formula over the rows
    the kernel would read, probabilities and output rounded to bf16."""
    outs = []
    for j in range(len(b.qs)):
        r = np_decode_rows(window, meta["window"], idx[j][:b.tl[j]])
        if not extra_none:
            r = np.concatenate([r, np_decode_rows(extra_pool[0], extra_pool[1], xidx[j][:xl[j]])])
        o = np_formula(b.q[j], r, b.scale, b.sink.astype(np.float64), bf16_p=True)
        outs.append(bf16_bits_to_f64(to_bf16_bits(o.astype(np.float32))))
    return np.stack(outs)


def model_layer(meta, pools, li, kernel):
    b = Batch(meta, pools, li)
    sink = b.sink.astype(np.float64)
    mh = b.mh
    rep = {"layer": b.layer, "ratio": b.ratio, "extra": b.extra, "heads": b.h,
           "model_heads": mh, "softmax_scale": b.scale}
    extra_pool = (pools[b.extra], meta[b.extra]) if b.extra else None
    extra_none = b.extra is None
    xidx, xl = b.xidx, b.xl
    if extra_none:
        # Window only: the kernel without an extra cache, if it takes that.
        try:
            out = kernel(meta, b, pools["window"], b.idx, None, None, None, True)
            rep["extra_k_cache"] = "None (window only)"
        except Exception:
            rep["extra_k_cache_none_error"] = traceback.format_exc()[-1500:]
            # Else an extra cache with no entry: the ratio-4 pool, every index -1.
            extra_none, extra_pool = False, (pools["c4"], meta["c4"])
            xidx = np.full((len(b.qs), 128), -1, dtype=np.int32)
            xl = np.zeros(len(b.qs), dtype=np.int32)
            rep["extra_k_cache"] = "the c4 pool with extra_topk_length 0 (None was refused)"
    if not extra_none or "extra_k_cache_none_error" in rep:
        out = kernel(meta, b, pools["window"], b.idx, extra_pool, xidx, xl, extra_none)
    requests = []
    for j, x in enumerate(b.qs):
        rows = b.rows[j]
        ref = np_formula(b.q[j], rows, b.scale, sink)
        ref_p = np_formula(b.q[j], rows, b.scale, sink, bf16_p=True)
        bound, w, theta = model_bound(b.q[j, :mh], rows, b.scale, sink[:mh])
        m_out = b.model_out[j]
        d_err = np.abs(m_out - ref[:mh])
        r = {
            "request": x["request"], "q_position": x["q"], "rows": int(rows.shape[0]),
            "window_rows": int(x["topk_length"]), "entries": int(x["extra_topk_length"]),
            # (b) the kernel vs the float64 formula over the pool rows.
            "b_kernel_vs_formula_all_heads": np_close(out[j], ref),
            "b_kernel_vs_formula_model_heads": np_close(out[j, :mh], ref[:mh]),
            "b_kernel_vs_formula_seeded_heads": np_close(out[j, mh:], ref[mh:]),
            "b_kernel_vs_bf16_p_formula_all_heads": np_close(out[j], ref_p),
            # (c) the kernel's heads 0..mh vs the model's own outputs.
            "c_kernel_vs_model": np_close(out[j, :mh], m_out),
            # (d) the model's f32 outputs vs the float64 formula, within the f32 bound.
            "d_model_vs_formula": {
                "pass": bool((d_err <= bound).all()),
                "elements_outside": int((d_err > bound).sum()),
                "max_abs_err": float(d_err.max()),
                "max_err_over_bound": float((d_err / bound).max()),
                "max_rel_err_vs_sum_p_abs_v": float((d_err / w).max()),
                "theta": [float(t) for t in theta],
                "max_bound": float(bound.max()),
                "cos_diff": np_cos_diff(m_out, ref[:mh]),
            },
        }
        requests.append(r)
    rep["requests"] = requests
    rep["pass_b"] = all(r["b_kernel_vs_formula_all_heads"]["pass"] for r in requests)
    rep["pass_c"] = all(r["c_kernel_vs_model"]["pass"] for r in requests)
    rep["pass_d"] = all(r["d_model_vs_formula"]["pass"] for r in requests)
    # (e) mutations, each judged against the unmutated references: must fail.
    muts = {}
    names = ["swap_window_pages", "shift_window_indices"]
    if b.extra:
        names.append("shift_extra_indices")
    for name in names:
        window, idx, mx = pools["window"].copy(), b.idx.copy(), xidx
        note = None
        if name == "swap_window_pages":
            used = sorted({int(i) // 64 for j, x in enumerate(b.qs)
                           for i in x["indices"][:x["topk_length"]]})
            p0, p1 = used[0], used[-1]
            pb = meta["window"]["page_bytes"]
            a0, a1 = window[p0 * pb:(p0 + 1) * pb].copy(), window[p1 * pb:(p1 + 1) * pb].copy()
            window[p0 * pb:(p0 + 1) * pb], window[p1 * pb:(p1 + 1) * pb] = a1, a0
            note = [p0, p1]
        elif name == "shift_window_indices":
            limit = meta["window"]["pages"] * 64
            idx = np.where(idx >= 0, (idx + 64) % limit, idx).astype(np.int32)
        else:
            e = meta[b.extra]["entries"]
            limit = meta[b.extra]["pages"] * e
            mx = np.where(xidx >= 0, (xidx + e) % limit, xidx).astype(np.int32)
        try:
            mo = kernel(meta, b, window, idx, extra_pool, mx, xl, extra_none)
            vs_f = [np_close(mo[j], np_formula(b.q[j], b.rows[j], b.scale, sink))
                    for j in range(len(b.qs))]
            vs_m = [np_close(mo[j, :mh], b.model_out[j]) for j in range(len(b.qs))]
            muts[name] = {
                "caught": not all(v["pass"] for v in vs_f) and not all(v["pass"] for v in vs_m),
                "cos_diff_vs_formula": [v["cos_diff"] for v in vs_f],
                "cos_diff_vs_model": [v["cos_diff"] for v in vs_m],
                "elements_outside_vs_formula": [v["elements_outside"] for v in vs_f],
                "pages_swapped": note,
            }
        except Exception:
            muts[name] = {"caught": False, "error": traceback.format_exc()[-1500:]}
    rep["mutations"] = muts
    rep["pass_e"] = all(m["caught"] for m in muts.values())
    return rep


def main_model(a, meta, pools):
    kernel = fake_kernel if a.fake_kernel else flashmla_kernel
    report = {"mode": "model", "kernel": "fake (host dry run)" if a.fake_kernel else
              "FlashMLA legacy sparse decode (use_legacy=True)", "model": meta["model"],
              "window_stats": meta["window_stats"], "tails_adopted": meta["tails_adopted"],
              "reused_tokens": meta["reused_tokens"],
              "criteria": {"abs": ABS, "rel": REL, "cos_diff": COS}}
    if not a.fake_kernel:
        import flash_mla
        report["torch"] = torch.__version__
        report["device"] = torch.cuda.get_device_name(0)
        report["flash_mla"] = getattr(flash_mla, "__version__", "?")
    # (a) our decoder against the Rust codec's rows.
    agree = {}
    for name, e in meta["expect_rows"].items():
        got = np_decode_rows(pools[name], meta[name], e["rows"])
        agree[name] = bool(np.array_equal(got, np.asarray(e["values"], dtype=np.float64)))
    report["a_decoder_agrees_with_codec"] = agree
    report["exp_check"] = exp_check()
    layers = {}
    for li in range(len(meta["queries"][0])):
        try:
            rep = model_layer(meta, pools, li, kernel)
        except Exception:
            rep = {"error": traceback.format_exc()[-3000:]}
        layers[f"layer{meta['queries'][0][li]['layer']}"] = rep
        rs = rep.get("requests", [])
        print(f"layer {rep.get('layer')} ratio {rep.get('ratio')} extra {rep.get('extra_k_cache', rep.get('extra'))}:",
              "b", rep.get("pass_b"), [f"{r['b_kernel_vs_formula_all_heads']['cos_diff']:.3g}" for r in rs],
              "c", rep.get("pass_c"), [f"{r['c_kernel_vs_model']['cos_diff']:.3g}" for r in rs],
              "d", rep.get("pass_d"), [f"{r['d_model_vs_formula']['max_err_over_bound']:.3g}" for r in rs],
              "e", rep.get("pass_e"), {k: v.get("cos_diff_vs_formula") for k, v in rep.get("mutations", {}).items()},
              rep.get("error", "")[-800:], flush=True)
    report["layers"] = layers
    checks = {
        "a": all(agree.values()),
        "b": all(l.get("pass_b", False) for l in layers.values()),
        "c": all(l.get("pass_c", False) for l in layers.values()),
        "d": all(l.get("pass_d", False) for l in layers.values()) and report["exp_check"]["pass"],
        "e": all(l.get("pass_e", False) for l in layers.values()),
    }
    report["checks"] = checks
    report["verdict"] = "pass" if all(checks.values()) else "fail"
    print("checks", checks, "verdict", report["verdict"], flush=True)
    json.dump(report, open(a.out, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("random", "model"),
                    help="the dump's source (default: meta.json's `source`, else random)")
    ap.add_argument("--fake-kernel", action="store_true",
                    help="model mode without a GPU: a host stand-in for the kernel (dry run)")
    a = ap.parse_args()
    meta = json.load(open(os.path.join(a.inputs, "meta.json")))
    pools = {k: np.fromfile(os.path.join(a.inputs, k + ".bin"), dtype=np.uint8)
             for k in ("window", "c4", "c128")}
    mode = a.mode or meta.get("source", "random")
    if mode != meta.get("source", "random"):
        sys.exit(f"--mode {mode}, but the dump's source is {meta.get('source', 'random')}")
    if mode == "model":
        main_model(a, meta, pools)
    else:
        main_random(a, meta, pools)


if __name__ == "__main__":
    sys.exit(main())
