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
// conversion: RNE, saturating to +-448 exactly like f32_to_e4m3, and NaN -> 0x7F (the
// fix-up makes the code independent of the NaN's sign). The selfcheck_e4m3 kernel proves
// it equal to f32_to_e4m3 on all 2^32 inputs (GPU test).
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    u32 r = (u32)lo | ((u32)hi << 16);
    if (a != a) r = (r & 0xffffff00u) | 0x0000007fu;
    if (b != b) r = (r & 0xffff00ffu) | 0x00007f00u;
    if (c != c) r = (r & 0xff00ffffu) | 0x007f0000u;
    if (d != d) r = (r & 0x00ffffffu) | 0x7f000000u;
    return r;
}

// x / s for a power-of-two s: multiplying by the exact reciprocal rounds identically
// (both are the exact value x * 2^-k rounded once), and is much cheaper than an IEEE
// division. s is never 0 here (amax is floored); s = inf gives 0 (and inf * 0 = NaN =
// inf / inf).
__device__ __forceinline__ float div_pow2(float x, float inv) { return __fmul_rn(x, inv); }

// Exhaustive check of e4m3x4 against f32_to_e4m3 over bit patterns [base, base + count).
extern "C" __global__ void selfcheck_e4m3(u32 base, u32 count, unsigned long long* mismatches, u32* example) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float x = __uint_as_float(base + i);
    u8 hw = (u8)(e4m3x4(x, 0.0f, 0.0f, 0.0f) & 0xffu);
    if (hw != f32_to_e4m3(x)) {
        atomicAdd(mismatches, 1ull);
        atomicExch(example, base + i);
    }
}

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

__device__ __forceinline__ float warp_max(float v, unsigned width) {
    for (unsigned o = width / 2u; o > 0u; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, width));
    return v;
}

// Byte offset of token slot `slot` in a strided row view (see RowView in src/ops/mla.rs).
__device__ __forceinline__ u64 row_offset(i64 slot, u64 base, u64 block_stride, u32 tpb, u32 row_bytes) {
    u64 s = (u64)slot;
    return base + (s / tpb) * block_stride + (s % tpb) * (u64)row_bytes;
}
