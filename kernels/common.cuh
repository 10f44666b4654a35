// Shared device helpers of the dsa-kv kernels. Header-free on purpose: BF16 values are
// handled as their 16-bit patterns, and every conversion is integer arithmetic that
// mirrors the host reference in src/ops/quant.rs bit for bit.
//
// The kernel sources are concatenated in this order and compiled once per device by
// NVRTC for sm_90a: common.cuh, quant.cu, guard.cu, indexer.cu, mla.cu, topk.cu, slots.cu,
// copy.cu.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define AMAX_FLOOR 1e-4f
#define FP8_MAX 448.0f
#define FP4_MAX 6.0f

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

// v >> s rounded to nearest, ties to even (1 <= s < 32).
__device__ __forceinline__ u32 rne_shift(u32 v, u32 s) {
    u32 q = v >> s;
    u32 rem = v & ((1u << s) - 1u);
    u32 half = 1u << (s - 1u);
    return (rem > half || (rem == half && (q & 1u))) ? q + 1u : q;
}

// f32 -> FP8 E4M3 (e4m3fn): round to nearest even, saturating to +-448, NaN -> 0x7F.
__device__ u8 f32_to_e4m3(float x) {
    u32 bits = __float_as_uint(x);
    u8 sign = (u8)((bits >> 24) & 0x80u);
    u32 a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;  // NaN: positive code whatever the sign
    if (a >= 0x43e00000u) return sign | 0x7e;
    int exp = (int)(a >> 23) - 127;
    if (exp < -6) {
        if (exp < -10) return sign;
        u32 sig = (a & 0x7fffffu) | 0x800000u;
        return sign | (u8)rne_shift(sig, (u32)(14 - exp));
    }
    int e = exp + 7;
    u32 m = rne_shift(a & 0x7fffffu, 20);
    if (m == 8u) { m = 0u; e += 1; }
    if (e > 15 || (e == 15 && m == 7u)) return sign | 0x7e;
    return sign | (u8)(e << 3) | (u8)m;
}

// Four f32 -> four E4M3 bytes (a in the lowest byte) with the sm_89+ hardware
// conversion: RNE, saturating to +-448 exactly like f32_to_e4m3. A NaN converts to a NaN
// code, S.1111.111 (0x7F or 0xFF by the NaN's sign), and nothing else does (satfinite stops
// at 0x7E), so clearing the sign bit of exactly the bytes whose low seven bits are all ones
// gives the reference's sign-independent 0x7F: (b & 0x7F) + 1 carries into bit 7 only for
// 0x7F, and never into the next byte. The selfcheck_e4m3 kernel proves the result equal to
// f32_to_e4m3 on all 2^32 inputs (GPU test).
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    u32 r = (u32)lo | ((u32)hi << 16);
    u32 nan_bytes = ((r & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
    return r & ~nan_bytes;
}

// x / s for a power-of-two s: multiplying by the exact reciprocal rounds identically
// (both are the exact value x * 2^-k rounded once), and is much cheaper than an IEEE
// division. s is never 0 here (amax is floored); s = inf gives 0 (and inf * 0 = NaN =
// inf / inf).
__device__ __forceinline__ float div_pow2(float x, float inv) { return __fmul_rn(x, inv); }

// FP8 E4M3 -> f32.
__device__ float e4m3_to_f32(u8 b) {
    float sign = (b & 0x80) ? -1.0f : 1.0f;
    int e = (b >> 3) & 0xf;
    float m = (float)(b & 7);
    if (e == 15 && (b & 7) == 7) return __uint_as_float(0x7fc00000u);
    if (e == 0) return sign * m * __uint_as_float((u32)(127 - 9) << 23);
    return sign * (1.0f + m / 8.0f) * __uint_as_float((u32)(e - 7 + 127) << 23);
}

// f32 -> FP4 E2M1 code (low nibble): round to nearest even, saturating to +-6, NaN -> +6.
__device__ u8 f32_to_e2m1(float x) {
    u32 bits = __float_as_uint(x);
    u8 sign = (u8)((bits >> 28) & 0x8u);
    u32 a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7;  // NaN -> +6, sign dropped as for E4M3
    if (a >= 0x40c00000u) return sign | 0x7;
    int exp = (int)(a >> 23) - 127;
    if (exp < 0) {
        if (exp < -2) return sign;
        u32 sig = (a & 0x7fffffu) | 0x800000u;
        return sign | (u8)rne_shift(sig, (u32)(22 - exp));
    }
    int e = exp + 1;
    u32 m = rne_shift(a & 0x7fffffu, 22);
    if (m == 2u) { m = 0u; e += 1; }
    if (e > 3) return sign | 0x7;
    return sign | (u8)(e << 1) | (u8)m;
}

// The smallest power of two >= s (s > 0, finite).
__device__ float pow2_ceil(float s) {
    u32 bits = __float_as_uint(s);
    u32 exp = (bits >> 23) & 0xffu;
    u32 mant = bits & 0x7fffffu;
    if (exp == 0u) {
        // f32 subnormal: the next power of two of the mantissa, as subnormal bits
        // (2^23 is the smallest normal).
        u32 p = 1u;
        while (p < mant) p <<= 1;
        return __uint_as_float(p);
    }
    u32 e = exp + (mant != 0u ? 1u : 0u);
    return __uint_as_float(e << 23);
}

// max(amax, 1e-4) / max, rounded up to a power of two when ue8m0 != 0.
__device__ __forceinline__ float block_scale(float amax, float maxv, int ue8m0) {
    float s = fmaxf(amax, AMAX_FLOOR) / maxv;
    return ue8m0 ? pow2_ceil(s) : s;
}

// block_scale(amax, FP8_MAX, 1) without the division and the search: with
// m = max(amax, 1e-4) = 1.f * 2^e (normal, m >= 1e-4) and 448 = 1.75 * 2^8, the smallest
// power of two >= m / 448 is 2^(e-8) when 1.f <= 1.75 and 2^(e-7) otherwise. Rounding m / 448
// to f32 cannot land on 2^(e-8) from above: m's next value past 1.75 * 2^e is 2^-23 / 1.75
// > 2^-24 (half an ulp) above it, relatively. m = inf gives inf, like pow2_ceil. Proved equal
// to block_scale on every non-negative f32 by selfcheck_e4m3 (GPU test).
__device__ __forceinline__ float ue8m0_scale_fp8(float amax) {
    u32 m = __float_as_uint(fmaxf(amax, AMAX_FLOOR));
    u32 e = m >> 23;
    if (e == 255u) return __uint_as_float(0x7f800000u);
    return __uint_as_float((e - 8u + ((m & 0x7fffffu) > 0x600000u ? 1u : 0u)) << 23);
}

// 1 / s for a power of two s >= 2^-126 (inf -> 0): exact, so equal to __frcp_rn(s).
__device__ __forceinline__ float pow2_recip(float s) {
    u32 e = __float_as_uint(s) >> 23;
    return e == 255u ? 0.0f : __uint_as_float((254u - e) << 23);
}

// Exhaustive check over bit patterns [base, base + count) of the conversions that replace
// a reference: e4m3x4 against f32_to_e4m3, and (on |x|, as an amax) ue8m0_scale_fp8 and
// pow2_recip against block_scale and __frcp_rn.
extern "C" __global__ void selfcheck_e4m3(u32 base, u32 count, unsigned long long* mismatches, u32* example) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float x = __uint_as_float(base + i);
    u8 hw = (u8)(e4m3x4(x, 0.0f, 0.0f, 0.0f) & 0xffu);
    float amax = fabsf(x);
    float scale = block_scale(amax, FP8_MAX, 1), fast = ue8m0_scale_fp8(amax);
    bool same_scale = __float_as_uint(scale) == __float_as_uint(fast) &&
                      __float_as_uint(__frcp_rn(scale)) == __float_as_uint(pow2_recip(fast));
    if (hw != f32_to_e4m3(x) || !same_scale) {
        atomicAdd(mismatches, 1ull);
        atomicExch(example, base + i);
    }
}

// Max of two BF16 pairs, position by position. A NaN loses against a number (like fmaxf
// and the host's f32::max), and bf16 -> f32 is exact, so a max over |x| taken here equals
// the reference's f32 fold; a pair of NaNs gives NaN, which the amax floor turns into
// 1e-4 exactly as the reference's 0 would.
__device__ __forceinline__ u32 bf16x2_max(u32 a, u32 b) {
    u32 d;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Max of |x| over the 8 BF16 values of v: (even positions, odd positions) as a pair.
__device__ __forceinline__ u32 bf16x8_absmax(uint4 v) {
    const u32 abs = 0x7fff7fffu;
    return bf16x2_max(bf16x2_max(v.x & abs, v.y & abs), bf16x2_max(v.z & abs, v.w & abs));
}

// Loads of data a kernel reads once (rows, slots, the fail flag). Volatile, so that they
// are issued where they are written, at the top of the kernel, and not sunk into the
// branch that uses them: a load after the slot-dependent skip test waits for the slot's
// load first, two memory latencies in a row per warp.
__device__ __forceinline__ uint4 load_once16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ u64 load_once8(const void* p) {
    u64 v;
    asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float warp_max(float v, unsigned width) {
    for (unsigned o = width / 2u; o > 0u; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, width));
    return v;
}

// Byte offset of token slot `slot` in a strided row view (see RowView in src/ops/mla.rs).
// Tokens per block is a power of two in every layout we build (64): a shift and a mask
// instead of a 64-bit division (a library call); any other value still divides.
__device__ __forceinline__ u64 row_offset(i64 slot, u64 base, u64 block_stride, u32 tpb, u32 row_bytes) {
    u64 s = (u64)slot;
    u64 block, pos;
    if ((tpb & (tpb - 1u)) == 0u) {
        block = s >> (__ffs(tpb) - 1);
        pos = s & (u64)(tpb - 1u);
    } else {
        block = s / tpb;
        pos = s % tpb;
    }
    return base + block * block_stride + pos * (u64)row_bytes;
}
