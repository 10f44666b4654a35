// Indexer K cache scatter and gather (host reference: src/ops/indexer_k.rs). The cache is
// one layer's view; mappings are 64-bit byte offsets (negative: skip). A token's payload
// is width/16 16-byte vectors (8 for FP8, 4 for FP4); thread v moves vector v of the
// flattened [tokens x vectors] payload, and each thread handles VEC_PER_THREAD vectors a
// grid apart, loading all of them before storing any (more bytes in flight per thread).
// A mapping whose bytes would fall outside the cache (cache_len) is skipped like a
// negative one; the host reference rejects such a batch before writing anything.
// The host wrapper guarantees n * width / 16 < 2^31.

#define VEC_PER_THREAD 2

extern "C" __global__ void indexer_k_scatter(u8* __restrict__ cache, const u8* __restrict__ values,
                                             const u8* __restrict__ scales, const i64* __restrict__ vmap,
                                             const i64* __restrict__ smap, int n, int width, u64 cache_len) {
    const u32 shift = width == 128 ? 3u : 2u;
    const u32 mask = (1u << shift) - 1u;
    const u32 total = (u32)n << shift;
    const u32 stride = gridDim.x * blockDim.x;
    const u32 first = blockIdx.x * blockDim.x + threadIdx.x;
    uint4 val[VEC_PER_THREAD];
    i64 off[VEC_PER_THREAD];
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        off[k] = -1;
        if (v < total) {
            off[k] = vmap[v >> shift];
            val[k] = reinterpret_cast<const uint4*>(values)[v];
        }
    }
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        if (v >= total) continue;
        u32 l = v & mask;
        if (off[k] >= 0 && (u64)off[k] + (u64)width <= cache_len)
            *(reinterpret_cast<uint4*>(cache + off[k]) + l) = val[k];
        if (l == 0u) {
            u32 t = v >> shift;
            i64 so = smap[t];
            if (so >= 0 && (u64)so + 4u <= cache_len)
                *reinterpret_cast<u32*>(cache + so) = reinterpret_cast<const u32*>(scales)[t];
        }
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
    uint4 val[VEC_PER_THREAD];
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        val[k].x = val[k].y = val[k].z = val[k].w = 0u;
        if (v < total) {
            i64 vo = vmap[start + (v >> shift)];
            if (vo >= 0 && (u64)vo + (u64)width <= cache_len)
                val[k] = *(reinterpret_cast<const uint4*>(cache + vo) + (v & mask));
        }
    }
#pragma unroll
    for (int k = 0; k < VEC_PER_THREAD; ++k) {
        u32 v = first + k * stride;
        if (v >= total) continue;
        reinterpret_cast<uint4*>(values)[v] = val[k];
        if ((v & mask) == 0u) {
            u32 t = v >> shift;
            i64 so = smap[start + t];
            reinterpret_cast<u32*>(scales)[t] =
                (so >= 0 && (u64)so + 4u <= cache_len) ? *reinterpret_cast<const u32*>(cache + so) : 0u;
        }
    }
}
