// DeepSeek-V4 reference model on the GPU (dsa-kv-model's `v4::cuda`): the host model's
// arithmetic, bit for bit. Compiled after common.cuh and model.cu (whose m_embed, m_rope,
// m_to_bf16, m_add, m_relu, m_topk, model_exp, relu_f and f32_to_bf16_bits it uses) with
// the crate's exact-IEEE options (no FMA contraction); the intrinsics below also say so
// explicitly. Every output is one thread's loop in the host model's order; indices into
// the pools were checked on the host before a launch.
//
// `v4_dot8` is the host's `math::dot8`: element i goes to lane i mod 8, each lane summed
// in ascending order, then the lanes pairwise ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)).

__device__ float v4_dot8(const float* a, const float* b, int n) {
    float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int k = 0;
    for (; k + 8 <= n; k += 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j) l[j] = __fadd_rn(l[j], __fmul_rn(a[k + j], b[k + j]));
    }
    for (int j = 0; k + j < n; ++j) l[j] = __fadd_rn(l[j], __fmul_rn(a[k + j], b[k + j]));
    return __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[1]), __fadd_rn(l[2], l[3])),
                     __fadd_rn(__fadd_rn(l[4], l[5]), __fadd_rn(l[6], l[7])));
}

// out[v * os + oo + r] = dot8(w[r], x[v * xs + xo ..]) for n vectors of `cols` (the host's
// `Mat::apply8`); one thread per output.
extern "C" __global__ void v4_matvec8(float* out, int os, int oo, const float* w, int rows,
                                      int cols, const float* x, int xs, int xo, int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * rows) return;
    long v = i / rows, r = i % rows;
    out[v * os + oo + r] = v4_dot8(w + r * cols, x + v * xs + xo, cols);
}

// out[v] = x[v] / sqrt(dot8(x[v], x[v]) / width + 1e-6) (the host's `rmsnorm8`); one thread
// per vector.
extern "C" __global__ void v4_rmsnorm8(float* out, const float* x, int n, int width) {
    long v = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= n) return;
    const float* xv = x + v * width;
    float ms = __fdiv_rn(v4_dot8(xv, xv, width), (float)width);
    float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, 1e-6f)));
    for (int i = 0; i < width; ++i) out[v * width + i] = __fmul_rn(xv[i], r);
}

// The rest of the V4 forward (compiled after model.cu, whose m_embed, m_rope, m_to_bf16,
// m_add, m_relu, m_topk and model_exp it uses).

// The score bias of a token's place in its group: rows[t * stride + off + c] +=
// ape[(pos[t] mod ratio) * width + c] (the host's `add(score, ape row)`).
extern "C" __global__ void v4_add_ape(float* rows, int stride, int off, const float* ape,
                                      int width, const int* pos, int ratio, int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * width) return;
    int t = (int)(i / width), c = (int)(i % width);
    float* v = rows + (long)t * stride + off + c;
    *v = __fadd_rn(*v, ape[(long)(pos[t] % ratio) * width + c]);
}

// Compressed entry e (width d), channel c, from its group's state rows read back from the
// state pool (row srow[e * S + s] of row_bytes bytes, half shalf[e * S + s], s < nslots[e]):
// m = the slots' largest score (a strict comparison from -inf), then in slot order
// sum += exp(score - m), acc += exp(score - m) * kv, out = acc / sum. A row is
// [kv (coff x d) | score (coff x d)]. One thread per output.
extern "C" __global__ void v4_entry(float* out, const u8* pool, u64 row_bytes, const i64* srow,
                                    const int* shalf, int S, const int* nslots, int d,
                                    int coff, int ne) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)ne * d) return;
    int e = (int)(i / d), c = (int)(i % d);
    int ns = nslots[e];
    float m = __int_as_float(0xff800000);
    for (int s = 0; s < ns; s++) {
        const float* row = (const float*)(pool + (u64)srow[(long)e * S + s] * row_bytes);
        float v = row[coff * d + shalf[(long)e * S + s] * d + c];
        if (v > m) m = v;
    }
    float sum = 0.0f, acc = 0.0f;
    for (int s = 0; s < ns; s++) {
        const float* row = (const float*)(pool + (u64)srow[(long)e * S + s] * row_bytes);
        int h = shalf[(long)e * S + s];
        float x = model_exp(__fsub_rn(row[coff * d + h * d + c], m));
        sum = __fadd_rn(sum, x);
        acc = __fadd_rn(acc, __fmul_rn(x, row[h * d + c]));
    }
    out[i] = __fdiv_rn(acc, sum);
}

// The inverse of m_rope (same arguments): (a, b) -> (a c + b s, b c - a s).
extern "C" __global__ void v4_rope_inv(float* buf, int stride, int off, int count,
                                       int kstride, const int* pos, const float* table, int n) {
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
    v[2 * p] = __fadd_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v[2 * p + 1] = __fsub_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// x[i] = the BF16 value nearest x[i] (the host's `bf16::from_f32(x).to_f32()`).
extern "C" __global__ void v4_round_bf16(float* x, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = bf16_to_f32(f32_to_bf16_bits(x[i]));
}

// out[v * 128 + c] = e4m3(values[v * 128 + c]) x scales[v] (the host's
// `dequantize_fp8_token`).
extern "C" __global__ void v4_dequant_fp8(float* out, const u8* values, const float* scales,
                                          long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * 128) return;
    out[i] = __fmul_rn(e4m3_to_f32(values[i]), scales[i / 128]);
}

// dot8 of f32 `a` and the e4m3 codes `b` (decoded), the host's dot8(q, k).
__device__ float v4_dot8_e4m3(const float* a, const u8* b, int n) {
    float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int k = 0;
    for (; k + 8 <= n; k += 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
            l[j] = __fadd_rn(l[j], __fmul_rn(a[k + j], e4m3_to_f32(b[k + j])));
    }
    for (int j = 0; k + j < n; ++j) l[j] = __fadd_rn(l[j], __fmul_rn(a[k + j], e4m3_to_f32(b[k + j])));
    return __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[1]), __fadd_rn(l[2], l[3])),
                     __fadd_rn(__fadd_rn(l[4], l[5]), __fadd_rn(l[6], l[7])));
}

// Indexer scores of token t over entries w < nvis[t]: sum_h iw[t][h] x relu(dot8(q[t][h],
// k_w)) x scale_w, the key's 128 e4m3 codes at pool + voff[w] and its f32 scale word at
// pool + soff[w] (offsets checked on the host). One thread per (t, w).
extern "C" __global__ void v4_index_scores(float* scores, int max_ctx, const int* nvis,
                                           const float* q, const float* iw, int ih,
                                           const u8* pool, const i64* voff, const i64* soff,
                                           int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * max_ctx) return;
    int t = (int)(i / max_ctx), w = (int)(i % max_ctx);
    if (w >= nvis[t]) return;
    const u8* kb = pool + voff[w];
    float scale = *(const float*)(pool + soff[w]);
    float s = 0.0f;
    for (int h = 0; h < ih; h++) {
        float d = v4_dot8_e4m3(q + ((long)t * ih + h) * 128, kb, 128);
        s = __fadd_rn(s, __fmul_rn(iw[(long)t * ih + h], relu_f(d)));
    }
    scores[i] = __fmul_rn(s, scale);
}

// Attention of token t, head h, with a sink, over the rows the sparse decode is handed:
// the window rows gw[(wb[t] + k) x 512] for k < nw[t] (the query's window, gathered once
// for the request), then the compressed entries ge[(t x es + k) x 512] for k < ne[t] (the
// rows at the token's extra_indices, gathered per token; ne null: none). All rows f32 as
// model1_gather decodes them. s_k = dot8(q, row_k) x scale, m = max(sink, s_k) by strict
// comparison in row order, e_k = exp(s_k - m), sum = exp(sink - m) + e_0 + e_1 + ...,
// out[c] = sum_k (e_k / sum) x row_k[c] in row order. One block per (t, h); `ebuf` holds
// max_rows floats per (t, h).
extern "C" __global__ void v4_attend(float* out, const float* q, int heads, const float* gw,
                                     const int* wb, const int* nw, const float* ge,
                                     const int* ne, int es, float scale, const float* sink,
                                     float* ebuf, int max_rows, int n) {
    int t = blockIdx.x / heads, h = blockIdx.x % heads;
    if (t >= n) return;
    // A length past the token's rows (a guard failure upstream) reads no row past them.
    int nwin = nw[t], nent = ne ? min(ne[t], es) : 0;
    int nr = nwin + nent;
    float* e = ebuf + ((long)t * heads + h) * max_rows;
    const float* qh = q + ((long)t * heads + h) * 512;
    for (int k = threadIdx.x; k < nr; k += blockDim.x) {
        const float* r = k < nwin ? gw + (long)(wb[t] + k) * 512
                                  : ge + ((long)t * es + (k - nwin)) * 512;
        e[k] = __fmul_rn(v4_dot8(qh, r, 512), scale);
    }
    __syncthreads();
    __shared__ float total;
    if (threadIdx.x == 0) {
        float m = sink[h];
        for (int k = 0; k < nr; k++)
            if (e[k] > m) m = e[k];
        float sum = model_exp(__fsub_rn(sink[h], m));
        for (int k = 0; k < nr; k++) {
            float v = model_exp(__fsub_rn(e[k], m));
            e[k] = v;
            sum = __fadd_rn(sum, v);
        }
        total = sum;
    }
    __syncthreads();
    float sum = total;
    for (int c = threadIdx.x; c < 512; c += blockDim.x) {
        float o = 0.0f;
        for (int k = 0; k < nr; k++) {
            const float* r = k < nwin ? gw + (long)(wb[t] + k) * 512
                                      : ge + ((long)t * es + (k - nwin)) * 512;
            o = __fadd_rn(o, __fmul_rn(__fdiv_rn(e[k], sum), r[c]));
        }
        out[((long)t * heads + h) * 512 + c] = o;
    }
}
