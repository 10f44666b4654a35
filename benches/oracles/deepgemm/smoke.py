#!/usr/bin/env python3
"""smoke.py -- tiny correctness smoke test of DeepGEMM's SM90 FP8 paged MQA logits.

Backends:
  --backend dg    the DeepGEMM Python extension (import deep_gemm; PYTHONPATH must point at it):
                  deep_gemm.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)
                  deep_gemm.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table,
                                                 schedule_meta, max_context_len, clean_logits)
  --backend shim  the AOT ctypes shim (shim/dg_paged_shim.cu -> libdgshim.so, --shim PATH)

Stages are announced with "[smoke] STAGE ..." lines on stderr (flushed) and appended+fsynced to
--marks FILE, so the last stage reached is known even if the process dies on a signal.  C stdio is
switched to unbuffered first, so DeepGEMM's printf output (DG_JIT_DEBUG=1) is not lost on a crash.

Reference math (same as DeepGEMM tests/test_attention.py::ref_paged_mqa_logits):
  logits[b*N + j, t] = sum_h weights[b*N + j, h] * relu(q[b, j, h, :] . k[t, :])
  with k[t, :] = fp8 value * per-token fp32 scale of token t (scale > 0, so it may be applied
  after the ReLU, which is what the kernel does), for t in the row's valid range:
    2-D context_lens [B, N]:  t < context_lens[b, j]
    1-D context_lens [B]   :  t <= context_lens[b] - N + j   (clean_logits=True writes -inf elsewhere)
  No q scale exists in the API: callers fold it (and n_heads**-0.5 * softmax_scale) into weights.
Metric (deep_gemm.testing.calc_diff): 1 - 2*sum(x*y) / sum(x*x + y*y) over the valid positions.
Tolerances: vs. the fp8-simulated reference < 1e-5 (upstream HEAD test uses 5e-6 for fp32),
            vs. the unquantized bf16 reference < 1e-3 (upstream test tolerance).
"""
import argparse
import ctypes
import faulthandler
import json
import os
import sys
import time
import traceback

MARKS_PATH = None


def mark(msg: str) -> None:
    line = f'[smoke {time.strftime("%H:%M:%S")}] {msg}'
    print(line, file=sys.stderr, flush=True)
    if MARKS_PATH:
        fd = os.open(MARKS_PATH, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + '\n').encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def unbuffer_c_stdio() -> None:
    """Make C-level stdout/stderr unbuffered (DeepGEMM prints with printf)."""
    try:
        libc = ctypes.CDLL(None)
        libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
        for name in ('stdout', 'stderr'):
            fp = ctypes.c_void_p.in_dll(libc, name)
            libc.setvbuf(fp, None, 2, 0)   # _IONBF
    except Exception as e:  # noqa: BLE001
        print(f'[smoke] could not unbuffer C stdio: {e}', file=sys.stderr, flush=True)


def calc_diff(x, y) -> float:
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------
def kv_cache_cast_to_fp8(x):
    """Upstream layout: per block, block_size*head_dim fp8 values then block_size fp32 scales."""
    import torch
    num_blocks, block_size, num_heads, head_dim = x.shape
    assert num_heads == 1
    x_amax = x.abs().float().amax(dim=3, keepdim=True).clamp(1e-4)
    sf = x_amax / 448.0
    x_scaled = (x * (1.0 / sf)).to(torch.float8_e4m3fn)
    x_cast_back = x_scaled.float() * sf
    x_fp8 = torch.empty((num_blocks, block_size * (head_dim + 4)), device=x.device, dtype=torch.uint8)
    x_fp8[:, : block_size * head_dim] = x_scaled.view(num_blocks, block_size * head_dim).view(torch.uint8)
    x_fp8[:, block_size * head_dim:] = sf.view(num_blocks, block_size).view(torch.uint8)
    return x_fp8.view(num_blocks, block_size, num_heads, head_dim + 4), x_cast_back


def make_case(batch_size, next_n, num_heads, ctx_last, is_2d, seed):
    import torch
    head_dim, block_kv = 128, 64
    gen = torch.Generator(device='cuda')
    gen.manual_seed(seed)
    dev = 'cuda'
    ctx = torch.tensor(ctx_last, dtype=torch.int32, device=dev)
    assert ctx.numel() == batch_size and int(ctx.min()) >= 1
    q = torch.randn((batch_size, next_n, num_heads, head_dim), device=dev, generator=gen).to(torch.bfloat16)
    weights = torch.randn((batch_size * next_n, num_heads), device=dev, generator=gen, dtype=torch.float32)
    blocks_per_seq = [(c + block_kv - 1) // block_kv for c in ctx_last]
    max_blocks, total_blocks = max(blocks_per_seq), sum(blocks_per_seq)
    kv = torch.randn((total_blocks, block_kv, 1, head_dim), device=dev, generator=gen).to(torch.bfloat16)
    block_table = torch.zeros((batch_size, max_blocks), device=dev, dtype=torch.int32)
    perm = torch.randperm(total_blocks, device=dev, generator=gen).to(torch.int32)
    off = 0
    for i, nb in enumerate(blocks_per_seq):
        block_table[i, :nb] = perm[off:off + nb]
        off += nb
    kv_fused, kv_deq = kv_cache_cast_to_fp8(kv)
    q_fp8 = q.to(torch.float8_e4m3fn)
    if is_2d:
        ctx_in = ((ctx.unsqueeze(1) + 1) * torch.rand((batch_size, next_n), device=dev, generator=gen)).int()
        ctx_in[:, -1] = ctx
        ctx_in = ctx_in.contiguous()
        valid = ctx_in.view(-1).long()
    else:
        ctx_in = ctx
        rows = torch.arange(batch_size * next_n, device=dev)
        valid = (ctx[rows // next_n] - next_n + rows % next_n + 1).long().clamp(min=0)
    return dict(batch_size=batch_size, next_n=next_n, num_heads=num_heads, head_dim=head_dim, block_kv=block_kv,
                is_2d=is_2d, ctx_last=ctx, context_lens=ctx_in, valid=valid, q=q, q_fp8=q_fp8, weights=weights,
                kv=kv, kv_fused=kv_fused, kv_deq=kv_deq, block_table=block_table,
                max_context_len=max_blocks * block_kv, num_blocks=total_blocks)


def reference(case, simulated: bool):
    import torch
    B, N, D, BLK = case['batch_size'], case['next_n'], case['head_dim'], case['block_kv']
    q = (case['q_fp8'].float() if simulated else case['q'].float())
    kv = (case['kv_deq'] if simulated else case['kv'].float())
    w = case['weights'].float()
    T = case['max_context_len']
    out = torch.full((B * N, T), float('-inf'), device='cuda', dtype=torch.float32)
    valid = case['valid'].tolist()
    for b in range(B):
        nb = (int(case['ctx_last'][b]) + BLK - 1) // BLK
        k = kv[case['block_table'][b, :nb].long()].reshape(nb * BLK, D)            # [T_b, D]
        s = torch.einsum('jhd,td->jht', q[b], k).relu()                           # [N, H, T_b]
        s = (s * w[b * N:(b + 1) * N, :, None]).sum(dim=1)                        # [N, T_b]
        for j in range(N):
            L = min(valid[b * N + j], nb * BLK)
            out[b * N + j, :L] = s[j, :L]
    return out


def compare(case, logits, clean: bool):
    import torch
    B, N, T = case['batch_size'], case['next_n'], case['max_context_len']
    assert logits.shape == (B * N, T), f'logits shape {tuple(logits.shape)} != {(B * N, T)}'
    logits = logits.float()
    pos = torch.arange(T, device='cuda').unsqueeze(0)
    mask = pos < case['valid'].unsqueeze(1)
    ref = reference(case, simulated=False)
    sim = reference(case, simulated=True)
    lm = logits.masked_fill(~mask, 0)
    res = dict(
        diff_vs_bf16_ref=calc_diff(lm, ref.masked_fill(~mask, 0)),
        diff_vs_simulated=calc_diff(lm, sim.masked_fill(~mask, 0)),
        max_abs_err_vs_simulated=float((lm - sim.masked_fill(~mask, 0)).abs().max()),
        max_abs_simulated=float(sim.masked_fill(~mask, 0).abs().max()),
        nonfinite_in_valid=int((~torch.isfinite(logits) & mask).sum()),
        logits_stride0=int(logits.stride(0)) if logits.dim() == 2 else None,
    )
    if clean:
        res['clean_mask_ok'] = bool(torch.equal(logits == float('-inf'), ~mask))
    # The fp8-simulated reference is the real check; the bf16 one (upstream: < 1e-3 on large
    # random cases) is noisier on these tiny cases, so it gets a 2e-3 bound here.
    res['ok'] = (res['diff_vs_simulated'] < 1e-5 and res['diff_vs_bf16_ref'] < 2e-3
                 and res['nonfinite_in_valid'] == 0 and res.get('clean_mask_ok', True))
    return res


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------
class DGBackend:
    name = 'dg'

    def __init__(self, args):
        mark('STAGE import deep_gemm BEGIN')
        import deep_gemm
        self.dg = deep_gemm
        mark(f'STAGE import deep_gemm OK file={deep_gemm.__file__} version={getattr(deep_gemm, "__version__", "?")}')
        self.num_sms = deep_gemm.get_num_sms()
        mark(f'STAGE get_num_sms OK num_sms={self.num_sms}')
        # >= 7f2a703 only accepts 2-D context_lens (and has fp8_fp4_paged_mqa_logits)
        self.supports_1d = not hasattr(deep_gemm, 'fp8_fp4_paged_mqa_logits')

    def nojit_probe(self):
        import torch
        mark('STAGE nojit cublaslt_gemm_nt BEGIN')
        a = torch.randn(128, 256, device='cuda', dtype=torch.bfloat16)
        b = torch.randn(64, 256, device='cuda', dtype=torch.bfloat16)
        d = torch.empty(128, 64, device='cuda', dtype=torch.bfloat16)
        self.dg.cublaslt_gemm_nt(a, b, d)
        torch.cuda.synchronize()
        diff = calc_diff(d.float(), a.float() @ b.float().T)
        mark(f'STAGE nojit cublaslt_gemm_nt OK diff={diff:.2e}')
        return diff

    def exception_probe(self):
        """A DeepGEMM host assertion (DG_HOST_ASSERT -> C++ throw -> pybind11 -> RuntimeError),
        raised before any JIT work.  If *this* kills the process, C++ exceptions crossing the
        extension boundary are broken (and every JIT failure would look like a segfault)."""
        import torch
        mark('STAGE exception probe BEGIN (expects a RuntimeError from a DG_HOST_ASSERT)')
        bad = torch.zeros((2, 1), dtype=torch.float32, device='cuda')   # context_lens must be int32
        try:
            self.dg.get_paged_mqa_logits_metadata(bad, 64, self.num_sms)
        except RuntimeError as e:
            mark(f'STAGE exception probe OK: {str(e)[:200]}')
            return f'RuntimeError: {str(e)[:200]}'
        raise AssertionError('exception probe: no exception raised for float32 context_lens')

    def metadata(self, context_lens, block_kv):
        return self.dg.get_paged_mqa_logits_metadata(context_lens, block_kv, self.num_sms)

    def logits(self, case, schedule, clean):
        return self.dg.fp8_paged_mqa_logits(case['q_fp8'], case['kv_fused'], case['weights'], case['context_lens'],
                                            case['block_table'], schedule, case['max_context_len'], clean)


class ShimBackend:
    name = 'shim'

    def __init__(self, args):
        import torch
        mark(f'STAGE load shim BEGIN {args.shim}')
        self.lib = ctypes.CDLL(os.path.abspath(args.shim))
        self.lib.dgshim_info.restype = ctypes.c_char_p
        self.lib.dgshim_last_error.restype = ctypes.c_char_p
        self.lib.dgshim_metadata.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                             ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.supports_1d = hasattr(self.lib, 'dgshim_logits_n2_h64_1d')
        mark(f'STAGE load shim OK info="{self.lib.dgshim_info().decode()}" num_sms={self.num_sms}')

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f'{what}: {self.lib.dgshim_last_error().decode()}')

    def metadata(self, context_lens, block_kv):
        import torch
        assert block_kv == 64
        B = context_lens.size(0)
        N = context_lens.size(1) if context_lens.dim() == 2 else 1
        sched = torch.empty((self.num_sms + 1, 2), dtype=torch.int32, device='cuda')
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.dgshim_metadata(context_lens.data_ptr(), sched.data_ptr(), B, N,
                                             int(context_lens.dim() == 2), self.num_sms, stream), 'dgshim_metadata')
        return sched

    def logits(self, case, schedule, clean):
        import torch
        B, N, H = case['batch_size'], case['next_n'], case['num_heads']
        T = case['max_context_len']
        stride = (T + 255) // 256 * 256
        buf = torch.empty((B * N, stride), dtype=torch.float32, device='cuda')
        name = f'dgshim_logits_n{N}_h{H}_{"2d" if case["is_2d"] else "1d"}'
        fn = getattr(self.lib, name)
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
                                               ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
        kv = case['kv_fused']
        self._check(fn(case['q_fp8'].data_ptr(), kv.data_ptr(), case['weights'].data_ptr(),
                       case['context_lens'].data_ptr(), buf.data_ptr(), case['block_table'].data_ptr(),
                       schedule.data_ptr(), B, case['num_blocks'], kv.stride(0), case['block_table'].stride(0),
                       stride, self.num_sms, torch.cuda.current_stream().cuda_stream), name)
        logits = buf[:, :T]
        if clean:   # emulate DeepGEMM's clean_logits pass (the shim does not implement it)
            pos = torch.arange(T, device='cuda').unsqueeze(0)
            logits.masked_fill_(pos >= case['valid'].unsqueeze(1), float('-inf'))
        return logits


# ----------------------------------------------------------------------------------------------
def check_schedule(sched, num_sms, B):
    s = sched.cpu()
    info = dict(shape=list(s.shape), last_row=s[-1].tolist(), first_rows=s[:4].tolist())
    ok = tuple(s.shape) == (num_sms + 1, 2) and int(s[-1, 1]) == 0 and int(s[-1, 0]) >= B \
        and bool((s[1:, 0] >= s[:-1, 0]).all())
    info['plausible'] = bool(ok)
    return info


def run_cases(backend, args, results):
    import torch
    cases = [
        # (label, B, N, H, ctx_last, is_2d, clean)
        ('2d_n1', 3, 1, 64, [1, 130, 700], True, False),
        ('2d_n2', 3, 2, 64, [5, 64, 700], True, False),
    ]
    if backend.supports_1d and not args.only_2d:
        cases.append(('1d_n2_clean', 3, 2, 64, [3, 200, 513], False, True))
    if args.heads32:
        cases.append(('2d_n1_h32', 2, 1, 32, [77, 300], True, False))
    all_ok = True
    for i, (label, B, N, H, ctx, is_2d, clean) in enumerate(cases):
        rec = dict(label=label, B=B, N=N, H=H, ctx=ctx, is_2d=is_2d, clean=clean)
        results['cases'].append(rec)
        case = make_case(B, N, H, ctx, is_2d, seed=1234 + i)
        mark(f'STAGE metadata[{label}] BEGIN context_lens shape={tuple(case["context_lens"].shape)}')
        sched = backend.metadata(case['context_lens'], case['block_kv'])
        torch.cuda.synchronize()
        rec['schedule'] = check_schedule(sched, backend.num_sms, B)
        mark(f'STAGE metadata[{label}] OK {rec["schedule"]}')
        mark(f'STAGE logits[{label}] BEGIN max_context_len={case["max_context_len"]}')
        logits = backend.logits(case, sched, clean)
        torch.cuda.synchronize()
        mark(f'STAGE logits[{label}] returned shape={tuple(logits.shape)} dtype={logits.dtype} stride={logits.stride()}')
        rec.update(compare(case, logits, clean))
        # determinism: a second call must give the same valid values
        logits2 = backend.logits(case, sched, clean)
        pos = torch.arange(case['max_context_len'], device='cuda').unsqueeze(0)
        m = pos < case['valid'].unsqueeze(1)
        rec['repeat_bitwise_equal'] = bool(torch.equal(logits.masked_fill(~m, 0), logits2.masked_fill(~m, 0)))
        rec['ok'] = rec['ok'] and rec['repeat_bitwise_equal']
        all_ok &= rec['ok']
        mark(f'STAGE logits[{label}] {"OK" if rec["ok"] else "FAIL"} '
             f'diff_sim={rec["diff_vs_simulated"]:.3e} diff_bf16={rec["diff_vs_bf16_ref"]:.3e} '
             f'maxabs={rec["max_abs_err_vs_simulated"]:.3e} clean={rec.get("clean_mask_ok")}')
    return all_ok


def run_perf(backend, results):
    """Decode-like timing: B=64, H=64, D=128, context 4K..8K, 2-D context_lens.
    us_loop: CUDA events around 20 back-to-back calls (includes host overhead if host-bound);
    us_graph: the same 20 calls captured in one CUDA graph and replayed (GPU time only)."""
    import torch
    os.environ['DG_JIT_DEBUG'] = '0'                      # DeepGEMM re-reads it on every call
    os.environ['DG_JIT_PRINT_COMPILER_COMMAND'] = '0'
    perf = []
    for N in (1, 2):
        B, H, iters = 64, 64, 20
        g = torch.Generator(device='cpu')
        g.manual_seed(7)
        ctx = torch.randint(4096, 8193, (B,), generator=g).tolist()
        case = make_case(B, N, H, ctx, True, seed=99 + N)
        sched = backend.metadata(case['context_lens'], 64)
        for _ in range(3):
            backend.logits(case, sched, False)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            backend.logits(case, sched, False)
        end.record()
        torch.cuda.synchronize()
        t_loop = start.elapsed_time(end) / iters / 1e3
        t_graph = None
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                backend.logits(case, sched, False)
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(iters):
                        backend.logits(case, sched, False)
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            torch.cuda.synchronize()
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            t_graph = start.elapsed_time(end) / iters / 1e3
        except Exception as e:  # noqa: BLE001
            mark(f'PERF graph capture failed (non-fatal): {e!r}')
        t = t_graph if t_graph is not None else t_loop
        tokens = int(case['ctx_last'].sum())
        flops = 2 * tokens * N * H * 128
        nbytes = tokens * (128 + 4) + B * N * H * (128 + 4) + tokens * N * 4
        perf.append(dict(B=B, N=N, H=H, total_ctx_tokens=tokens, us=t * 1e6, us_loop=t_loop * 1e6,
                         us_graph=None if t_graph is None else t_graph * 1e6,
                         tflops=flops / t / 1e12, gbps=nbytes / t / 1e9))
        mark(f'PERF B={B} N={N} H={H} tokens={tokens}: loop {t_loop * 1e6:.1f} us, graph '
             f'{"n/a" if t_graph is None else f"{t_graph * 1e6:.1f} us"}, {flops / t / 1e12:.0f} TFLOPS, '
             f'{nbytes / t / 1e9:.0f} GB/s')
    results['perf'] = perf


def main() -> int:
    global MARKS_PATH
    unbuffer_c_stdio()
    faulthandler.enable()
    ap = argparse.ArgumentParser()
    ap.add_argument('--backend', choices=('dg', 'shim'), default='dg')
    ap.add_argument('--shim', default='libdgshim.so')
    ap.add_argument('--label', default='')
    ap.add_argument('--marks', default=None)
    ap.add_argument('--json', default=None)
    ap.add_argument('--perf', action='store_true')
    ap.add_argument('--only-2d', action='store_true')
    ap.add_argument('--heads32', action='store_true')
    ap.add_argument('--skip-nojit', action='store_true')
    ap.add_argument('--probe-only', action='store_true',
                    help='dg backend: only import + get_num_sms + the C++ exception probe')
    args = ap.parse_args()
    MARKS_PATH = args.marks

    results = dict(label=args.label, backend=args.backend, cases=[], ok=False, error=None,
                   env={k: os.environ.get(k) for k in ('DG_JIT_USE_NVRTC', 'DG_JIT_CACHE_DIR', 'DG_JIT_DEBUG',
                                                        'CUDA_LAUNCH_BLOCKING', 'LD_PRELOAD', 'PYTHONPATH')})
    rc = 1
    try:
        mark(f'STAGE import torch BEGIN ({args.label})')
        import torch
        results['torch'] = dict(version=torch.__version__, cuda=torch.version.cuda,
                                cxx11_abi=bool(torch.compiled_with_cxx11_abi()),
                                device=torch.cuda.get_device_name(0),
                                capability=list(torch.cuda.get_device_capability(0)))
        mark(f'STAGE import torch OK {results["torch"]}')
        backend = DGBackend(args) if args.backend == 'dg' else ShimBackend(args)
        results['num_sms'] = backend.num_sms
        if args.backend == 'dg':
            results['deep_gemm_file'] = backend.dg.__file__
            if args.probe_only:
                results['exception_probe'] = backend.exception_probe()
                results['ok'] = True
                mark('STAGE done (probe only)')
                return 0
            if not args.skip_nojit:
                try:
                    results['nojit_cublaslt_diff'] = backend.nojit_probe()
                except Exception as e:  # noqa: BLE001
                    results['nojit_error'] = repr(e)
                    mark(f'STAGE nojit FAILED (non-fatal): {e!r}')
        ok = run_cases(backend, args, results)
        if args.perf and ok:
            run_perf(backend, results)
        results['ok'] = bool(ok)
        rc = 0 if ok else 1
        mark(f'STAGE done ok={ok}')
    except Exception as e:  # noqa: BLE001
        results['error'] = ''.join(traceback.format_exception(e))
        mark(f'STAGE exception: {e!r}')
        traceback.print_exc()
        rc = 2
    finally:
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(results, f, indent=1, default=str)
    return rc


if __name__ == '__main__':
    sys.exit(main())
