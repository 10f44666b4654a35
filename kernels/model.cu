// The reference model's forward on the GPU (src/cuda.rs). Compiled after common.cuh with
// the crate's exact-IEEE NVRTC options (no FMA contraction, IEEE division and square
// root). Every reduction is computed in the host model's order (src/model.rs,
// src/math.rs), so the bits are the host's:
//
// * Lanes32 sums (math.rs `Lanes32`, `dot32`, `sum32`) are one warp: term i goes to lane
//   i mod 32, each lane sums its terms in ascending order from +0, then `warp_sum32`
//   combines the lanes by butterflies at strides 16, 8, 4, 2, 1. They are m_matvec's
//   outputs (one warp per (token, row); the heads' matrices stacked, one launch),
//   m_rmsnorm's sum of squares (one warp per token), m_index_scores' 128-wide dots (one
//   warp per (token, position); the heads summed in ascending order), m_attn_scores'
//   576-term scores (one warp per selected row: the latent's 512 products, then the RoPE
//   part's 64) and m_attn_out's softmax denominator.
// * Ascending sums stay one thread's loop: m_matvec_t's outputs (a head's nope_dim rows)
//   and m_attn_out's output elements (by ascending selected position).
// * Maxima and top-k ranks do not depend on the order (m_attn_out's maximum is a
//   comparison fold that ignores NaN like the host's; m_topk is a radix select on the
//   total order).
// No reduction order depends on the batch, so the bits do not change with batch size,
// batch mates, chunk size or position in the batch.
//
// Tokens: `pos[t] < 0` marks a padding token (CUDA-graph buckets); kernels that read the
// cache skip it. A block-table entry below 0, or a page past its pool, where the model
// needs a page sets `*fail` (and nothing is read there).
//
// Draft chains (MTP proposals): with `ov_last` non-null, token t reads positions past
// `ov_last[t]` from its own overlay page instead of the cache (the KV the chain computed
// but did not write): MLA rows at `ov_rows + (t x 64 + j - ov_last[t] - 1) x row_bytes`,
// indexer keys in page t of `ov_keys` (64 x 128 value bytes, then 64 x 4 scale bytes).
//
// Warp kernels launch blocks of a multiple of 32 threads and never let one lane of a warp
// return alone (the shuffles need all 32).

__device__ __forceinline__ float relu_f(float x) { return x > 0.0f ? x : 0.0f; }

// e^x as in src/model/mod.rs `exp`: x = k ln2 + r (two-part ln 2), degree-7 Taylor
// polynomial of e^r by Horner, times 2^k; 0 below -87.
__device__ float model_exp(float x) {
    if (x != x) return x;
    if (x < -87.0f) return 0.0f;
    if (x > 88.0f) x = 88.0f;
    float k = roundf(x * __uint_as_float(0x3fb8aa3bu));
    float r = x - k * __uint_as_float(0x3f317200u) - k * __uint_as_float(0x35bfbe8eu);
    float p = __uint_as_float(0x39500d01u);
    p = p * r + __uint_as_float(0x3ab60b61u);
    p = p * r + __uint_as_float(0x3c088889u);
    p = p * r + __uint_as_float(0x3d2aaaabu);
    p = p * r + __uint_as_float(0x3e2aaaabu);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * __uint_as_float(((u32)((int)k + 127)) << 23);
}

// f32 -> BF16 bits, round to nearest even, NaN keeps its high bits with the quiet bit
// (the `half` crate's conversion).
__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    if ((x & 0x8000u) != 0 && (x & (3u * 0x8000u - 1u)) != 0) return (u16)((x >> 16) + 1u);
    return (u16)(x >> 16);
}

// Total order of f32 (Rust's `total_cmp`) as an unsigned key.
__device__ __forceinline__ u32 order_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The Lanes32 tree: lane i adds lane i ^ s for s = 16, 8, 4, 2, 1. For i < s that is
// the host's l[i] + l[i + s]; lane i + s computes the same sum commuted (same bits), so
// every lane ends with the host's l[0].
__device__ __forceinline__ float warp_sum32(float v) {
    for (int s = 16; s > 0; s >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, s);
    return v;
}

// Global warp index and lane of this thread.
__device__ __forceinline__ long warp_id() {
    return ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
}
__device__ __forceinline__ int lane_id() { return (int)(threadIdx.x & 31); }

extern "C" __global__ void m_embed(float* x, const u32* tok, const float* emb, int n, int h,
                                   int vocab) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * h) return;
    int t = (int)(i / h), c = (int)(i % h);
    u32 r = tok[t] % (u32)vocab;
    x[i] = emb[(long)r * h + c];
}

// out[t] = x[t] / sqrt(mean(x[t]^2) + 1e-6), the sum of squares a Lanes32 sum. One warp
// per token.
extern "C" __global__ void m_rmsnorm(float* out, const float* x, int n, int h) {
    long t = warp_id();
    int lane = lane_id();
    if (t >= n) return;
    const float* v = x + t * h;
    float s = 0.0f;
    for (int i = lane; i < h; i += 32) s = s + v[i] * v[i];
    s = warp_sum32(s);
    float ms = s / (float)h;
    float r = 1.0f / sqrtf(ms + 1e-6f);
    for (int i = lane; i < h; i += 32) out[t * h + i] = v[i] * r;
}

// out[t*os + oo + g*rows + r] = sum_c w[g][r][c] * x[t*xs + xo + g*xg + c], a Lanes32 sum
// (lane l takes c = l, l + 32, ...: coalesced loads), for `groups` matrices w[g] of
// [rows, cols] stacked (the heads'). One warp per (t, g, r).
extern "C" __global__ void m_matvec(float* out, int os, int oo, const float* w, int rows,
                                    int cols, const float* x, int xs, int xo, int groups,
                                    int xg, int n) {
    long i = warp_id();
    int lane = lane_id();
    int all = groups * rows;
    if (i >= (long)n * all) return;
    int t = (int)(i / all), gr = (int)(i % all), g = gr / rows;
    const float* wr = w + (long)gr * cols;
    const float* v = x + (long)t * xs + xo + (long)g * xg;
    float s = 0.0f;
    for (int c = lane; c < cols; c += 32) s = s + wr[c] * v[c];
    s = warp_sum32(s);
    if (lane == 0) out[(long)t * os + oo + gr] = s;
}

// out[t*os + oo + g*cols + c] = sum_r w[g][r][c] * x[t*xs + xo + g*xg + r] (r ascending;
// W transposed), for `groups` matrices w[g] of [rows, cols] stacked. One thread per
// (t, g, c).
extern "C" __global__ void m_matvec_t(float* out, int os, int oo, const float* w, int rows,
                                      int cols, const float* x, int xs, int xo, int groups,
                                      int xg, int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int all = groups * cols;
    if (i >= (long)n * all) return;
    int t = (int)(i / all), gc = (int)(i % all), g = gc / cols, c = gc % cols;
    const float* wg = w + (long)g * rows * cols;
    const float* v = x + (long)t * xs + xo + (long)g * xg;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s = s + wg[(long)r * cols + c] * v[r];
    out[(long)t * os + oo + gc] = s;
}

// x[i] += y[i]
extern "C" __global__ void m_add(float* x, const float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + y[i];
}

extern "C" __global__ void m_relu(float* x, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = relu_f(x[i]);
}

// RoPE on `count` 64-wide vectors per token at buf[t*stride + off + k*kstride ..], pairs
// (2i, 2i+1) rotated by table[pos][i] = (cos, sin).
extern "C" __global__ void m_rope(float* buf, int stride, int off, int count, int kstride,
                                  const int* pos, const float* table, int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * count * 32) return;
    int p = (int)(i % 32);
    int k = (int)((i / 32) % count);
    int t = (int)(i / (32 * count));
    int ps = pos[t];
    if (ps < 0) return;
    float* v = buf + (long)t * stride + off + (long)k * kstride;
    float c = table[((long)ps * 32 + p) * 2], s = table[((long)ps * 32 + p) * 2 + 1];
    float a = v[2 * p], b = v[2 * p + 1];
    v[2 * p] = a * c - b * s;
    v[2 * p + 1] = a * s + b * c;
}

extern "C" __global__ void m_to_bf16(u16* dst, const float* src, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = f32_to_bf16_bits(src[i]);
}

// Indexer scores of token t against cached position j <= pos[t]:
// sum_h w_h * relu(q_h . k_j) * scale_j, q dequantized (value * scale), keys read through
// the indexer page table of request row[t] as DeepGEMM's paged logits kernel reads them.
// Each q_h . k_j is a Lanes32 sum (lane l: c = l, l + 32, l + 64, l + 96), the heads in
// ascending order. Grid (groups of 16 positions, tokens), 8 warps per block, each warp 2
// positions; dynamic shared memory: the token's dequantized queries (ih x 128 floats).
extern "C" __global__ void m_index_scores(float* scores, int max_ctx, const int* pos,
                                          const int* row, const u8* qv, const float* qs,
                                          const float* w, int ih, const int* page_table,
                                          const int* block_table, int cols, u64 base,
                                          u64 page_bytes, u64 pages, int tpp,
                                          const int* ov_last, u64 ov_keys, int* fail, int n) {
    extern __shared__ float qf[];
    int t = blockIdx.y;
    int j0 = blockIdx.x * 16;
    if (t >= n || pos[t] < 0 || j0 > pos[t]) return;
    for (int i = threadIdx.x; i < ih * 128; i += blockDim.x)
        qf[i] = e4m3_to_f32(qv[(long)t * ih * 128 + i]) * qs[(long)t * ih + i / 128];
    __syncthreads();
    int lane = lane_id(), wp = threadIdx.x >> 5;
    for (int jj = 0; jj < 2; jj++) {
        int j = j0 + wp * 2 + jj;
        if (j > pos[t]) break;
        u64 pg;
        int off;
        if (ov_last && j > ov_last[t]) {
            pg = ov_keys + (u64)t * tpp * 132;
            off = j - ov_last[t] - 1;
        } else {
            // The indexer page table pads with page 0: the block table says whether the
            // position's block is there at all.
            int page = page_table[(long)row[t] * cols + j / tpp];
            int slot = block_table[(long)row[t] * cols + j / tpp];
            if (page < 0 || slot < 0 || (u64)page >= pages) {
                if (lane == 0) atomicExch(fail, 1);
                continue;
            }
            pg = base + (u64)page * page_bytes;
            off = j % tpp;
        }
        const u8* kb = (const u8*)(pg + (u64)off * 128);
        float scale = *(const float*)(pg + (u64)tpp * 128 + (u64)off * 4);
        float k0 = e4m3_to_f32(kb[lane]), k1 = e4m3_to_f32(kb[lane + 32]);
        float k2 = e4m3_to_f32(kb[lane + 64]), k3 = e4m3_to_f32(kb[lane + 96]);
        float s = 0.0f;
        for (int h = 0; h < ih; h++) {
            const float* q = qf + h * 128 + lane;
            float d = 0.0f;
            d = d + q[0] * k0;
            d = d + q[32] * k1;
            d = d + q[64] * k2;
            d = d + q[96] * k3;
            d = warp_sum32(d);
            s = s + w[(long)t * ih + h] * relu_f(d);
        }
        if (lane == 0) scores[(long)t * max_ctx + j] = s * scale;
    }
}

// The positions token t attends to, ascending: every j <= pos[t] when the layer has no
// indexer or the context fits in top-k, else the top-k scores (higher first, equal scores
// to the earlier position). One block per token (a multiple of 32 threads, at most 1024):
// a radix select of the k-th largest key T in the total order (4 passes of 8 bits, a
// shared histogram each), then one ascending pass takes every key above T and the first
// (by position) keys equal to T that complete k, written in order by ballot prefix sums.
// `rank` is unused (the V4 forward, which shares this kernel, still passes its scratch).
extern "C" __global__ void m_topk(int* sel, int* nsel, int* rank, const float* scores,
                                  int max_ctx, const int* pos, int topk, int use_index, int n) {
    int t = blockIdx.x;
    if (t >= n) return;
    int np = pos[t] + 1;
    int* out = sel + (long)t * max_ctx;
    if (np <= 0) {
        if (threadIdx.x == 0) nsel[t] = 0;
        return;
    }
    if (!use_index || np <= topk) {
        for (int j = threadIdx.x; j < np; j += blockDim.x) out[j] = j;
        if (threadIdx.x == 0) nsel[t] = np;
        return;
    }
    const float* s = scores + (long)t * max_ctx;
    __shared__ u32 hist[256];
    __shared__ u32 pick_prefix;
    __shared__ int pick_need;
    __shared__ int warp_eq[32], warp_take[32];
    __shared__ int done_eq, done_out;
    u32 prefix = 0, mask = 0;
    int need = topk;  // keys still to take among those matching `prefix` on `mask`
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < np; j += blockDim.x) {
            u32 k = order_key(s[j]);
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // The bin holding the need-th largest key: lane l owns bins 255 - 8l down to
            // 248 - 8l; counts above each lane by an inclusive scan from lane 0.
            int lane = lane_id();
            int cnt = 0;
            for (int i = 0; i < 8; i++) cnt += (int)hist[255 - 8 * lane - i];
            int incl = cnt;
            for (int o = 1; o < 32; o <<= 1) {
                int v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            u32 hit = __ballot_sync(0xffffffffu, incl >= need);
            if (lane == __ffs(hit) - 1) {
                int above = incl - cnt, b = 255 - 8 * lane;
                for (int i = 0; i < 7; i++) {
                    if (above + (int)hist[b] >= need) break;
                    above += (int)hist[b];
                    b--;
                }
                pick_prefix = prefix | ((u32)b << shift);
                pick_need = need - above;
            }
        }
        __syncthreads();
        prefix = pick_prefix;
        need = pick_need;
        mask |= 255u << shift;
    }
    // prefix is T: `topk - need` keys above it, `need` of the keys equal to it to take.
    int lane = lane_id(), wp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u32 below = (1u << lane) - 1u;
    if (threadIdx.x == 0) {
        done_eq = 0;
        done_out = 0;
    }
    __syncthreads();
    for (int c0 = 0; c0 < np; c0 += blockDim.x) {
        int j = c0 + threadIdx.x;
        u32 k = j < np ? order_key(s[j]) : 0u;
        bool eq = j < np && k == prefix;
        u32 beq = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) warp_eq[wp] = __popc(beq);
        __syncthreads();
        int before = done_eq + __popc(beq & below);
        for (int w = 0; w < wp; w++) before += warp_eq[w];
        bool take = (j < np && k > prefix) || (eq && before < need);
        u32 btake = __ballot_sync(0xffffffffu, take);
        if (lane == 0) warp_take[wp] = __popc(btake);
        __syncthreads();
        if (take) {
            int o = done_out + __popc(btake & below);
            for (int w = 0; w < wp; w++) o += warp_take[w];
            out[o] = j;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 0; w < warps; w++) {
                done_eq += warp_eq[w];
                done_out += warp_take[w];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) nsel[t] = done_out;
}

// Address of the MLA row of position p of request row `rw`, through the block table as a
// global token index (block table entry x tpp + p mod tpp), as FlashMLA's sparse decode
// is handed it.
__device__ __forceinline__ const u8* mla_row(int p, int rw, const int* block_table, int cols,
                                             u64 base, u64 page_stride, int pages, int tpp,
                                             int row_bytes, int t, const int* ov_last,
                                             u64 ov_rows, int* fail) {
    if (ov_last && p > ov_last[t])
        return (const u8*)(ov_rows + ((u64)t * 64 + (u64)(p - ov_last[t] - 1)) * row_bytes);
    int slot = block_table[(long)rw * cols + p / tpp];
    if (slot < 0 || slot >= pages) {
        atomicExch(fail, 1);
        return 0;
    }
    long g = (long)slot * tpp + p % tpp;
    return (const u8*)(base + (u64)(g / tpp) * page_stride + (u64)(g % tpp) * row_bytes);
}

// Absorbed sparse MLA, first the scores: token t's score of selected row k for every head
// h, (q_lat . lat, then q_pe . pe, as one 576-term Lanes32 sum) x scale, into
// ebuf[(t x heads + h) x max_ctx + k], and the row's address into rowp[t x max_ctx + k]
// (0: its page was missing; the score is then 0). One warp per selected row (the row
// dequantized once into registers, lane l holding elements l + 32m); grid (groups of 16
// selected rows, tokens), 8 warps per block; dynamic shared memory: the token's queries
// (heads x 576 floats).
extern "C" __global__ void m_attn_scores(float* ebuf, u64* rowp, const float* qlat,
                                         const float* qpe, const int* sel, const int* nsel,
                                         int max_ctx, const int* pos, const int* row,
                                         const int* block_table, int cols, u64 base,
                                         u64 page_stride, int pages, int tpp, int row_bytes,
                                         int enc, float scale, int heads, const int* ov_last,
                                         u64 ov_rows, int* fail, int n) {
    extern __shared__ float qsh[];
    int t = blockIdx.y, k0 = blockIdx.x * 16;
    if (t >= n || pos[t] < 0 || k0 >= nsel[t]) return;
    int ns = nsel[t];
    for (int i = threadIdx.x; i < heads * 576; i += blockDim.x) {
        int h = i / 576, c = i % 576;
        qsh[i] = c < 512 ? qlat[((long)t * heads + h) * 512 + c]
                         : qpe[((long)t * heads + h) * 64 + (c - 512)];
    }
    __syncthreads();
    int lane = lane_id(), wp = threadIdx.x >> 5;
    const int* sp = sel + (long)t * max_ctx;
    for (int kk = 0; kk < 2; kk++) {
        int k = k0 + wp * 2 + kk;
        if (k >= ns) break;
        const u8* r = mla_row(sp[k], row[t], block_table, cols, base, page_stride, pages, tpp,
                              row_bytes, t, ov_last, ov_rows, fail);
        if (!r) {
            if (lane == 0) {
                for (int h = 0; h < heads; h++) ebuf[((long)t * heads + h) * max_ctx + k] = 0.0f;
                rowp[(long)t * max_ctx + k] = 0;
            }
            continue;
        }
        float v[18];
        if (enc == 1) {
            for (int g = 0; g < 4; g++) {
                float sc = *(const float*)(r + 512 + 4 * g);
                for (int m = 4 * g; m < 4 * g + 4; m++) v[m] = e4m3_to_f32(r[lane + 32 * m]) * sc;
            }
            v[16] = bf16_to_f32(*(const u16*)(r + 528 + 2 * lane));
            v[17] = bf16_to_f32(*(const u16*)(r + 528 + 2 * (lane + 32)));
        } else {
            for (int m = 0; m < 18; m++) v[m] = bf16_to_f32(*(const u16*)(r + 2 * (lane + 32 * m)));
        }
        for (int h = 0; h < heads; h++) {
            const float* q = qsh + h * 576 + lane;
            float a = 0.0f;
            for (int m = 0; m < 18; m++) a = a + q[32 * m] * v[m];
            a = warp_sum32(a);
            if (lane == 0) ebuf[((long)t * heads + h) * max_ctx + k] = a * scale;
        }
        if (lane == 0) rowp[(long)t * max_ctx + k] = (u64)r;
    }
}

// Then the softmax and the output of token t, head h: the maximum by comparison (NaN
// ignored, as the host's fold), e_k = e^(s_k - max), the denominator a Lanes32 sum of the
// e_k (warp 0), o_lat[c] = sum_k (e_k / sum) lat_k[c] by ascending k. Grid (4 slices of
// 128 output elements, tokens x heads), 128 threads (one per element); the slice's
// latent bytes of 64 rows at a time are staged in shared memory with 4-byte loads (for
// fp8_ds_mla a slice is one 128-wide scale tile).
extern "C" __global__ void m_attn_out(float* olat, const float* ebuf, const u64* rowp,
                                      const int* nsel, int max_ctx, const int* pos, int enc,
                                      int heads, int n) {
    int th = blockIdx.y, t = th / heads, slice = blockIdx.x;
    if (t >= n || pos[t] < 0) return;
    int ns = nsel[t];
    const float* e = ebuf + (long)th * max_ctx;
    const u64* rp = rowp + (long)t * max_ctx;
    int lane = lane_id(), wp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __shared__ float red[32];
    __shared__ float max_sh, sum_sh;
    __shared__ u32 tile[64 * 64];
    __shared__ float pk[64], sk[64];
    __shared__ int ok[64];
    float m = __int_as_float(0xff800000);
    for (int k = threadIdx.x; k < ns; k += blockDim.x)
        if (e[k] > m) m = e[k];
    for (int s = 16; s > 0; s >>= 1) {
        float o = __shfl_xor_sync(0xffffffffu, m, s);
        if (o > m) m = o;
    }
    if (lane == 0) red[wp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float mm = __int_as_float(0xff800000);
        for (int w = 0; w < warps; w++)
            if (red[w] > mm) mm = red[w];
        max_sh = mm;
    }
    __syncthreads();
    m = max_sh;
    if (wp == 0) {
        float sum = 0.0f;
        for (int k = lane; k < ns; k += 32) sum = sum + model_exp(e[k] - m);
        sum = warp_sum32(sum);
        if (lane == 0) sum_sh = sum;
    }
    __syncthreads();
    float sum = sum_sh;
    int words = enc == 1 ? 32 : 64;  // 4-byte words of the slice per row
    u64 off = enc == 1 ? (u64)slice * 128 : (u64)slice * 256;
    const u8* tb = (const u8*)tile;
    float o = 0.0f;
    for (int k0 = 0; k0 < ns; k0 += 64) {
        int nk = ns - k0 < 64 ? ns - k0 : 64;
        if ((int)threadIdx.x < nk) {
            u64 r = rp[k0 + threadIdx.x];
            ok[threadIdx.x] = r != 0;
            pk[threadIdx.x] = model_exp(e[k0 + threadIdx.x] - m) / sum;
            sk[threadIdx.x] = (enc == 1 && r) ? *(const float*)(r + 512 + 4 * slice) : 0.0f;
        }
        for (int i = threadIdx.x; i < nk * words; i += blockDim.x) {
            int kr = i / words, w = i % words;
            u64 r = rp[k0 + kr];
            tile[kr * 64 + w] = r ? *(const u32*)(r + off + 4 * w) : 0u;
        }
        __syncthreads();
        for (int kr = 0; kr < nk; kr++) {
            if (!ok[kr]) continue;
            float v = enc == 1 ? e4m3_to_f32(tb[kr * 256 + threadIdx.x]) * sk[kr]
                               : bf16_to_f32(*(const u16*)(tb + kr * 256 + 2 * threadIdx.x));
            o = o + pk[kr] * v;
        }
        __syncthreads();
    }
    olat[(long)th * 512 + slice * 128 + threadIdx.x] = o;
}
