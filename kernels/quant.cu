// Indexer key quantization (host reference: quantize_fp8_token / quantize_fp4_token in
// src/ops/quant.rs). 128 BF16 values per token. FP8: sixteen lanes per token, a warp
// takes four tokens (below); FP4: one warp per token, each lane owns 4 values.

// Lane `lane`'s four values of token `t` (128 BF16 values per token) as floats; returns
// their largest magnitude.
__device__ __forceinline__ float load_key4(const u16* keys, int t, int lane, float x[4]) {
    u64 raw = *reinterpret_cast<const u64*>(keys + (u64)t * 128 + lane * 4);
    float amax = 0.0f;
    for (int i = 0; i < 4; ++i) {
        x[i] = bf16_to_f32((u16)(raw >> (16 * i)));
        amax = fmaxf(amax, fabsf(x[i]));
    }
    return amax;
}

// FP8: per-token scale max(amax, 1e-4) / 448 (a power of two when ue8m0), values
// e4m3(x / scale) -> values[t * 128 ..], f32 scale word -> scales[t * 4 ..].
//
// Sixteen lanes per token, each with one 16-byte chunk (8 values): half-warp h of warp w
// takes tokens 2 * FP8_PAIRS * w + 2k + h, k < FP8_PAIRS, so each load instruction reads
// 512 contiguous bytes and every load is issued before any is used (FP8_PAIRS x 512
// bytes in flight per warp; one token of 256 bytes per warp, 8 bytes per lane, reached
// only ~63 % of the memcpy ceiling on H200). The amaxes of a lane's loads k and k + 1
// reduce together as one BF16 pair (`max.bf16x2`, NaN-ignoring like the reference's f32
// fold, exact since BF16 -> f32 is; an all-NaN token gives NaN, which the 1e-4 floor
// turns into 1e-4 as the reference's 0), 4 shuffles within the half-warp; each lane stores
// its 8 codes as one 8-byte word (256 contiguous bytes per store instruction). Lanes of
// tokens past n load zeros, take part in the shuffles and store nothing. FP8_PAIRS is
// even; the host launches ceil(n / (2 * FP8_PAIRS)) warps (QUANT_FP8_TOKENS_PER_WARP in
// kernels.rs).
#define FP8_PAIRS 2

template <bool UE8M0>
__device__ __forceinline__ void quantize_fp8_pairs(const u16* __restrict__ keys, u8* __restrict__ values,
                                                   u8* __restrict__ scales, int n, u64 warp) {
    const int lane = threadIdx.x & 31;
    const int part = lane & 15;
    const u64 first = warp * (2 * FP8_PAIRS) + (lane >> 4);
    uint4 v[FP8_PAIRS];
#pragma unroll
    for (int k = 0; k < FP8_PAIRS; ++k) {
        const u64 t = first + 2 * k;
        v[k] = make_uint4(0u, 0u, 0u, 0u);
        if (t < (u64)n) v[k] = load_once16(keys + t * 128 + part * 8);
    }
    float amax[FP8_PAIRS];
#pragma unroll
    for (int k = 0; k < FP8_PAIRS; k += 2) {
        const u32 a = bf16x8_absmax(v[k]), b = bf16x8_absmax(v[k + 1]);
        u32 m = bf16x2_max(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632));
        for (int o = 8; o > 0; o >>= 1) m = bf16x2_max(m, __shfl_xor_sync(0xffffffffu, m, o));
        amax[k] = bf16_to_f32((u16)m);
        amax[k + 1] = bf16_to_f32((u16)(m >> 16));
    }
#pragma unroll
    for (int k = 0; k < FP8_PAIRS; ++k) {
        const u64 t = first + 2 * k;
        const float scale = block_scale(amax[k], FP8_MAX, UE8M0 ? 1 : 0);
        const float inv = UE8M0 ? __frcp_rn(scale) : 0.0f;
        const u32 w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
        float y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float x = bf16_to_f32((u16)(w[i >> 1] >> (16 * (i & 1))));
            y[i] = UE8M0 ? div_pow2(x, inv) : x / scale;
        }
        if (t < (u64)n) {
            *reinterpret_cast<uint2*>(values + t * 128 + part * 8) =
                make_uint2(e4m3x4(y[0], y[1], y[2], y[3]), e4m3x4(y[4], y[5], y[6], y[7]));
            if (part == 0) *reinterpret_cast<float*>(scales + t * 4) = scale;
        }
    }
}

extern "C" __global__ void quantize_indexer_fp8(const u16* __restrict__ keys, u8* __restrict__ values,
                                                u8* __restrict__ scales, int n, int ue8m0) {
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (warp * (2 * FP8_PAIRS) >= (u64)n) return;
    if (ue8m0)
        quantize_fp8_pairs<true>(keys, values, scales, n, warp);
    else
        quantize_fp8_pairs<false>(keys, values, scales, n, warp);
}

// FP4: per 32-element block scale 2^ceil(log2(max(amax, 1e-4) / 6)), codes
// e2m1(x / scale) two per byte (even element low) -> values[t * 64 ..], the four UE8M0
// exponents -> scales[t * 4 ..].
extern "C" __global__ void quantize_indexer_fp4(const u16* __restrict__ keys, u8* __restrict__ values,
                                                u8* __restrict__ scales, int n) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    float x[4];
    float amax = load_key4(keys, warp, lane, x);
    amax = warp_max(amax, 8u);  // 8 lanes = one 32-element block
    float scale = block_scale(amax, FP4_MAX, 1);
    float inv = __frcp_rn(scale);
    u8 lo = f32_to_e2m1(div_pow2(x[0], inv)) | (u8)(f32_to_e2m1(div_pow2(x[1], inv)) << 4);
    u8 hi = f32_to_e2m1(div_pow2(x[2], inv)) | (u8)(f32_to_e2m1(div_pow2(x[3], inv)) << 4);
    *reinterpret_cast<u16*>(values + (u64)warp * 64 + lane * 2) = (u16)lo | ((u16)hi << 8);
    if ((lane & 7) == 0) {
        u32 e = (__float_as_uint(scale) >> 23) & 0xffu;
        scales[(u64)warp * 4 + (lane >> 3)] = (u8)(e > 254u ? 254u : e);
    }
}
