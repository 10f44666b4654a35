//! The model's arithmetic, spelled out so that a GPU twin computes the same bits: every
//! dot product and sum in a fixed order (ascending, [`dot8`]'s 8 lanes for the V4 model,
//! or [`Lanes32`]'s warp order for the V3.2 reference model), `relu` by comparison, `exp`
//! as a fixed polynomial, the RoPE angles from one f64 function (the GPU takes a table
//! built by it).

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

    /// `out = W · x`, each output a [`dot32`] (the V3.2 reference model's order; the
    /// GPU's `m_matvec` computes each output with one warp).
    pub(crate) fn apply32(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.cols);
        self.w
            .chunks_exact(self.cols)
            .map(|r| dot32(r, x))
            .collect()
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

/// A sum in the order of one 32-thread warp (the V3.2 reference model's order, which its
/// GPU twin computes with `__shfl_xor_sync` butterflies): term `i` (counted from the
/// first term [`add`](Self::add)ed) goes to lane `i mod 32`, each lane sums its terms
/// in ascending order starting from `+0.0`, then [`sum`](Self::sum) combines the lanes
/// by a fixed tree, strides 16, 8, 4, 2, 1: `l[i] = l[i] + l[i + s]` for `i < s`, and the
/// result is `l[0]`. (A butterfly lane `i ≥ s` computes `l[i] + l[i − s]`, the same
/// operands commuted, so every lane ends with `l[0]`'s bits.)
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lanes32 {
    l: [f32; 32],
    next: usize,
}

impl Lanes32 {
    pub(crate) fn new() -> Lanes32 {
        Lanes32 {
            l: [0.0; 32],
            next: 0,
        }
    }

    /// Adds term `v` (the next index) to its lane.
    pub(crate) fn add(&mut self, v: f32) {
        self.l[self.next % 32] += v;
        self.next += 1;
    }

    /// Adds the terms `a[i] · b[i]`, `i` ascending.
    pub(crate) fn add_dot(&mut self, a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            self.add(x * y);
        }
    }

    /// The lanes combined by the tree of strides 16, 8, 4, 2, 1.
    pub(crate) fn sum(mut self) -> f32 {
        let mut s = 16;
        while s > 0 {
            for i in 0..s {
                self.l[i] += self.l[i + s];
            }
            s /= 2;
        }
        self.l[0]
    }
}

/// `a · b` in the [`Lanes32`] order (product `i` to lane `i mod 32`, the lanes by the
/// fixed tree).
pub(crate) fn dot32(a: &[f32], b: &[f32]) -> f32 {
    let mut l = Lanes32::new();
    l.add_dot(a, b);
    l.sum()
}

/// `Σ x` in the [`Lanes32`] order.
pub(crate) fn sum32(x: &[f32]) -> f32 {
    let mut l = Lanes32::new();
    for &v in x {
        l.add(v);
    }
    l.sum()
}

/// The order of a model's sums that [`index_scores`](crate::model::index_scores) and
/// [`attend_head`](crate::model::attend_head) use: the V3.2 reference model (and its GPU
/// twin) takes [`Lanes32`], a checkpoint's forward (compared with an outside oracle by
/// tolerance) ascending order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SumOrder {
    /// Every sum by ascending index ([`dot`]).
    Ascending,
    /// Every sum in the [`Lanes32`] order ([`dot32`], [`sum32`]).
    Lanes32,
}

/// `x += y`, element by element.
pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `x / sqrt(mean(x²) + 1e-6)`, the sum of squares by ascending index (no model uses it
/// now; the V4 GPU test compares its order with [`rmsnorm8`]'s).
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn rmsnorm(x: &[f32]) -> Vec<f32> {
    let ms = dot(x, x) / x.len() as f32;
    let r = 1.0 / (ms + 1e-6).sqrt();
    x.iter().map(|v| v * r).collect()
}

/// [`rmsnorm`] with the sum of squares as a [`dot32`] (the V3.2 reference model's; the
/// GPU's `m_rmsnorm` normalizes each token with one warp).
pub(crate) fn rmsnorm32(x: &[f32]) -> Vec<f32> {
    let ms = dot32(x, x) / x.len() as f32;
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

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: f32 = 1.0 / 16_777_216.0; // 2^-24: half an ulp of 1.0

    /// `1 + 31 × 2^-24`: ascending, every tiny term is rounded away (ties to even); the
    /// tree adds the tiny lanes to each other first: at strides 16, 8, 4, 2, 1 lane 0
    /// becomes 1, 1 + 2^-23, 1 + 3·2^-23, 1 + 7·2^-23, 1 + 15·2^-23 (all exact).
    #[test]
    fn the_tree_is_not_the_ascending_sum() {
        let mut x = vec![TINY; 32];
        x[0] = 1.0;
        let mut ascending = 0f32;
        for v in &x {
            ascending += v;
        }
        assert_eq!(ascending, 1.0);
        assert_eq!(sum32(&x).to_bits(), 0x3f80_000f);
        assert_eq!(dot32(&x, &[1.0; 32]).to_bits(), 0x3f80_000f);
    }

    /// Lanes 16 and 17 tiny, lane 0 one: stride 16 first adds lane 16 to lane 0 (lost)
    /// and moves lane 17 to lane 1, lost again at stride 1: exactly 1. Adjacent pairs
    /// first would give `1 + 2^-23`.
    #[test]
    fn the_tree_starts_at_stride_16() {
        let mut x = [0f32; 32];
        x[0] = 1.0;
        x[16] = TINY;
        x[17] = TINY;
        assert_eq!(sum32(&x), 1.0);
        let mut pairs = x;
        let mut s = 1;
        while s < 32 {
            for i in (0..32).step_by(2 * s) {
                pairs[i] += pairs[i + s];
            }
            s *= 2;
        }
        assert_eq!(pairs[0].to_bits(), 0x3f80_0001, "the other tree differs");
    }

    /// A lane sums its terms in ascending order: lane 0 gets `2^-24, 2^-24, 1` (terms
    /// 0, 32, 64) and keeps both tiny ones (`1 + 2^-23`); descending would lose them.
    #[test]
    fn a_lane_sums_ascending_and_parts_continue_the_lanes() {
        let mut a = vec![0f32; 70];
        a[0] = TINY;
        a[32] = TINY;
        a[64] = 1.0;
        let ones = vec![1f32; 70];
        assert_eq!(dot32(&a, &ones).to_bits(), 0x3f80_0001);
        // Two parts (as the attention's latent and RoPE part) continue the lane count.
        let mut l = Lanes32::new();
        l.add_dot(&a[..40], &ones[..40]);
        l.add_dot(&a[40..], &ones[40..]);
        assert_eq!(l.sum().to_bits(), dot32(&a, &ones).to_bits());
        assert_eq!(dot32(&[], &[]).to_bits(), 0);
    }

    #[test]
    fn rmsnorm32_uses_the_tree() {
        let mut x = vec![TINY.sqrt(); 32];
        x[0] = 1.0;
        let r = 1.0 / ((f32::from_bits(0x3f80_000f) / 32.0) + 1e-6).sqrt();
        assert_eq!(rmsnorm32(&x)[0].to_bits(), r.to_bits());
    }
}
