// Indexer K cache scatter and gather (host reference: src/ops/indexer_k.rs). The cache is
// one layer's view; mappings are 64-bit byte offsets (negative: skip). Each token's
// payload moves in 16-byte vectors: width/16 lanes per token, several tokens per warp.
// A mapping whose bytes would fall outside the cache (cache_len) is skipped like a
// negative one; the host reference rejects such a batch before writing anything.

extern "C" __global__ void indexer_k_scatter(u8* __restrict__ cache, const u8* __restrict__ values,
                                             const u8* __restrict__ scales, const i64* __restrict__ vmap,
                                             const i64* __restrict__ smap, int n, int width, u64 cache_len) {
    int lanes = width >> 4;  // 8 (FP8) or 4 (FP4)
    long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long t = gid / lanes;
    int l = (int)(gid % lanes);
    if (t >= n) return;
    i64 vo = vmap[t];
    if (vo >= 0 && (u64)vo + (u64)width <= cache_len) {
        const uint4* src = reinterpret_cast<const uint4*>(values + (u64)t * width) + l;
        *(reinterpret_cast<uint4*>(cache + vo) + l) = *src;
    }
    if (l == 0) {
        i64 so = smap[t];
        if (so >= 0 && (u64)so + 4u <= cache_len) *reinterpret_cast<u32*>(cache + so) = *reinterpret_cast<const u32*>(scales + (u64)t * 4);
    }
}

// Reads tokens [start, start + n) of the mappings into contiguous values / scales.
extern "C" __global__ void indexer_k_gather(const u8* __restrict__ cache, const i64* __restrict__ vmap,
                                            const i64* __restrict__ smap, long long start, int n, int width,
                                            u64 cache_len, u8* __restrict__ values, u8* __restrict__ scales) {
    int lanes = width >> 4;
    long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long t = gid / lanes;
    int l = (int)(gid % lanes);
    if (t >= n) return;
    i64 vo = vmap[start + t];
    uint4 v;
    v.x = v.y = v.z = v.w = 0u;
    if (vo >= 0 && (u64)vo + (u64)width <= cache_len) v = *(reinterpret_cast<const uint4*>(cache + vo) + l);
    *(reinterpret_cast<uint4*>(values + (u64)t * width) + l) = v;
    if (l == 0) {
        i64 so = smap[start + t];
        *reinterpret_cast<u32*>(scales + (u64)t * 4) = (so >= 0 && (u64)so + 4u <= cache_len) ? *reinterpret_cast<const u32*>(cache + so) : 0u;
    }
}
