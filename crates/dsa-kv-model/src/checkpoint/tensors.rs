//! The checkpoint's tensors: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` names, read with the `safetensors` crate and widened
//! to f32 (F32, BF16 and F16 tensors), integer tensors (I64, I32: DeepSeek-V4's token →
//! expert tables) kept as integers. Each tensor is taken once, with its shape checked;
//! what no layer took is reported.
//!
//! Quantized weights as DeepSeek publishes them (and transformers 5.17's fine-grained
//! FP8 loader reads them) are dequantized at load: a weight `X.weight` with a sibling
//! `X.scale` (F8_E8M0 exponents, or F32 / BF16 / F16 powers of two) is
//! * F8_E4M3 `[rows, cols]` with one scale per 128 × 128 block (`[⌈rows/128⌉,
//!   ⌈cols/128⌉]`), or
//! * FP4 E2M1 packed two to a byte (I8, U8 or F4; the low nibble first) `[rows, cols/2]`
//!   with one scale per 32 values of a row (`[rows, cols/32]`, MXFP4),
//!
//! and becomes `X.weight` in f32 (value × scale). A quantized tensor without its scale, a
//! scale of another shape, a NaN exponent (0xff) or another 8-bit format is refused,
//! naming the tensor.

use dsa_kv_core::config::file::{json_with_path, read_regular, read_regular_text};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use super::CheckpointError;

/// The largest `model.safetensors.index.json` read (DeepSeek-V3.2's is under 10 MiB).
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// The largest safetensors file read: every tensor is held widened to f32, so this
/// loader is for checkpoints that fit in host memory several times over (the published
/// models' shards are about 5 GB).
const MAX_SHARD_BYTES: u64 = 16 << 30;

/// The tensors of a checkpoint, by name.
pub(crate) struct Tensors {
    map: HashMap<String, (Vec<usize>, Vec<f32>)>,
    ints: HashMap<String, (Vec<usize>, Vec<i64>)>,
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        what: e.to_string(),
    }
}

impl Tensors {
    /// Reads every tensor of the checkpoint in `dir`.
    pub(crate) fn load(dir: &Path) -> Result<Tensors, CheckpointError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index.exists() {
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let text = read_regular_text(&index, MAX_INDEX_BYTES).map_err(|e| io(&index, e))?;
            let ix: Index = json_with_path(&text).map_err(|e| io(&index, e))?;
            let shards: BTreeSet<String> = ix.weight_map.into_values().collect();
            for s in &shards {
                // A shard is a file of this folder, never a path elsewhere.
                if s.contains('/') || s.contains('\\') || s == ".." {
                    return Err(io(&index, format!("shard {s:?} is not a file name")));
                }
            }
            shards.into_iter().collect()
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut map = HashMap::new();
        let mut ints = HashMap::new();
        let mut raw: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = HashMap::new();
        for f in files {
            let path = dir.join(&f);
            let bytes = read_regular(&path, MAX_SHARD_BYTES).map_err(|e| io(&path, e))?;
            let st = SafeTensors::deserialize(&bytes).map_err(|e| io(&path, e))?;
            for (name, view) in st.tensors() {
                if let Some(v) = integers(view.dtype(), view.data()) {
                    if map.contains_key(&name)
                        || ints
                            .insert(name.clone(), (view.shape().to_vec(), v))
                            .is_some()
                    {
                        return Err(CheckpointError::Tensor {
                            name,
                            what: "stored twice".into(),
                        });
                    }
                    continue;
                }
                if is_quantized(view.dtype()) {
                    let dup = map.contains_key(&name) || ints.contains_key(&name);
                    let v = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
                    if dup || raw.insert(name.clone(), v).is_some() {
                        return Err(CheckpointError::Tensor {
                            name,
                            what: "stored twice".into(),
                        });
                    }
                    continue;
                }
                let data =
                    widen(view.dtype(), view.data()).ok_or_else(|| CheckpointError::Tensor {
                        name: name.clone(),
                        what: format!(
                            "stored as {:?}: this loader reads F32, BF16 and F16 tensors, \
                             integer tables, and F8_E4M3 / FP4 weights with their \
                             F8_E8M0 block scales",
                            view.dtype()
                        ),
                    })?;
                if ints.contains_key(&name)
                    || raw.contains_key(&name)
                    || map
                        .insert(name.clone(), (view.shape().to_vec(), data))
                        .is_some()
                {
                    return Err(CheckpointError::Tensor {
                        name,
                        what: "stored twice".into(),
                    });
                }
            }
        }
        dequantize_all(&mut map, raw)?;
        Ok(Tensors { map, ints })
    }

    /// Renames tensors: each name `old` → `f(old)` where that is `Some` (the checkpoint's
    /// naming onto the loader's). Two names onto one is refused.
    pub(crate) fn rename(
        &mut self,
        f: impl Fn(&str) -> Option<String>,
    ) -> Result<(), CheckpointError> {
        for m in [0, 1] {
            let names: Vec<String> = if m == 0 {
                self.map.keys().cloned().collect()
            } else {
                self.ints.keys().cloned().collect()
            };
            for old in names {
                let Some(new) = f(&old) else { continue };
                if self.map.contains_key(&new) || self.ints.contains_key(&new) {
                    return Err(CheckpointError::Tensor {
                        name: old,
                        what: format!("its loader name {new} is taken by another tensor"),
                    });
                }
                if m == 0 {
                    let v = self.map.remove(&old).expect("listed");
                    self.map.insert(new, v);
                } else {
                    let v = self.ints.remove(&old).expect("listed");
                    self.ints.insert(new, v);
                }
            }
        }
        Ok(())
    }

    /// Takes integer tensor `name`, which must have `shape`.
    pub(crate) fn take_ints(
        &mut self,
        name: &str,
        shape: &[usize],
    ) -> Result<Vec<i64>, CheckpointError> {
        let Some((got, data)) = self.ints.remove(name) else {
            let what = if self.map.contains_key(name) {
                "stored as floating point: an integer tensor was expected".to_string()
            } else {
                format!("missing (expected an integer tensor of shape {shape:?})")
            };
            return Err(CheckpointError::Tensor {
                name: name.into(),
                what,
            });
        };
        if got != shape {
            return Err(CheckpointError::Tensor {
                name: name.into(),
                what: format!("shape {got:?}, the configuration gives {shape:?}"),
            });
        }
        Ok(data)
    }

    /// Takes tensor `name`, which must have `shape`.
    pub(crate) fn take(
        &mut self,
        name: &str,
        shape: &[usize],
    ) -> Result<Vec<f32>, CheckpointError> {
        self.take_opt(name, shape)?
            .ok_or_else(|| CheckpointError::Tensor {
                name: name.into(),
                what: format!("missing (expected shape {shape:?})"),
            })
    }

    /// Takes tensor `name` if the checkpoint has it; it must have `shape`.
    pub(crate) fn take_opt(
        &mut self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<f32>>, CheckpointError> {
        let Some((got, data)) = self.map.remove(name) else {
            if let Some((got, _)) = self.ints.get(name) {
                return Err(CheckpointError::Tensor {
                    name: name.into(),
                    what: format!(
                        "stored as integers (I64 or I32, shape {got:?}): a floating-point \
                         tensor (F32, BF16 or F16) of shape {shape:?} was expected"
                    ),
                });
            }
            return Ok(None);
        };
        if got != shape {
            return Err(CheckpointError::Tensor {
                name: name.into(),
                what: format!("shape {got:?}, the configuration gives {shape:?}"),
            });
        }
        Ok(Some(data))
    }

    /// Whether the checkpoint has tensor `name` (not taken yet).
    pub(crate) fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The names no one took, sorted.
    pub(crate) fn left(&self) -> Vec<String> {
        let mut v: Vec<String> = self.map.keys().chain(self.ints.keys()).cloned().collect();
        v.sort();
        v
    }
}

/// Little-endian I64 / I32 bytes as i64; `None` for other dtypes.
fn integers(dtype: Dtype, b: &[u8]) -> Option<Vec<i64>> {
    Some(match dtype {
        Dtype::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect(),
        Dtype::I32 => b
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_le_bytes(c.try_into().expect("4 bytes"))))
            .collect(),
        _ => return None,
    })
}

/// Little-endian F32 / BF16 / F16 bytes as f32; `None` for other dtypes.
fn widen(dtype: Dtype, b: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}

/// Whether a dtype is one of the 8-bit or 4-bit formats held raw until dequantized.
fn is_quantized(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ
            | Dtype::I8
            | Dtype::U8
            | Dtype::F4
    )
}

/// E2M1 (FP4) values by nibble.
const FP4_E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// An F8_E4M3 (FN: no infinities, 0x7f / 0xff NaN) byte's value.
fn e4m3(b: u8) -> f32 {
    let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    let v = if b & 0x7f == 0x7f {
        f32::NAN
    } else if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// The FP8 block of DeepSeek's published weights (rows × columns).
const FP8_BLOCK: usize = 128;
/// Values per FP4 scale (MXFP4).
const FP4_BLOCK: usize = 32;

/// Replaces every quantized weight `X.weight` of `raw` and its scale `X.scale` (in `raw`
/// as F8_E8M0, or in `map` as F32) by `X.weight` in f32 in `map`.
fn dequantize_all(
    map: &mut HashMap<String, (Vec<usize>, Vec<f32>)>,
    mut raw: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>,
) -> Result<(), CheckpointError> {
    let bad = |name: &str, what: String| CheckpointError::Tensor {
        name: name.into(),
        what,
    };
    let mut weights: Vec<String> = raw
        .iter()
        .filter(|(_, (d, _, _))| *d != Dtype::F8_E8M0)
        .map(|(n, _)| n.clone())
        .collect();
    weights.sort();
    for name in weights {
        let (dtype, shape, bytes) = raw.remove(&name).expect("listed");
        let Some(base) = name.strip_suffix(".weight") else {
            return Err(bad(
                &name,
                format!("stored as {dtype:?}: only `.weight` tensors are read quantized"),
            ));
        };
        let scale_name = format!("{base}.scale");
        let scales: (Vec<usize>, Vec<f32>) = if let Some((d, s, b)) = raw.remove(&scale_name) {
            if d != Dtype::F8_E8M0 {
                return Err(bad(
                    &scale_name,
                    format!("stored as {d:?}: F8_E8M0 or F32 expected"),
                ));
            }
            let v = b
                .iter()
                .map(|&e| {
                    (e != 0xff)
                        .then(|| 2f32.powi(i32::from(e) - 127))
                        .ok_or_else(|| bad(&scale_name, "an E8M0 exponent of 0xff (NaN)".into()))
                })
                .collect::<Result<Vec<f32>, _>>()?;
            (s, v)
        } else if let Some((s, v)) = map.remove(&scale_name) {
            let pow2 = |x: f32| x.is_normal() && x > 0.0 && x.to_bits() & 0x7f_ffff == 0;
            if let Some(x) = v.iter().find(|x| !pow2(**x)) {
                return Err(bad(
                    &scale_name,
                    format!("a scale of {x}: a positive power of two expected"),
                ));
            }
            (s, v)
        } else {
            return Err(bad(
                &name,
                format!("stored as {dtype:?} without its block scales {scale_name}"),
            ));
        };
        if shape.len() != 2 || scales.0.len() != 2 {
            return Err(bad(
                &name,
                format!(
                    "a quantized weight of shape {shape:?} with scales {:?}: 2-D expected",
                    scales.0
                ),
            ));
        }
        let (rows, cols) = (shape[0], shape[1]);
        let s = &scales.1;
        let out = match dtype {
            Dtype::F8_E4M3 => {
                let grid = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
                if scales.0 != grid {
                    return Err(bad(
                        &scale_name,
                        format!(
                            "shape {:?}: {grid:?} expected for an F8_E4M3 weight of {shape:?} \
                             (one per {FP8_BLOCK} × {FP8_BLOCK} block)",
                            scales.0
                        ),
                    ));
                }
                (0..rows * cols)
                    .map(|i| {
                        let (r, c) = (i / cols, i % cols);
                        e4m3(bytes[i]) * s[(r / FP8_BLOCK) * grid[1] + c / FP8_BLOCK]
                    })
                    .collect::<Vec<f32>>()
            }
            Dtype::I8 | Dtype::U8 | Dtype::F4 => {
                // F4 counts elements (two a byte); I8 / U8 count bytes.
                let packed = if dtype == Dtype::F4 { cols / 2 } else { cols };
                let full = 2 * packed;
                if dtype == Dtype::F4 && cols % 2 != 0 {
                    return Err(bad(&name, format!("an odd F4 row of {cols}")));
                }
                if full % FP4_BLOCK != 0 || scales.0 != [rows, full / FP4_BLOCK] {
                    return Err(bad(
                        &scale_name,
                        format!(
                            "shape {:?}: [{rows}, {}] expected for FP4 rows of {full} values \
                             (one per {FP4_BLOCK}; a row's length a multiple of {FP4_BLOCK})",
                            scales.0,
                            full / FP4_BLOCK
                        ),
                    ));
                }
                let mut v = Vec::with_capacity(rows * full);
                for r in 0..rows {
                    for (j, &b) in bytes[r * packed..(r + 1) * packed].iter().enumerate() {
                        let sc = s[r * (full / FP4_BLOCK) + 2 * j / FP4_BLOCK];
                        v.push(FP4_E2M1[usize::from(b & 0xf)] * sc);
                        v.push(FP4_E2M1[usize::from(b >> 4)] * sc);
                    }
                }
                map.insert(name.clone(), (vec![rows, full], v));
                continue;
            }
            other => {
                return Err(bad(
                    &name,
                    format!("stored as {other:?}: F8_E4M3 or FP4 (I8 / U8 / F4) weights are read"),
                ))
            }
        };
        if let Some(x) = out.iter().find(|x| x.is_nan()) {
            return Err(bad(&name, format!("an F8_E4M3 NaN ({x})")));
        }
        map.insert(name, (shape, out));
    }
    if let Some(name) = raw.keys().min() {
        return Err(bad(name, "block scales of no quantized weight".into()));
    }
    Ok(())
}
