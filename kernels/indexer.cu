// Indexer K cache scatter and gather (host reference: src/ops/indexer_k.rs). The cache is
// one layer's view; mappings are 64-bit byte offsets (negative: skip). A token's payload
// is width/16 16-byte vectors (8 for FP8, 4 for FP4); thread v moves vector v of the
// flattened [tokens x vectors] payload (and lane 0 of a token its scale word). A thread
// handles up to VEC_PER_THREAD vectors a grid apart and issues every load before any
// store (more bytes in flight); the host picks the grid, so small batches run one vector
// per thread for more parallelism.
// A mapping whose bytes would fall outside the cache (cache_len) is never written. With a
// fail flag (guard.cu), the guard kernel launched before the scatter has checked every
// mapping and the scatter writes nothing once the flag is set: the batch is refused
// whole, like the host reference does.
// The host wrapper guarantees n * width / 16 < 2^31.

#define VEC_PER_THREAD 2

extern "C" __global__ void indexer_k_scatter(u8* __restrict__ cache, const u8* __restrict__ values,
                                             const u8* __restrict__ scales, const i64* __restrict__ vmap,
                                             const i64* __restrict__ smap, int n, int width, u64 cache_len,
                                             const u64* __restrict__ fail) {
    if (step_failed(fail)) return;
    const u32 shift = width == 128 ? 3u : 2u;
    const u32 mask = (1u << shift) - 1u;
    const u32 total = (u32)n << shift;
    const u32 stride = gridDim.x * blockDim.x;
    const u32 first = blockIdx.x * blockDim.x + threadIdx.x;
    uint4 val[VEC_PER_THREAD];
    i64 off[VEC_PER_THREAD], soff[VEC_PER_THREAD];
    u32 sw[VEC_PER_THREAD];
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        off[k] = -1;
        soff[k] = -1;
        if (v < total) {
            u32 t = v >> shift;
            off[k] = vmap[t];
            val[k] = reinterpret_cast<const uint4*>(values)[v];
            if ((v & mask) == 0u) {
                soff[k] = smap[t];
                sw[k] = reinterpret_cast<const u32*>(scales)[t];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        if (off[k] >= 0 && (u64)off[k] + (u64)width <= cache_len)
            *(reinterpret_cast<uint4*>(cache + off[k]) + (v & mask)) = val[k];
        if (soff[k] >= 0 && (u64)soff[k] + 4u <= cache_len) *reinterpret_cast<u32*>(cache + soff[k]) = sw[k];
    }
}

// Reads tokens [start, start + n) of the mappings into contiguous values / scales.
extern "C" __global__ void indexer_k_gather(const u8* __restrict__ cache, const i64* __restrict__ vmap,
                                            const i64* __restrict__ smap, long long start, int n, int width,
                                            u64 cache_len, u8* __restrict__ values, u8* __restrict__ scales) {
    const u32 shift = width == 128 ? 3u : 2u;
    const u32 mask = (1u << shift) - 1u;
    const u32 total = (u32)n << shift;
    const u32 stride = gridDim.x * blockDim.x;
    const u32 first = blockIdx.x * blockDim.x + threadIdx.x;
    i64 vo[VEC_PER_THREAD], so[VEC_PER_THREAD];
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        vo[k] = -1;
        so[k] = -1;
        if (v < total) {
            vo[k] = vmap[start + (v >> shift)];
            if ((v & mask) == 0u) so[k] = smap[start + (v >> shift)];
        }
    }
    uint4 val[VEC_PER_THREAD];
    u32 sw[VEC_PER_THREAD];
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        val[k].x = val[k].y = val[k].z = val[k].w = 0u;
        sw[k] = 0u;
        if (vo[k] >= 0 && (u64)vo[k] + (u64)width <= cache_len)
            val[k] = *(reinterpret_cast<const uint4*>(cache + vo[k]) + (v & mask));
        if (so[k] >= 0 && (u64)so[k] + 4u <= cache_len) sw[k] = *reinterpret_cast<const u32*>(cache + so[k]);
    }
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        if (v >= total) continue;
        reinterpret_cast<uint4*>(values)[v] = val[k];
        if ((v & mask) == 0u) reinterpret_cast<u32*>(scales)[v >> shift] = sw[k];
    }
}
