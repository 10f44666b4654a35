// Fail-closed guards for the scatter kernels (host references: the bounds checks of
// src/ops/indexer_k.rs and src/ops/mla.rs, which refuse a whole batch before writing).
//
// A step owns one 64-bit fail flag, all ones when nothing failed. Before each guarded
// scatter, a guard kernel checks every mapping of that op and atomicMin's
// (op << 32) | (token << 1) | which into the flag for each one whose bytes would fall
// outside the cache (which: 0 = value / data row, 1 = scale word / scale row, the order
// in which the host checks a token). Ops are numbered in launch order, so the flag ends
// as the first failing token of the first failing op: the token the host reference
// names. Every guarded scatter does nothing once the flag is set, so the failing op and
// every op after it write nothing, exactly like the host, which returns at its first
// error. The host reads the flag back with the step.

#define FAIL_NONE 0xffffffffffffffffull

__device__ __forceinline__ bool step_failed(const u64* flag) { return flag != nullptr && *flag != FAIL_NONE; }

__device__ __forceinline__ void mark_failed(u64* flag, u32 op, int token, u32 which) {
    atomicMin(flag, ((u64)op << 32) | ((u64)(u32)token << 1) | (u64)which);
}

// Byte-offset mappings (indexer payloads and scale words): map[t] + bytes must fit.
extern "C" __global__ void guard_offsets(const i64* __restrict__ map, int n, u32 bytes, u64 cache_len, u32 op,
                                         u32 which, u64* flag) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    i64 off = map[t];
    if (off >= 0 && (u64)off + (u64)bytes > cache_len) mark_failed(flag, op, t, which);
}

// Token-slot mappings through a strided row view (MLA rows): the row must fit.
extern "C" __global__ void guard_rows(const i64* __restrict__ slots, int n, u64 base, u64 block_stride, u32 tpb,
                                      u32 row_bytes, u64 pool_len, u32 op, u32 which, u64* flag) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    i64 s = slots[t];
    if (s >= 0 && row_offset(s, base, block_stride, tpb, row_bytes) + row_bytes > pool_len)
        mark_failed(flag, op, t, which);
}
