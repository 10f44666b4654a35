//! The model's arithmetic, spelled out so that a GPU twin computes the same bits: every
//! dot product and sum in ascending order, `relu` by comparison, `exp` as a fixed
//! polynomial, the RoPE angles from one f64 function (the GPU takes a table built by it).

use half::bf16;

use dsa_kv_core::rng::SplitMix64;

/// A row-major `[rows, cols]` f32 matrix.
#[derive(Clone, Debug)]
pub(crate) struct Mat {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) w: Vec<f32>,
}

impl Mat {
    /// Uniform in `±sqrt(3 / cols)` (unit variance outputs for unit inputs).
    pub(crate) fn random(rng: &mut SplitMix64, rows: usize, cols: usize) -> Mat {
        let a = (3.0 / cols as f64).sqrt();
        let w = (0..rows * cols)
            .map(|_| ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * a)
            .map(|x| x as f32)
            .collect();
        Mat { rows, cols, w }
    }

    /// `out = W · x`, each output a dot product by ascending index.
    pub(crate) fn apply(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.cols);
        self.w.chunks_exact(self.cols).map(|r| dot(r, x)).collect()
    }

    /// `out = W · x`, each output a [`dot8`] (the V4 model's order).
    pub(crate) fn apply8(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.cols);
        self.w.chunks_exact(self.cols).map(|r| dot8(r, x)).collect()
    }

    /// `out = Wᵀ · x`, each output summed by ascending row.
    pub(crate) fn apply_t(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.rows);
        let mut out = vec![0f32; self.cols];
        for (r, &xr) in self.w.chunks_exact(self.cols).zip(x) {
            for (o, &w) in out.iter_mut().zip(r) {
                *o += w * xr;
            }
        }
        out
    }
}

/// Dot product by ascending index.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// `a · b` in a fixed order that vectorizes (the V4 model's): element `i` goes to lane
/// `i mod 8` (each lane summed in ascending order), then the lanes pairwise:
/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`. A GPU twin reproduces it with
/// the same lanes.
pub(crate) fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            l[j] += x[j] * y[j];
        }
    }
    for (j, (x, y)) in ra.iter().zip(rb).enumerate() {
        l[j] += x * y;
    }
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `x += y`, element by element.
pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

pub(crate) fn rmsnorm(x: &[f32]) -> Vec<f32> {
    let ms = dot(x, x) / x.len() as f32;
    let r = 1.0 / (ms + 1e-6).sqrt();
    x.iter().map(|v| v * r).collect()
}

/// [`rmsnorm`] with the sum of squares as a [`dot8`] (the V4 model's).
pub(crate) fn rmsnorm8(x: &[f32]) -> Vec<f32> {
    let ms = dot8(x, x) / x.len() as f32;
    let r = 1.0 / (ms + 1e-6).sqrt();
    x.iter().map(|v| v * r).collect()
}

/// `max(x, 0)`, +0 for ±0 and NaN-free inputs alike (no platform `max` semantics).
pub(crate) fn relu(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// `e^x` in plain f32 operations (no fused multiply-add, no platform `expf`), so a GPU
/// twin computes the same bits: `x = k·ln 2 + r` (two-part ln 2), a degree-7 Taylor
/// polynomial of `e^r` (Horner), times `2^k`. Below −87 (where `2^k` would be
/// subnormal) it returns 0. Inputs here are `≤ 0` (softmax after the maximum).
pub(crate) fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < -87.0 {
        return 0.0;
    }
    let x = if x > 88.0 { 88.0 } else { x };
    let k = (x * std::f32::consts::LOG2_E).round();
    let r = x - k * 0.693_145_75 - k * 1.428_606_8e-6;
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// The rotation of pair `i` of an `n`-wide RoPE part at `pos`: `(cos θ, sin θ)` with
/// `θ = pos · 10000^(−2i/n)`, computed in f64 and rounded (GPU forwards take a table of
/// these values, so both compute the same bits).
pub(crate) fn rope_cos_sin(pos: u32, i: usize, n: usize) -> (f32, f32) {
    let theta = (pos as f64) * 10000f64.powf(-((2 * i) as f64) / n as f64);
    (theta.cos() as f32, theta.sin() as f32)
}

/// Rotary embedding of `x` (pairs `(2i, 2i+1)`) at `pos`.
pub(crate) fn rope(x: &mut [f32], pos: u32) {
    let n = x.len();
    for i in 0..n / 2 {
        let (c, s) = rope_cos_sin(pos, i, n);
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

pub(crate) fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}
