// Batched block copy (host reference: src/ops/block_copy.rs). Task i moves `bytes` bytes
// (a multiple of 16) from src[i] to dst[i]; any pointer may be device memory, a peer
// GPU's memory or mapped pinned host memory. grid = (chunks per task, tasks): several
// CTAs share a large task, 16-byte vectors, a grid-stride loop inside the chunk.
extern "C" __global__ void batched_copy(const u64* __restrict__ dst, const u64* __restrict__ src,
                                        long long bytes, int chunks) {
    int task = blockIdx.y;
    uint4* d = reinterpret_cast<uint4*>(dst[task]);
    const uint4* s = reinterpret_cast<const uint4*>(src[task]);
    long long vecs = bytes >> 4;
    long long per = (vecs + chunks - 1) / chunks;
    long long begin = per * blockIdx.x;
    long long end = begin + per < vecs ? begin + per : vecs;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) d[i] = s[i];
}
