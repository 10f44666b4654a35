//! From a [`DsaModel`] to layer specs: every layer registers its MLA key buffer (NVFP4:
//! plus a block-scale buffer), and layers that own an indexer append an `IndexKey`
//! buffer after the standard roles. All layers share one life cycle.

use super::{
    BufferSpec, LayerSpec, LayoutError, LayoutKind, LifeCycleKey, PoolPlan, Role, RowLayout,
};
use crate::config::{DsaModel, KvDtype, LayerSet, DSA_TOKENS_PER_BLOCK};

/// The layer specs of `model` for the layers of `set`.
pub fn layer_specs_for_model(model: &DsaModel, set: LayerSet) -> Vec<LayerSpec> {
    let spec = model.spec();
    let elems = model.mla_row_elems();
    model
        .layers(set)
        .into_iter()
        .map(|layer| {
            let mut buffers = Vec::with_capacity(3);
            match spec.kv_dtype {
                KvDtype::Nvfp4 => {
                    buffers.push(BufferSpec::new(
                        Role::Key,
                        RowLayout::Interleaved {
                            row_bytes: elems / 2,
                        },
                    ));
                    buffers.push(BufferSpec::new(
                        Role::KeyBlockScale,
                        RowLayout::Interleaved {
                            row_bytes: elems / 16,
                        },
                    ));
                }
                _ => buffers.push(BufferSpec::new(
                    Role::Key,
                    RowLayout::Interleaved {
                        row_bytes: model.mla_row_bytes(),
                    },
                )),
            }
            if model.has_indexer(layer) {
                buffers.push(BufferSpec::new(
                    Role::IndexKey,
                    RowLayout::ValuesThenScales {
                        data_bytes: model.indexer_data_bytes(),
                        scale_bytes: model.indexer_scale_bytes(),
                    },
                ));
            }
            LayerSpec {
                layer,
                life_cycle: LifeCycleKey(0),
                buffers,
            }
        })
        .collect()
}

impl PoolPlan {
    /// Plans `model`'s layers of `set` in the chosen layout. DSA requires
    /// `tokens_per_block == 64`.
    pub fn for_model(
        model: &DsaModel,
        set: LayerSet,
        kind: LayoutKind,
        tokens_per_block: u32,
    ) -> Result<PoolPlan, LayoutError> {
        if tokens_per_block != DSA_TOKENS_PER_BLOCK {
            return Err(LayoutError::DsaTokensPerBlock {
                got: tokens_per_block,
            });
        }
        let specs = layer_specs_for_model(model, set);
        if specs.is_empty() {
            return Err(LayoutError::NoLayers);
        }
        match kind {
            LayoutKind::V1 => PoolPlan::v1(tokens_per_block, specs),
            LayoutKind::V2 => PoolPlan::v2(tokens_per_block, specs),
        }
    }
}
