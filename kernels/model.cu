// The reference model's forward on the GPU (src/model/cuda.rs). Compiled after
// common.cuh with the crate's exact-IEEE NVRTC options (no FMA contraction, IEEE division
// and square root). Every output element is one thread's loop in the order of the host
// model (src/model/mod.rs): dot products by ascending index, softmax sums by ascending
// selected position. No reduction order depends on the batch, so the bits are the host's
// and do not change with batch size, batch mates, chunk size or position in the batch.
//
// Tokens: `pos[t] < 0` marks a padding token (CUDA-graph buckets); kernels that read the
// cache skip it. A block-table entry below 0, or a page past its pool, where the model
// needs a page sets `*fail` (and nothing is read there).
//
// Draft chains (MTP proposals): with `ov_last` non-null, token t reads positions past
// `ov_last[t]` from its own overlay page instead of the cache (the KV the chain computed
// but did not write): MLA rows at `ov_rows + (t x 64 + j - ov_last[t] - 1) x row_bytes`,
// indexer keys in page t of `ov_keys` (64 x 128 value bytes, then 64 x 4 scale bytes).

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

extern "C" __global__ void m_embed(float* x, const u32* tok, const float* emb, int n, int h,
                                   int vocab) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * h) return;
    int t = (int)(i / h), c = (int)(i % h);
    u32 r = tok[t] % (u32)vocab;
    x[i] = emb[(long)r * h + c];
}

// out[t] = x[t] / sqrt(mean(x[t]^2) + 1e-6)
extern "C" __global__ void m_rmsnorm(float* out, const float* x, int n, int h) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* v = x + (long)t * h;
    float s = 0.0f;
    for (int i = 0; i < h; i++) s = s + v[i] * v[i];
    float ms = s / (float)h;
    float r = 1.0f / sqrtf(ms + 1e-6f);
    for (int i = 0; i < h; i++) out[(long)t * h + i] = v[i] * r;
}

// out[t*os + oo + r] = sum_c w[r][c] * x[t*xs + xo + c]   (c ascending)
extern "C" __global__ void m_matvec(float* out, int os, int oo, const float* w, int rows,
                                    int cols, const float* x, int xs, int xo, int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * rows) return;
    int t = (int)(i / rows), r = (int)(i % rows);
    const float* wr = w + (long)r * cols;
    const float* v = x + (long)t * xs + xo;
    float s = 0.0f;
    for (int c = 0; c < cols; c++) s = s + wr[c] * v[c];
    out[(long)t * os + oo + r] = s;
}

// out[t*os + oo + c] = sum_r w[r][c] * x[t*xs + xo + r]   (r ascending; W transposed)
extern "C" __global__ void m_matvec_t(float* out, int os, int oo, const float* w, int rows,
                                      int cols, const float* x, int xs, int xo, int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * cols) return;
    int t = (int)(i / cols), c = (int)(i % cols);
    const float* v = x + (long)t * xs + xo;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s = s + w[(long)r * cols + c] * v[r];
    out[(long)t * os + oo + c] = s;
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
extern "C" __global__ void m_index_scores(float* scores, int max_ctx, const int* pos,
                                          const int* row, const u8* qv, const float* qs,
                                          const float* w, int ih, const int* page_table,
                                          const int* block_table, int cols, u64 base,
                                          u64 page_bytes, u64 pages, int tpp,
                                          const int* ov_last, u64 ov_keys, int* fail, int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * max_ctx) return;
    int t = (int)(i / max_ctx), j = (int)(i % max_ctx);
    if (pos[t] < 0 || j > pos[t]) return;
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
            atomicExch(fail, 1);
            return;
        }
        pg = base + (u64)page * page_bytes;
        off = j % tpp;
    }
    const u8* kb = (const u8*)(pg + (u64)off * 128);
    float scale = *(const float*)(pg + (u64)tpp * 128 + (u64)off * 4);
    float s = 0.0f;
    for (int h = 0; h < ih; h++) {
        const u8* q = qv + ((long)t * ih + h) * 128;
        float qsc = qs[(long)t * ih + h];
        float d = 0.0f;
        for (int c = 0; c < 128; c++) d = d + (e4m3_to_f32(q[c]) * qsc) * e4m3_to_f32(kb[c]);
        s = s + w[(long)t * ih + h] * relu_f(d);
    }
    scores[i] = s * scale;
}

// The positions token t attends to, ascending: every j <= pos[t] when the layer has no
// indexer or the context fits in top-k, else the top-k scores (higher first, equal scores
// to the earlier position). One block per token; `rank` is scratch like `scores`.
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
    int* rk = rank + (long)t * max_ctx;
    for (int j = threadIdx.x; j < np; j += blockDim.x) {
        u32 kj = order_key(s[j]);
        int r = 0;
        for (int i = 0; i < np; i++) {
            u32 ki = order_key(s[i]);
            r += (ki > kj || (ki == kj && i < j)) ? 1 : 0;
        }
        rk[j] = r;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int m = 0;
        for (int j = 0; j < np; j++)
            if (rk[j] < topk) out[m++] = j;
        nsel[t] = m;
    }
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

// Element c of a row's latent (c < 512) or RoPE part (c >= 512): enc 1 = fp8_ds_mla
// (E4M3 x its tile's f32 scale; RoPE BF16 at byte 528), enc 0 = BF16.
__device__ __forceinline__ float mla_elem(const u8* r, int c, int enc) {
    if (enc == 1) {
        if (c < 512) return e4m3_to_f32(r[c]) * *(const float*)(r + 512 + 4 * (c / 128));
        return bf16_to_f32(*(const u16*)(r + 528 + 2 * (c - 512)));
    }
    return bf16_to_f32(*(const u16*)(r + 2 * c));
}

// Absorbed sparse MLA of token t, head h over its selected positions: scores
// (q_lat . lat + q_pe . pe) x scale, softmax (max, e^(s - max), sum ascending), o_lat =
// sum_j (e_j / sum) lat_j. One block per (t, h); `ebuf` holds max_ctx floats per (t, h).
extern "C" __global__ void m_attn(float* olat, const float* qlat, const float* qpe,
                                  const int* sel, const int* nsel, int max_ctx, float* ebuf,
                                  const int* pos, const int* row, const int* block_table,
                                  int cols, u64 base, u64 page_stride, int pages, int tpp,
                                  int row_bytes, int enc, float scale, int heads,
                                  const int* ov_last,
                                  u64 ov_rows, int* fail, int n) {
    int t = blockIdx.x / heads, h = blockIdx.x % heads;
    if (t >= n || pos[t] < 0) return;
    int ns = nsel[t];
    const int* sp = sel + (long)t * max_ctx;
    float* e = ebuf + ((long)t * heads + h) * max_ctx;
    const float* ql = qlat + ((long)t * heads + h) * 512;
    const float* qp = qpe + ((long)t * heads + h) * 64;
    int rw = row[t];
    for (int k = threadIdx.x; k < ns; k += blockDim.x) {
        const u8* r = mla_row(sp[k], rw, block_table, cols, base, page_stride, pages, tpp,
                              row_bytes, t, ov_last, ov_rows, fail);
        if (!r) {
            e[k] = 0.0f;
            continue;
        }
        float a = 0.0f, b = 0.0f;
        for (int c = 0; c < 512; c++) a = a + ql[c] * mla_elem(r, c, enc);
        for (int c = 0; c < 64; c++) b = b + qp[c] * mla_elem(r, 512 + c, enc);
        e[k] = (a + b) * scale;
    }
    __syncthreads();
    __shared__ float total;
    if (threadIdx.x == 0) {
        float m = __int_as_float(0xff800000);
        for (int k = 0; k < ns; k++)
            if (e[k] > m) m = e[k];
        float sum = 0.0f;
        for (int k = 0; k < ns; k++) {
            float v = model_exp(e[k] - m);
            e[k] = v;
            sum = sum + v;
        }
        total = sum;
    }
    __syncthreads();
    float sum = total;
    for (int c = threadIdx.x; c < 512; c += blockDim.x) {
        float o = 0.0f;
        for (int k = 0; k < ns; k++) {
            const u8* r = mla_row(sp[k], rw, block_table, cols, base, page_stride, pages,
                                  tpp, row_bytes, t, ov_last, ov_rows, fail);
            if (!r) continue;
            float p = e[k] / sum;
            o = o + p * mla_elem(r, c, enc);
        }
        olat[((long)t * heads + h) * 512 + c] = o;
    }
}
