// Indexer key quantization (host reference: quantize_fp8_token / quantize_fp4_token in
// src/ops/quant.rs). One warp per token of 128 BF16 values; each lane owns 4 values.

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
extern "C" __global__ void quantize_indexer_fp8(const u16* __restrict__ keys, u8* __restrict__ values,
                                                u8* __restrict__ scales, int n, int ue8m0) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    float x[4];
    float amax = load_key4(keys, warp, lane, x);
    amax = warp_max(amax, 32u);
    float scale = block_scale(amax, FP8_MAX, ue8m0);
    float y[4];
    if (ue8m0) {
        float inv = __frcp_rn(scale);
        for (int i = 0; i < 4; ++i) y[i] = div_pow2(x[i], inv);
    } else {
        for (int i = 0; i < 4; ++i) y[i] = x[i] / scale;
    }
    u32 packed = e4m3x4(y[0], y[1], y[2], y[3]);
    *reinterpret_cast<u32*>(values + (u64)warp * 128 + lane * 4) = packed;
    if (lane == 0) *reinterpret_cast<float*>(scales + (u64)warp * 4) = scale;
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
