// DeepSeek-V4 reference model on the GPU (dsa-kv-model's `v4::cuda`): the host model's
// arithmetic, bit for bit. Compiled with the crate's exact-IEEE options (no FMA
// contraction); the intrinsics below also say so explicitly.
//
// `v4_dot8` is the host's `math::dot8`: element i goes to lane i mod 8, each lane summed
// in ascending order, then the lanes pairwise ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)).

__device__ float v4_dot8(const float* a, const float* b, int n) {
    float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int k = 0;
    for (; k + 8 <= n; k += 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j) l[j] = __fadd_rn(l[j], __fmul_rn(a[k + j], b[k + j]));
    }
    for (int j = 0; k + j < n; ++j) l[j] = __fadd_rn(l[j], __fmul_rn(a[k + j], b[k + j]));
    return __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[1]), __fadd_rn(l[2], l[3])),
                     __fadd_rn(__fadd_rn(l[4], l[5]), __fadd_rn(l[6], l[7])));
}

// out[v][r] = dot8(w[r], x[v]) for n vectors of `cols` (the host's `Mat::apply8`); one
// thread per output.
extern "C" __global__ void v4_matvec8(float* out, const float* w, const float* x, int rows,
                                      int cols, int n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * rows) return;
    long v = i / rows, r = i % rows;
    out[i] = v4_dot8(w + r * cols, x + v * cols, cols);
}

// out[v] = x[v] / sqrt(dot8(x[v], x[v]) / width + 1e-6) (the host's `rmsnorm8`); one thread
// per vector.
extern "C" __global__ void v4_rmsnorm8(float* out, const float* x, int n, int width) {
    long v = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= n) return;
    const float* xv = x + v * width;
    float ms = __fdiv_rn(v4_dot8(xv, xv, width), (float)width);
    float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, 1e-6f)));
    for (int i = 0; i < width; ++i) out[v * width + i] = __fmul_rn(xv[i], r);
}
