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

// fp8_ds_mla: 656-byte rows: 512 E4M3 codes in four tiles of 128 values, the four f32 tile
// scales max(amax, 1e-4) / 448 (a power of two when ue8m0) at bytes 512 + 4t, the 64 BF16
// rope values copied to bytes 528..656.
//
// One warp per token. Lane l owns the 16-byte nope chunks l and l + 32 (8 values each), so
// each load instruction reads 512 contiguous bytes; chunk l lies in tile l / 16 and chunk
// l + 32 in tile 2 + l / 16, so each half-warp reduces the amaxes of two tiles at once, as
// one BF16 pair (4 shuffles). Lanes 0..7 move the rope as 16-byte vectors. Every load (fail
// flag, slot, row) is issued before anything waits for one; the slot's address math and
// the quantization then overlap the row's latency. This is what brought the kernel from
// ~80 % to ~97 % of the memcpy ceiling on H200 (BENCHMARKS.md).
template <bool UE8M0>
__device__ __forceinline__ void fp8_ds_mla_row(u8* __restrict__ pool, const u16* __restrict__ rows,
                                               const i64* __restrict__ slots, int token, u64 base,
                                               u64 block_stride, u32 tpb, u64 pool_len,
                                               const u64* __restrict__ fail) {
    const int lane = threadIdx.x & 31;
    u64 flag = FAIL_NONE;
    if (fail != nullptr) flag = load_once8(fail);
    i64 slot = (i64)load_once8(slots + token);
    const u16* src = rows + (u64)token * 576;
    uint4 lo = load_once16(src + lane * 8), hi = load_once16(src + 256 + lane * 8);
    uint4 rope = make_uint4(0u, 0u, 0u, 0u);
    if (lane < 8) rope = load_once16(src + 512 + lane * 8);
    u8* dst = token_row(pool, slot, base, block_stride, tpb, pool_len, 656);
    if (dst == nullptr || flag != FAIL_NONE) return;

    // (tile of lo, tile of hi) amaxes, reduced over the half-warp that shares both tiles.
    u32 mlo = bf16x8_absmax(lo), mhi = bf16x8_absmax(hi);
    u32 amax = bf16x2_max(__byte_perm(mlo, mhi, 0x5410), __byte_perm(mlo, mhi, 0x7632));
    for (int o = 8; o > 0; o >>= 1) amax = bf16x2_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float amax_lo = bf16_to_f32((u16)amax), amax_hi = bf16_to_f32((u16)(amax >> 16));
    float scale_lo, scale_hi, inv_lo = 0.0f, inv_hi = 0.0f;
    if (UE8M0) {
        scale_lo = ue8m0_scale_fp8(amax_lo);
        scale_hi = ue8m0_scale_fp8(amax_hi);
        inv_lo = pow2_recip(scale_lo);
        inv_hi = pow2_recip(scale_hi);
    } else {
        scale_lo = block_scale(amax_lo, FP8_MAX, 0);
        scale_hi = block_scale(amax_hi, FP8_MAX, 0);
    }
    uint4 chunks[2] = {lo, hi};
    float scales[2] = {scale_lo, scale_hi}, invs[2] = {inv_lo, inv_hi};
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const u32 w[4] = {chunks[c].x, chunks[c].y, chunks[c].z, chunks[c].w};
        float y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float x = bf16_to_f32((u16)(w[i >> 1] >> (16 * (i & 1))));
            y[i] = UE8M0 ? div_pow2(x, invs[c]) : x / scales[c];
        }
        *reinterpret_cast<uint2*>(dst + c * 256 + lane * 8) =
            make_uint2(e4m3x4(y[0], y[1], y[2], y[3]), e4m3x4(y[4], y[5], y[6], y[7]));
    }
    if ((lane & 15) == 0) {
        *reinterpret_cast<float*>(dst + 512 + 4 * (lane >> 4)) = scale_lo;
        *reinterpret_cast<float*>(dst + 520 + 4 * (lane >> 4)) = scale_hi;
    }
    if (lane < 8) *reinterpret_cast<uint4*>(dst + 528 + lane * 16) = rope;
}

extern "C" __global__ void mla_scatter_fp8_ds_mla(u8* __restrict__ pool, const u16* __restrict__ rows,
                                                  const i64* __restrict__ slots, int n, u64 base,
                                                  u64 block_stride, u32 tpb, u64 pool_len, int ue8m0,
                                                  const u64* __restrict__ fail) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (warp >= n) return;
    if (ue8m0)
        fp8_ds_mla_row<true>(pool, rows, slots, warp, base, block_stride, tpb, pool_len, fail);
    else
        fp8_ds_mla_row<false>(pool, rows, slots, warp, base, block_stride, tpb, pool_len, fail);
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
