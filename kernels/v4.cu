// DeepSeek-V4 cache writes and reads. Host references: quantize_model1_row and
// dequantize_model1_row (crates/dsa-kv-core/src/ops/model1.rs), the page geometry
// Model1PageLayout (crates/dsa-kv-core/src/layout/bytes.rs), and their host twins over
// whole pools in crates/dsa-kv-cuda/src/v4.rs. Compiled after common.cuh and guard.cu as a
// module of its own (crates/dsa-kv-cuda/src/v4.rs loads it).
//
// Rows are addressed by kernel row index r = page * E + i (E rows per page; a negative
// index is skipped: the compressed caches' slot mappings hold -1 between group ends). A
// MODEL1 page holds its E rows' 576 data bytes first (row i at 576 i: 448 E4M3 NoPE
// values, then 64 BF16 RoPE values), then their 8 scale bytes (at 576 E + 8 i: 7 UE8M0
// exponents, one per 64 NoPE values, and a zero pad byte), padded to page_bytes (a
// multiple of 576). max_page = pool_len / page_bytes, computed on the host, bounds the
// page before any product is formed, so no index, however large, wraps around.
//
// Fail closed: a row whose data or scale bytes would end past pool_len is never written
// or read. With a fail flag (guard.cu), a guard kernel launched first has checked every
// index, and the kernel does nothing once the flag is set.

#define M1_DATA 576u
#define M1_SCALES 8u
#define M1_NOPE 448u
#define M1_VALUES 512u

// Where row r lies: 0 in the pool (byte offsets of its data and scale rows in *data,
// *scale), -1 skipped (negative index), 1 its data row ends past the pool, 2 only its
// scale row does (the guard's `which` is the result minus 1).
__device__ __forceinline__ int model1_place(i64 r, u32 entries, u64 page_bytes, u64 max_page, u64 pool_len,
                                            u64* data, u64* scale) {
    if (r < 0) return -1;
    u64 row = (u64)r, page;
    u32 i;
    if ((entries & (entries - 1u)) == 0u) {
        page = row >> (__ffs(entries) - 1);
        i = (u32)row & (entries - 1u);
    } else {
        page = row / entries;
        i = (u32)(row - page * entries);
    }
    if (page > max_page) return 1;
    u64 base = page * page_bytes;
    *data = base + (u64)i * M1_DATA;
    *scale = base + (u64)entries * M1_DATA + (u64)i * M1_SCALES;
    if (*data + M1_DATA > pool_len) return 1;
    if (*scale + M1_SCALES > pool_len) return 2;
    return 0;
}

// Eight BF16 values (one 16-byte chunk) -> eight E4M3 bytes of x / scale, as x * (1 /
// scale) for the power-of-two scale (exact, see div_pow2).
__device__ __forceinline__ uint2 m1_quant8(uint4 c, float inv) {
    const u32 w[4] = {c.x, c.y, c.z, c.w};
    float y[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float x = bf16_to_f32((u16)(w[i >> 1] >> (16 * (i & 1))));
        y[i] = div_pow2(x, inv);
    }
    return make_uint2(e4m3x4(y[0], y[1], y[2], y[3]), e4m3x4(y[4], y[5], y[6], y[7]));
}

// The UE8M0 scale byte of a power-of-two scale: its biased exponent, inf -> 254 (the
// reference's ue8m0_byte clamps to 0..254; the amax floor keeps it >= 105).
__device__ __forceinline__ u32 m1_scale_byte(float scale) {
    u32 e = __float_as_uint(scale) >> 23;
    return e > 254u ? 254u : e;
}

// One row of model1_scatter (the whole warp; see there): data row at pool + d, scale row
// at pool + s.
__device__ __forceinline__ void m1_write_row(u8* __restrict__ pool, u64 d, u64 s, uint4 lo, uint4 hi, int lane) {
    u8* data = pool + d;
    // (tile of lo, tile of hi) amaxes, reduced over the 8 lanes that share both tiles.
    u32 mlo = bf16x8_absmax(lo), mhi = bf16x8_absmax(hi);
    u32 amax = bf16x2_max(__byte_perm(mlo, mhi, 0x5410), __byte_perm(mlo, mhi, 0x7632));
    for (int o = 4; o > 0; o >>= 1) amax = bf16x2_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale_lo = ue8m0_scale_fp8(bf16_to_f32((u16)amax));
    const float scale_hi = ue8m0_scale_fp8(bf16_to_f32((u16)(amax >> 16)));

    *reinterpret_cast<uint2*>(data + lane * 8) = m1_quant8(lo, pow2_recip(scale_lo));
    if (lane < 24)
        *reinterpret_cast<uint2*>(data + 256 + lane * 8) = m1_quant8(hi, pow2_recip(scale_hi));
    else
        *reinterpret_cast<uint4*>(data + M1_NOPE + (lane - 24) * 16) = hi;

    // Scale bytes: tile g (g < 4) from lane 8g's low tile, tile 4 + g (g < 3) from its high
    // tile.
    const u32 w = m1_scale_byte(scale_lo) | (m1_scale_byte(scale_hi) << 8);
    const u32 w8 = __shfl_sync(0xffffffffu, w, 8), w16 = __shfl_sync(0xffffffffu, w, 16),
              w24 = __shfl_sync(0xffffffffu, w, 24);
    if (lane == 0) {
        const u32 t0123 = (w & 0xffu) | ((w8 & 0xffu) << 8) | ((w16 & 0xffu) << 16) | ((w24 & 0xffu) << 24);
        const u32 t456 = (w >> 8) | ((w8 >> 8) << 8) | ((w16 >> 8) << 16);  // byte 7: the zero pad
        *reinterpret_cast<uint2*>(pool + s) = make_uint2(t0123, t456);
    }
}

// MODEL1 quantize-and-scatter: n rows of 512 BF16 values (448 NoPE, 64 RoPE) at `rows`,
// row t written at kernel row idx[t].
//
// One warp per two rows (2w and 2w + 1): both rows' loads are issued before either is
// written, 2 KiB in flight per warp (one row per warp ran at 87-88 % of the memcpy
// ceiling on H200, two at 95-97 %: benches/results/2026-12-03-h200-v4-kernels/). Per row
// (m1_write_row), lane l owns the 16-byte chunks l and l + 32 (8 values each), so each
// load instruction reads 512 contiguous bytes. Chunk l lies in tile l / 8 (tiles 0..3),
// chunk l + 32 in tile 4 + l / 8 (tiles 4..6, lanes 0..23) or is RoPE (lanes 24..31): each
// 8-lane group reduces the amaxes of its two tiles at once as one BF16 pair (3 shuffles;
// the RoPE group's second half is unused). Every load (fail flag, index, row) is issued
// before anything waits for one, as in mla.cu's fp8_ds_mla. The scale is
// ue8m0_scale_fp8 (common.cuh: 2^ceil(log2(max(amax, 1e-4) / 448)), proved equal to
// block_scale on every f32 by selfcheck_e4m3); lane 0 collects the seven scale bytes and
// writes the scale row (and its zero pad byte) as one 8-byte store.
extern "C" __global__ void model1_scatter(u8* __restrict__ pool, const u16* __restrict__ rows,
                                          const i64* __restrict__ idx, int n, u32 entries, u64 page_bytes,
                                          u64 max_page, u64 pool_len, const u64* __restrict__ fail) {
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const u64 first = warp * 2u;
    if (first >= (u64)n) return;
    u64 flag = FAIL_NONE;
    if (fail != nullptr) flag = load_once8(fail);
    i64 r[2];
    uint4 lo[2], hi[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const u64 t = first + k;
        r[k] = -1;
        lo[k] = hi[k] = make_uint4(0u, 0u, 0u, 0u);
        if (t < (u64)n) {
            r[k] = (i64)load_once8(idx + t);
            const u16* src = rows + t * M1_VALUES;
            lo[k] = load_once16(src + lane * 8);
            hi[k] = load_once16(src + 256 + lane * 8);
        }
    }
    if (flag != FAIL_NONE) return;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        u64 d = 0, s = 0;
        if (model1_place(r[k], entries, page_bytes, max_page, pool_len, &d, &s) != 0) continue;
        m1_write_row(pool, d, s, lo[k], hi[k], lane);
    }
}

// One E4M3 byte times a power-of-two scale, as the reference's e4m3_table[b] * scale: the
// code's magnitude bits shifted into an f32's exponent and mantissa fields are the value
// times 2^-120 (subnormal codes included), so one exact multiply by 2^120 gives the
// table's value and the second rounds like the reference's single multiply. A NaN code
// gives the reference's NaN bits (0x7FC00000: the table's NaN, which the host's multiply
// passes through), not the GPU's canonical NaN.
__device__ __forceinline__ float m1_decode(u32 b, float scale) {
    if ((b & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);
    const float x = __fmul_rn(__uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)), __uint_as_float(0x7b800000u));
    return __fmul_rn(x, scale);
}

// BF16 -> f32 as the reference's half::bf16::to_f32: exact, but a NaN gets its quiet bit
// set (a signaling NaN pattern 0x7F81 reads 0x7FC10000, not 0x7F810000).
__device__ __forceinline__ float m1_bf16_quiet(u32 b) {
    return __uint_as_float((b | ((b & 0x7fffu) > 0x7f80u ? 0x40u : 0u)) << 16);
}

// 2^(byte - 127) as f32, as the reference's exp2: byte 0 is the subnormal 2^-127, 255 is inf.
__device__ __forceinline__ float m1_scale_value(u32 byte) {
    return byte == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(byte << 23);
}

// MODEL1 gather: the rows at kernel row indices idx[0..n) (int32, the attention's index
// lists) decoded to f32 [n, 512] at out (448 dequantized NoPE values, then the 64 RoPE
// values, NaNs quieted as the reference's BF16 conversion does). A negative index gives a
// row of zeros; so does one past the pool, which the host check or the guard refuses
// before this runs. Once the fail flag is set, nothing is written.
//
// One warp per row: lane l decodes the NoPE words (4 codes) l, l + 32, l + 64 and, for
// l < 16, l + 96, each into a 16-byte store (a warp instruction writes 512 contiguous
// bytes), and the RoPE word l (2 BF16) into 8 bytes.
extern "C" __global__ void model1_gather(const u8* __restrict__ pool, const int* __restrict__ idx, int n,
                                         u32 entries, u64 page_bytes, u64 max_page, u64 pool_len,
                                         float* __restrict__ out, const u64* __restrict__ fail) {
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (u64)n) return;
    if (step_failed(fail)) return;
    u64 d = 0, s = 0;
    const bool here = model1_place((i64)idx[warp], entries, page_bytes, max_page, pool_len, &d, &s) == 0;
    float* o = out + warp * M1_VALUES;
    if (!here) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
            *reinterpret_cast<float4*>(o + 4 * (lane + 32 * k)) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        return;
    }
    const u8* data = pool + d;
    u32 words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int g = lane + 32 * k;
        words[k] = g < 112 ? *reinterpret_cast<const u32*>(data + 4 * g) : 0u;
    }
    const u32 rope = *reinterpret_cast<const u32*>(data + M1_NOPE + 4 * lane);
    const uint2 sc = *reinterpret_cast<const uint2*>(pool + s);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int g = lane + 32 * k;
        if (g >= 112) continue;
        const int tile = g >> 4;  // 16 words of 4 codes per 64-value tile
        const u32 byte = ((tile < 4 ? sc.x : sc.y) >> (8 * (tile & 3))) & 0xffu;
        const float scale = m1_scale_value(byte);
        const u32 w = words[k];
        *reinterpret_cast<float4*>(o + 4 * g) = make_float4(m1_decode(w & 0xffu, scale), m1_decode((w >> 8) & 0xffu, scale),
                                                             m1_decode((w >> 16) & 0xffu, scale), m1_decode(w >> 24, scale));
    }
    *reinterpret_cast<float2*>(o + M1_NOPE + 2 * lane) = make_float2(m1_bf16_quiet(rope & 0xffffu), m1_bf16_quiet(rope >> 16));
}

// State scatter: n rows of row_bytes bytes (fp32 compressor state) at `rows`, row t copied
// to bytes [idx[t] * row_bytes, (idx[t] + 1) * row_bytes) of the pool; negative: skip; a
// row index >= max_rows = pool_len / row_bytes is never written. Thread v moves vector v
// of the flattened [n x row_bytes / vec] rows (vec = 16 when row_bytes, the pool and the
// rows allow 16-byte vectors, else 4), its load issued before the index is waited for.
extern "C" __global__ void state_scatter(u8* __restrict__ pool, const u8* __restrict__ rows,
                                         const i64* __restrict__ idx, int n, u32 row_bytes, u32 vec, u64 max_rows,
                                         const u64* __restrict__ fail) {
    const u32 per_row = row_bytes / vec;
    const u64 v = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= (u64)n * per_row) return;
    const u64 t = v / per_row;
    const u32 j = (u32)(v - t * per_row);
    u64 flag = FAIL_NONE;
    if (fail != nullptr) flag = load_once8(fail);
    const i64 r = (i64)load_once8(idx + t);
    const u64 src = t * row_bytes + (u64)j * vec;
    if (vec == 16u) {
        const uint4 x = load_once16(rows + src);
        if (flag != FAIL_NONE || r < 0 || (u64)r >= max_rows) return;
        *reinterpret_cast<uint4*>(pool + (u64)r * row_bytes + (u64)j * 16u) = x;
    } else {
        const u32 x = *reinterpret_cast<const u32*>(rows + src);
        if (flag != FAIL_NONE || r < 0 || (u64)r >= max_rows) return;
        *reinterpret_cast<u32*>(pool + (u64)r * row_bytes + (u64)j * 4u) = x;
    }
}

// Guards (guard.cu's protocol): mark (op, token, which) for every index whose row would
// end past the pool. MODEL1: which = 0 for the data row, 1 when only the scale row does;
// the indices are int64 (wide != 0: slot mappings) or int32 (index lists).
extern "C" __global__ void guard_model1(const void* __restrict__ idx, int wide, int n, u32 entries, u64 page_bytes,
                                        u64 max_page, u64 pool_len, u32 op, u64* flag) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const i64 r = wide ? reinterpret_cast<const i64*>(idx)[t] : (i64) reinterpret_cast<const int*>(idx)[t];
    u64 d, s;
    const int where = model1_place(r, entries, page_bytes, max_page, pool_len, &d, &s);
    if (where > 0) mark_failed(flag, op, t, (u32)(where - 1));
}

extern "C" __global__ void guard_state(const i64* __restrict__ idx, int n, u64 max_rows, u32 op, u64* flag) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const i64 r = idx[t];
    if (r >= 0 && (u64)r >= max_rows) mark_failed(flag, op, t, 0u);
}

// The sparse decode's extra_indices from a top-k selection (host reference:
// metadata::v4::extra_indices per token). Token t selected nsel[t] compressed entries
// sel[t * ms + k] (entry numbers); its request's block table is row row_of[t] of `table`
// (cols slots, -1 past its blocks). Entry w lies in block w / per_block, row w mod
// per_block of that block's page: out[t * width + k] = ((slot * scale + offset) x
// expansion) x per_block + w mod per_block, -1 from nsel[t] to width; len[t] = nsel[t].
// One thread per (t, k). A token whose entry has no block (a column past the table or a
// -1 slot) marks (op, t, 0) and one whose row passes int32 marks (op, t, 1) in the step's
// fail flag (guard.cu), and writes -1 there; so does a token that selected more than
// `width` entries (all its indices -1, its length 0). nsel[t] <= ms is the caller's.
extern "C" __global__ void v4_extra_indices(int* __restrict__ out, int* __restrict__ len,
                                            const int* __restrict__ sel, const int* __restrict__ nsel, int ms,
                                            const int* __restrict__ row_of, const int* __restrict__ table,
                                            int cols, u32 scale, u32 offset, u32 expansion, u32 per_block,
                                            int width, int n, u32 op, u64* flag) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * width) return;
    const int t = (int)(i / width), k = (int)(i % width);
    const int ns = nsel[t];
    if (k == 0) len[t] = ns > width ? 0 : ns;
    if (ns > width) {
        if (k == 0) mark_failed(flag, op, t, 0u);
        out[i] = -1;
        return;
    }
    if (k >= ns) {
        out[i] = -1;
        return;
    }
    const u32 w = (u32)sel[(long long)t * ms + k];
    const u32 col = w / per_block;
    const int slot = col < (u32)cols ? table[(long long)row_of[t] * cols + col] : -1;
    if (slot < 0) {
        mark_failed(flag, op, t, 0u);
        out[i] = -1;
        return;
    }
    const u64 row = ((u64)(u32)slot * scale + offset) * expansion * per_block + w % per_block;
    if (row > 0x7fffffffull) {
        mark_failed(flag, op, t, 1u);
        out[i] = -1;
        return;
    }
    out[i] = (int)row;
}
