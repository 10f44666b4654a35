// MLA latent-row writes (host reference: src/ops/mla.rs). Rows are addressed by token
// slot through a strided view: base + (slot / T) * block_stride + (slot % T) * row_bytes.
// One warp per token. `rows` holds 576 BF16 values per token. A row that would end past
// the pool (pool_len) is never written; with a fail flag (guard.cu) the whole batch is
// refused once the guard kernel found such a row, like the host reference does.

// This warp's destination row in a strided view, or nullptr when the token is skipped
// (negative slot, or a row that would end past the pool).
__device__ __forceinline__ u8* token_row(u8* pool, i64 slot, u64 base, u64 block_stride, u32 tpb, u64 pool_len,
                                         u32 row_bytes) {
    if (slot < 0) return nullptr;
    u64 off = row_offset(slot, base, block_stride, tpb, row_bytes);
    return off + row_bytes > pool_len ? nullptr : pool + off;
}

// BF16 rows: a plain 1152-byte move (72 x 16 B).
extern "C" __global__ void mla_scatter_bf16(u8* __restrict__ pool, const u16* __restrict__ rows,
                                            const i64* __restrict__ slots, int n, u64 base, u64 block_stride,
                                            u32 tpb, u64 pool_len, const u64* __restrict__ fail) {
    if (step_failed(fail)) return;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    u8* row = token_row(pool, slots[warp], base, block_stride, tpb, pool_len, 1152);
    if (!row) return;
    uint4* dst = reinterpret_cast<uint4*>(row);
    const uint4* src = reinterpret_cast<const uint4*>(rows + (u64)warp * 576);
    for (int i = lane; i < 72; i += 32) dst[i] = src[i];
}

// FP8 rows with a per-tensor scale kept outside the cache: e4m3(x / tensor_scale).
extern "C" __global__ void mla_scatter_fp8(u8* __restrict__ pool, const u16* __restrict__ rows,
                                           const i64* __restrict__ slots, int n, u64 base, u64 block_stride,
                                           u32 tpb, u64 pool_len, float tensor_scale,
                                           const u64* __restrict__ fail) {
    if (step_failed(fail)) return;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    u8* dst = token_row(pool, slots[warp], base, block_stride, tpb, pool_len, 576);
    if (!dst) return;
    const u16* src = rows + (u64)warp * 576;
    // 144 groups of 4 values, 4-byte stores.
    for (int g = lane; g < 144; g += 32) {
        u64 raw = *reinterpret_cast<const u64*>(src + g * 4);
        float y[4];
        for (int i = 0; i < 4; ++i) y[i] = bf16_to_f32((u16)(raw >> (16 * i))) / tensor_scale;
        *reinterpret_cast<u32*>(dst + g * 4) = e4m3x4(y[0], y[1], y[2], y[3]);
    }
}

// fp8_ds_mla: 656-byte rows. Lanes 8t..8t+7 own tile t (16 nope values each); tile
// scale max(amax, 1e-4) / 448 (power of two when ue8m0) at bytes 512 + 4t; the 64 BF16
// rope values copied to bytes 528..656.
extern "C" __global__ void mla_scatter_fp8_ds_mla(u8* __restrict__ pool, const u16* __restrict__ rows,
                                                  const i64* __restrict__ slots, int n, u64 base,
                                                  u64 block_stride, u32 tpb, u64 pool_len, int ue8m0,
                                                  const u64* __restrict__ fail) {
    if (step_failed(fail)) return;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    u8* dst = token_row(pool, slots[warp], base, block_stride, tpb, pool_len, 656);
    if (!dst) return;
    const u16* src = rows + (u64)warp * 576;
    float x[16];
    float amax = 0.0f;
    const uint4* sv = reinterpret_cast<const uint4*>(src + lane * 16);
    uint4 r0 = sv[0], r1 = sv[1];
    u32 words[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
    for (int i = 0; i < 16; ++i) {
        x[i] = bf16_to_f32((u16)(words[i >> 1] >> (16 * (i & 1))));
        amax = fmaxf(amax, fabsf(x[i]));
    }
    amax = warp_max(amax, 8u);
    float scale = block_scale(amax, FP8_MAX, ue8m0);
    uint4 out;
    u32* w = reinterpret_cast<u32*>(&out);
    if (ue8m0) {
        float inv = __frcp_rn(scale);
        for (int q = 0; q < 4; ++q)
            w[q] = e4m3x4(div_pow2(x[q * 4], inv), div_pow2(x[q * 4 + 1], inv), div_pow2(x[q * 4 + 2], inv),
                          div_pow2(x[q * 4 + 3], inv));
    } else {
        for (int q = 0; q < 4; ++q)
            w[q] = e4m3x4(x[q * 4] / scale, x[q * 4 + 1] / scale, x[q * 4 + 2] / scale, x[q * 4 + 3] / scale);
    }
    *reinterpret_cast<uint4*>(dst + lane * 16) = out;
    if ((lane & 7) == 0) *reinterpret_cast<float*>(dst + 512 + (lane >> 3) * 4) = scale;
    // Rope: 128 bytes = 32 lanes x 4 bytes.
    *reinterpret_cast<u32*>(dst + 528 + lane * 4) = *reinterpret_cast<const u32*>(src + 512 + lane * 2);
}

// NVFP4 rows: 36 blocks of 16 values; block scale code e4m3(max(amax, 1e-4) / 6), codes
// e2m1(x / decode(scale)) two per byte -> 288-byte data row; scale codes -> 36-byte row
// of the block-scale buffer (same token slot, its own view).
extern "C" __global__ void mla_scatter_nvfp4(u8* __restrict__ data_pool, u8* __restrict__ scale_pool,
                                             const u16* __restrict__ rows, const i64* __restrict__ slots, int n,
                                             u64 data_base, u64 data_stride, u64 scale_base, u64 scale_stride,
                                             u32 tpb, u64 data_len, u64 scale_len,
                                             const u64* __restrict__ fail) {
    if (step_failed(fail)) return;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    i64 s = slots[warp];
    u8* dd = token_row(data_pool, s, data_base, data_stride, tpb, data_len, 288);
    u8* sd = token_row(scale_pool, s, scale_base, scale_stride, tpb, scale_len, 36);
    if (!dd || !sd) return;
    const u16* src = rows + (u64)warp * 576;
    for (int b = lane; b < 36; b += 32) {
        float x[16];
        float amax = 0.0f;
        for (int i = 0; i < 16; ++i) {
            x[i] = bf16_to_f32(src[b * 16 + i]);
            amax = fmaxf(amax, fabsf(x[i]));
        }
        u8 code = (u8)(e4m3x4(block_scale(amax, FP4_MAX, 0), 0.0f, 0.0f, 0.0f) & 0xffu);
        float sc = e4m3_to_f32(code);
        sd[b] = code;
        for (int i = 0; i < 8; ++i) dd[b * 8 + i] = f32_to_e2m1(x[2 * i] / sc) | (u8)(f32_to_e2m1(x[2 * i + 1] / sc) << 4);
    }
}
