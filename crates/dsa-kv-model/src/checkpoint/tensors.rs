//! The checkpoint's tensors: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` names, read with the `safetensors` crate and widened
//! to f32 (F32, BF16 and F16 tensors; quantized checkpoints are refused), integer
//! tensors (I64, I32: DeepSeek-V4's token → expert tables) kept as integers. Each tensor
//! is taken once, with its shape checked; what no layer took is reported.

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
                let data =
                    widen(view.dtype(), view.data()).ok_or_else(|| CheckpointError::Tensor {
                        name: name.clone(),
                        what: format!(
                            "stored as {:?}: this loader reads F32, BF16 and F16 tensors \
                             (dequantize an FP8 checkpoint first)",
                            view.dtype()
                        ),
                    })?;
                if ints.contains_key(&name)
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
        Ok(Tensors { map, ints })
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
