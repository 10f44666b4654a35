//! The DeepSeek-V4 pool plan. Up to five life cycles, each its own slot space (pool group):
//!
//! | life cycle | retention | tokens per page (slot) | buffers |
//! |---|---|---|---|
//! | `Compressed` | full (blocks, prefix reuse) | 256 | ratio-4 layers' compressed KV (64 MODEL1 entries) and indexer keys (64 entries), ratio-128 layers' compressed KV (2 entries) |
//! | `Window` | the last `window` tokens | 64 | every layer's raw window KV (MODEL1 rows), the MTP layers' too |
//! | `State4` | the last 8 tokens | 4 | ratio-4 layers' compressor state and their indexer's compressor state (fp32) |
//! | `State128` | the last 128 tokens | 8 | ratio-128 layers' compressor state (fp32) |
//! | `MtpInput` | the last 2 tokens | 1 | the MTP layer's target input (BF16 residual streams), when the spec has one |
//!
//! A life cycle without buffers (a model with no ratio-128 layer has no `State128`) is
//! left out; ids count the ones present, in the order above. Inside a life cycle buffers
//! with equal page bytes coalesce into one pool (largest slot first), and a buffer's page
//! for slot `s` is `s × scale + layer_offset`, the V2 converter (expansion 1).
//!
//! Layers: the target layers `0..n` in `compress_ratios` order, then the MTP layers
//! `n..n+m` (window only).

use serde::Serialize;

use super::super::{
    BufferSpec, IndexerPageLayout, LayerSpec, LifeCycleKey, Model1PageLayout, PageIndexConverter,
    PoolPlan, Role, RowLayout, INDEXER_SCALE_BYTES,
};
use crate::config::{
    IndexerDtype, V4Error, V4LayerKind, V4Spec, V4_BLOCK_TOKENS, V4_WINDOW_PAGE_TOKENS,
};
use crate::ids::{LayerId, LifeCycleId, PageIndex, PoolId, SlotId};

/// The compressed latent's width (448 NoPE + 64 RoPE) and the indexer key's.
const LATENT_WIDTH: u32 = 512;
const INDEXER_WIDTH: u32 = 128;
/// Tokens per page of the compressor states: ratio 4, ratio 128.
const STATE4_PAGE_TOKENS: u32 = 4;
const STATE128_PAGE_TOKENS: u32 = 8;

/// The bytes of one token's compressor-state row: per series a `[kv | score]` pair of
/// `width` f32 values; an overlapping compressor (ratio 4) keeps two series.
const fn state_row_bytes(width: u32, series: u32) -> u32 {
    series * 2 * width * 4
}

/// How long a life cycle keeps a sequence's pages.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Retention {
    /// Every page, for the sequence's life; committed blocks are shared through the
    /// prefix tree.
    Full,
    /// Only the pages holding the last `tokens` positions up to the newest query (plus,
    /// while drafts may roll back, the draft positions).
    Window {
        /// Positions kept, the newest included.
        tokens: u32,
    },
}

/// The kinds of life cycle.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum V4LifeCycleKind {
    /// The compressed KV and indexer keys: 256-token blocks, kept and reused.
    Compressed,
    /// The raw sliding window of every layer.
    Window,
    /// The ratio-4 compressors' state.
    State4,
    /// The ratio-128 compressors' state.
    State128,
    /// What the MTP layer reads of the target at the position before its row's token.
    MtpInput,
}

impl V4LifeCycleKind {
    /// A short name.
    pub fn name(self) -> &'static str {
        match self {
            V4LifeCycleKind::Compressed => "compressed",
            V4LifeCycleKind::Window => "window",
            V4LifeCycleKind::State4 => "state4",
            V4LifeCycleKind::State128 => "state128",
            V4LifeCycleKind::MtpInput => "mtp_input",
        }
    }
}

/// How one page of a buffer holds its rows.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum V4PageFormat {
    /// MODEL1 rows (584 B: 448 e4m3, 64 bf16, 8 UE8M0 scale bytes), data rows first, then
    /// scale rows, the page padded to a multiple of 576 B; one row per
    /// `tokens_per_entry` tokens (1 for the window).
    Model1 {
        /// The page.
        page: Model1PageLayout,
        /// Tokens that one row stands for.
        tokens_per_entry: u32,
    },
    /// Indexer keys of compressed entries: every entry's payload, then every scale word.
    IndexKeys {
        /// The page.
        page: IndexerPageLayout,
        /// Tokens that one entry stands for.
        tokens_per_entry: u32,
    },
    /// One state row per token (a compressor's fp32 values; the MTP input's BF16).
    State {
        /// Bytes per row.
        row_bytes: u32,
        /// Rows per page.
        tokens: u32,
    },
}

impl V4PageFormat {
    /// Bytes per page, padding included.
    pub fn page_bytes(&self) -> u64 {
        match *self {
            V4PageFormat::Model1 { page, .. } => page.page_bytes(),
            V4PageFormat::IndexKeys { page, .. } => page.page_bytes(),
            V4PageFormat::State { row_bytes, tokens } => u64::from(row_bytes) * u64::from(tokens),
        }
    }

    /// The same rows as a [`RowLayout`] (the state rows are interleaved).
    pub fn row(&self) -> RowLayout {
        match *self {
            V4PageFormat::Model1 {
                tokens_per_entry, ..
            } => RowLayout::Model1 { tokens_per_entry },
            V4PageFormat::IndexKeys {
                page,
                tokens_per_entry,
            } => RowLayout::EntryValuesThenScales {
                data_bytes: page.data_bytes,
                scale_bytes: page.scale_bytes,
                tokens_per_entry,
            },
            V4PageFormat::State { row_bytes, .. } => RowLayout::Interleaved { row_bytes },
        }
    }

    /// Rows per page.
    pub fn entries(&self) -> u32 {
        match *self {
            V4PageFormat::Model1 { page, .. } => page.entries,
            V4PageFormat::IndexKeys { page, .. } => page.tokens_per_block,
            V4PageFormat::State { tokens, .. } => tokens,
        }
    }

    /// Tokens one row stands for.
    pub fn tokens_per_entry(&self) -> u32 {
        match *self {
            V4PageFormat::Model1 {
                tokens_per_entry, ..
            }
            | V4PageFormat::IndexKeys {
                tokens_per_entry, ..
            } => tokens_per_entry,
            V4PageFormat::State { .. } => 1,
        }
    }
}

/// Where one (layer, role) buffer lives.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct V4Buffer {
    /// The layer.
    pub layer: LayerId,
    /// The role.
    pub role: Role,
    /// Its life cycle.
    pub life_cycle: LifeCycleId,
    /// Its pool inside the life cycle's group.
    pub pool: PoolId,
    /// The page format.
    pub format: V4PageFormat,
    /// `page = slot × scale + layer_offset`.
    pub converter: PageIndexConverter,
    /// Byte offset of this buffer's page inside a slot of the pool.
    pub offset_in_slot: u64,
}

impl V4Buffer {
    /// Bytes per page.
    pub fn page_bytes(&self) -> u64 {
        self.format.page_bytes()
    }

    /// The page a kernel addresses for `slot`.
    pub fn page_index(&self, slot: SlotId) -> PageIndex {
        self.converter.page_index(slot)
    }

    /// Byte offset inside the pool of this buffer's page for `slot`.
    pub fn page_byte_offset(&self, slot: SlotId) -> u64 {
        u64::from(self.page_index(slot).get()) * self.page_bytes()
    }
}

/// One pool of a life cycle: `pages_per_slot` pages of `page_bytes` per slot.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct V4Pool {
    /// Index inside the life cycle's group.
    pub id: PoolId,
    /// Bytes of one page.
    pub page_bytes: u64,
    /// Buffers (pages) per slot.
    pub pages_per_slot: u32,
}

impl V4Pool {
    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.page_bytes * u64::from(self.pages_per_slot)
    }
}

/// One life cycle: its retention, page size and pools.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct V4LifeCycle {
    /// Its id (its pool group's too).
    pub id: LifeCycleId,
    /// Which caches it holds.
    pub kind: V4LifeCycleKind,
    /// How long a sequence keeps its pages.
    pub retention: Retention,
    /// Tokens per slot.
    pub tokens_per_page: u32,
    /// Positions before a 256-token boundary that a request resuming there reads: the
    /// pages covering them are kept with the block that ends there (its "tail").
    pub tail_tokens: u32,
    /// Pools, largest slot first.
    pub pools: Vec<V4Pool>,
}

impl V4LifeCycle {
    /// Bytes of one slot in every pool.
    pub fn slot_bytes(&self) -> u64 {
        self.pools.iter().map(V4Pool::slot_bytes).sum()
    }

    /// Pages covering the `tail_tokens` positions before a block boundary (0 or more;
    /// the boundary is a multiple of every page size).
    pub fn tail_pages(&self) -> u64 {
        u64::from(self.tail_tokens).div_ceil(u64::from(self.tokens_per_page))
    }

    /// Slots one request holds at most in this life cycle while it decodes with `drafts`
    /// draft positions kept and `new_tokens` positions written per step (any page
    /// alignment). A full life cycle: `None` (it grows with the context).
    pub fn window_pages(&self, drafts: u32, new_tokens: u32) -> Option<u64> {
        match self.retention {
            Retention::Full => None,
            Retention::Window { tokens } => Some(super::pages_touched(
                u64::from(tokens) + u64::from(drafts) + u64::from(new_tokens.max(1)) - 1,
                u64::from(self.tokens_per_page),
            )),
        }
    }
}

/// A DeepSeek-V4 model's pools.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct V4Plan {
    spec: V4Spec,
    life_cycles: Vec<V4LifeCycle>,
    /// Sorted by (layer, role).
    buffers: Vec<V4Buffer>,
    /// The compressed life cycle's V2 plan (what the block manager allocates).
    compressed: Option<PoolPlan>,
}

/// A buffer before placement.
struct Wanted {
    layer: LayerId,
    role: Role,
    kind: V4LifeCycleKind,
    format: V4PageFormat,
}

impl V4Plan {
    /// Plans `spec`'s pools.
    pub fn new(spec: &V4Spec) -> Result<V4Plan, V4Error> {
        spec.validate()?;
        let block = V4_BLOCK_TOKENS;
        let indexer_data = match spec.indexer_dtype {
            IndexerDtype::Fp8 => INDEXER_WIDTH,
            IndexerDtype::Fp4 => INDEXER_WIDTH / 2,
        };
        let mut wanted = Vec::new();
        let n_target = spec.compress_ratios.len();
        let n_layers = n_target + spec.num_mtp_layers as usize;
        for l in 0..n_layers {
            let layer = LayerId(l as u32);
            let mut want = |role, kind, format| {
                wanted.push(Wanted {
                    layer,
                    role,
                    kind,
                    format,
                })
            };
            want(
                Role::WindowKey,
                V4LifeCycleKind::Window,
                V4PageFormat::Model1 {
                    page: Model1PageLayout {
                        entries: V4_WINDOW_PAGE_TOKENS,
                    },
                    tokens_per_entry: 1,
                },
            );
            if l == n_target && spec.mtp_input_width > 0 {
                want(
                    Role::MtpInput,
                    V4LifeCycleKind::MtpInput,
                    V4PageFormat::State {
                        row_bytes: 2 * spec.mtp_input_width,
                        tokens: 1,
                    },
                );
            }
            match spec.layer_kind(l) {
                None | Some(V4LayerKind::WindowOnly) => {}
                Some(V4LayerKind::Compressed4) => {
                    want(
                        Role::CompressedKey,
                        V4LifeCycleKind::Compressed,
                        V4PageFormat::Model1 {
                            page: Model1PageLayout { entries: block / 4 },
                            tokens_per_entry: 4,
                        },
                    );
                    want(
                        Role::CompressedIndexKey,
                        V4LifeCycleKind::Compressed,
                        V4PageFormat::IndexKeys {
                            page: IndexerPageLayout {
                                tokens_per_block: block / 4,
                                data_bytes: indexer_data,
                                scale_bytes: INDEXER_SCALE_BYTES,
                            },
                            tokens_per_entry: 4,
                        },
                    );
                    want(
                        Role::CompressorState,
                        V4LifeCycleKind::State4,
                        V4PageFormat::State {
                            row_bytes: state_row_bytes(LATENT_WIDTH, 2),
                            tokens: STATE4_PAGE_TOKENS,
                        },
                    );
                    want(
                        Role::IndexerCompressorState,
                        V4LifeCycleKind::State4,
                        V4PageFormat::State {
                            row_bytes: state_row_bytes(INDEXER_WIDTH, 2),
                            tokens: STATE4_PAGE_TOKENS,
                        },
                    );
                }
                Some(V4LayerKind::Compressed128) => {
                    want(
                        Role::CompressedKey,
                        V4LifeCycleKind::Compressed,
                        V4PageFormat::Model1 {
                            page: Model1PageLayout {
                                entries: block / 128,
                            },
                            tokens_per_entry: 128,
                        },
                    );
                    want(
                        Role::CompressorState,
                        V4LifeCycleKind::State128,
                        V4PageFormat::State {
                            row_bytes: state_row_bytes(LATENT_WIDTH, 1),
                            tokens: STATE128_PAGE_TOKENS,
                        },
                    );
                }
            }
        }

        let kinds = [
            (V4LifeCycleKind::Compressed, Retention::Full, block, 0),
            (
                V4LifeCycleKind::Window,
                Retention::Window {
                    tokens: spec.window,
                },
                V4_WINDOW_PAGE_TOKENS,
                // A query at the boundary reads the `window − 1` positions before it.
                spec.window - 1,
            ),
            (
                V4LifeCycleKind::State4,
                Retention::Window {
                    tokens: 2 * STATE4_PAGE_TOKENS,
                },
                STATE4_PAGE_TOKENS,
                // The next entry pools the previous group's first half: 4 positions.
                4,
            ),
            (
                V4LifeCycleKind::State128,
                Retention::Window { tokens: 128 },
                STATE128_PAGE_TOKENS,
                // A boundary closes every 128-token group: nothing is carried.
                0,
            ),
            (
                V4LifeCycleKind::MtpInput,
                // The MTP row of the token at `q` reads the target's streams at `q − 1`.
                Retention::Window { tokens: 2 },
                1,
                1,
            ),
        ];
        let mut life_cycles = Vec::new();
        let mut buffers = Vec::new();
        let mut compressed = None;
        for (kind, retention, tokens_per_page, tail_tokens) in kinds {
            // Each life cycle is one V2 plan of its own page size: the V2 planner
            // coalesces equal pages into pools and gives the converters.
            let mut specs: Vec<LayerSpec> = Vec::new();
            for w in wanted.iter().filter(|w| w.kind == kind) {
                let buffer = BufferSpec::new(w.role, w.format.row());
                match specs.last_mut() {
                    Some(s) if s.layer == w.layer => s.buffers.push(buffer),
                    _ => specs.push(LayerSpec {
                        layer: w.layer,
                        life_cycle: LifeCycleKey(0),
                        buffers: vec![buffer],
                    }),
                }
            }
            if specs.is_empty() {
                continue;
            }
            let id = LifeCycleId(life_cycles.len() as u16);
            let plan = PoolPlan::v2(tokens_per_page, specs)
                .expect("invariant: a validated V4 spec gives valid buffers");
            let mut pools: Vec<V4Pool> = plan.pool_groups()[0]
                .pools
                .iter()
                .map(|p| V4Pool {
                    id: p.id,
                    page_bytes: 0,
                    pages_per_slot: 0,
                })
                .collect();
            for pl in plan.placements() {
                let w = wanted
                    .iter()
                    .find(|w| w.kind == kind && (w.layer, w.role) == (pl.layer, pl.role))
                    .expect("invariant: every placement is a wanted buffer");
                let pool = &mut pools[pl.pool.index()];
                pool.page_bytes = pl.page_stride;
                pool.pages_per_slot = pl.converter.scale;
                buffers.push(V4Buffer {
                    layer: pl.layer,
                    role: pl.role,
                    life_cycle: id,
                    pool: pl.pool,
                    format: w.format,
                    converter: pl.converter,
                    offset_in_slot: pl.offset_in_slot,
                });
            }
            if retention == Retention::Full {
                compressed = Some(plan);
            }
            life_cycles.push(V4LifeCycle {
                id,
                kind,
                retention,
                tokens_per_page,
                tail_tokens,
                pools,
            });
        }
        buffers.sort_by_key(|b| (b.layer, b.role));
        Ok(V4Plan {
            spec: spec.clone(),
            life_cycles,
            buffers,
            compressed,
        })
    }

    /// The model.
    pub fn spec(&self) -> &V4Spec {
        &self.spec
    }

    /// Tokens of a logical block (the prefix-reuse unit: 256).
    pub fn tokens_per_block(&self) -> u32 {
        V4_BLOCK_TOKENS
    }

    /// Layers (target, then MTP).
    pub fn num_layers(&self) -> usize {
        self.spec.compress_ratios.len() + self.spec.num_mtp_layers as usize
    }

    /// The life cycles present, by id.
    pub fn life_cycles(&self) -> &[V4LifeCycle] {
        &self.life_cycles
    }

    /// The life cycle of `kind`, if the model has one.
    pub fn life_cycle(&self, kind: V4LifeCycleKind) -> Option<&V4LifeCycle> {
        self.life_cycles.iter().find(|l| l.kind == kind)
    }

    /// Every buffer, by (layer, role).
    pub fn buffers(&self) -> &[V4Buffer] {
        &self.buffers
    }

    /// The buffer of (layer, role).
    pub fn buffer(&self, layer: LayerId, role: Role) -> Option<&V4Buffer> {
        self.buffers
            .binary_search_by_key(&(layer, role), |b| (b.layer, b.role))
            .ok()
            .map(|i| &self.buffers[i])
    }

    /// Bytes of one 256-token block of the full life cycle (every compressed cache).
    pub fn bytes_per_block(&self) -> u64 {
        self.life_cycles
            .iter()
            .filter(|l| l.retention == Retention::Full)
            .map(V4LifeCycle::slot_bytes)
            .sum()
    }

    /// The window life cycles' bytes one request holds at most while it decodes with
    /// `drafts` draft positions kept and `new_tokens` positions per step.
    pub fn window_bytes_per_request(&self, drafts: u32, new_tokens: u32) -> u64 {
        self.life_cycles
            .iter()
            .filter_map(|l| {
                l.window_pages(drafts, new_tokens)
                    .map(|p| p * l.slot_bytes())
            })
            .sum()
    }

    /// The compressed life cycle as a [`PoolPlan`] (one life cycle, 256-token blocks,
    /// the same pools and converters as this plan's): what the block manager allocates,
    /// reuses and evicts. `None` for a model without compressed layers.
    pub fn compressed_pool_plan(&self) -> Option<PoolPlan> {
        self.compressed.clone()
    }

    /// The bytes the tails of one retained block boundary keep (the window pages a
    /// request resuming there reads).
    pub fn tail_bytes(&self) -> u64 {
        self.life_cycles
            .iter()
            .map(|l| l.tail_pages() * l.slot_bytes())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{V4BlockBytes, V4WindowBytes};
    use super::*;

    fn kinds(p: &V4Plan) -> Vec<V4LifeCycleKind> {
        p.life_cycles().iter().map(|l| l.kind).collect()
    }

    /// The planner's bytes equal the hand-worked ones of `V4BlockBytes` and
    /// `V4WindowBytes` (computed without the planner) for every preset, indexer dtype,
    /// draft count and step size tried.
    #[test]
    fn the_plan_costs_what_the_hand_worked_bytes_say() {
        let fp4 = V4Spec {
            indexer_dtype: IndexerDtype::Fp4,
            ..V4Spec::flash()
        };
        let mtp_input = V4Spec {
            mtp_input_width: 4 * 7168,
            ..V4Spec::pro()
        };
        for spec in [V4Spec::flash(), V4Spec::pro(), fp4, mtp_input] {
            let p = V4Plan::new(&spec).unwrap();
            assert_eq!(p.bytes_per_block(), V4BlockBytes::of(&spec).total());
            for drafts in 0..4 {
                for new in [1, 2, 4, 64, 300] {
                    assert_eq!(
                        p.window_bytes_per_request(drafts, new),
                        V4WindowBytes::of(&spec, drafts, new).total(),
                        "{} drafts {drafts} new {new}",
                        spec.name
                    );
                }
            }
        }
        let f = V4Plan::new(&V4Spec::flash()).unwrap();
        assert_eq!(f.bytes_per_block(), 998_208);
        assert_eq!(f.window_bytes_per_request(0, 1), 18_663_680);
        assert_eq!(
            V4Plan::new(&V4Spec::pro())
                .unwrap()
                .window_bytes_per_request(0, 1),
            27_918_976
        );
    }

    /// Flash's pools, worked by hand.
    #[test]
    fn flash_pools_and_converters() {
        let p = V4Plan::new(&V4Spec::flash()).unwrap();
        assert_eq!(
            kinds(&p),
            [
                V4LifeCycleKind::Compressed,
                V4LifeCycleKind::Window,
                V4LifeCycleKind::State4,
                V4LifeCycleKind::State128
            ]
        );
        let pools = |k| {
            p.life_cycle(k)
                .unwrap()
                .pools
                .iter()
                .map(|q| (q.page_bytes, q.pages_per_slot))
                .collect::<Vec<_>>()
        };
        // 21 ratio-4 layers: 64-entry MODEL1 pages (37,440) and indexer pages (8,448);
        // 20 ratio-128 layers: 2-entry pages (1,728).
        assert_eq!(
            pools(V4LifeCycleKind::Compressed),
            [(37_440, 21), (8_448, 21), (1_728, 20)]
        );
        // 43 target layers and the MTP layer.
        assert_eq!(pools(V4LifeCycleKind::Window), [(37_440, 44)]);
        assert_eq!(
            pools(V4LifeCycleKind::State4),
            [(4 * 8_192, 21), (4 * 2_048, 21)]
        );
        assert_eq!(pools(V4LifeCycleKind::State128), [(8 * 4_096, 20)]);
        // Layer 2 is the first ratio-4 layer, layer 3 the first ratio-128 layer, layer 4
        // the second ratio-4 layer.
        let ck = |l: u32| *p.buffer(LayerId(l), Role::CompressedKey).unwrap();
        assert_eq!((ck(2).pool, ck(2).converter.layer_offset), (PoolId(0), 0));
        assert_eq!((ck(3).pool, ck(3).converter.layer_offset), (PoolId(2), 0));
        assert_eq!((ck(4).pool, ck(4).converter.layer_offset), (PoolId(0), 1));
        assert_eq!(ck(4).page_index(SlotId(10)), PageIndex(10 * 21 + 1));
        assert_eq!(ck(4).page_byte_offset(SlotId(10)), 211 * 37_440);
        assert_eq!(ck(3).format.entries(), 2);
        assert_eq!(ck(3).format.tokens_per_entry(), 128);
        assert!(p.buffer(LayerId(0), Role::CompressedKey).is_none());
        assert!(p.buffer(LayerId(0), Role::CompressorState).is_none());
        let mtp = p.buffer(LayerId(43), Role::WindowKey).unwrap();
        assert_eq!((mtp.converter.scale, mtp.converter.layer_offset), (44, 43));
        assert!(p.buffer(LayerId(43), Role::CompressedKey).is_none());
        assert!(p.buffer(LayerId(44), Role::WindowKey).is_none());
        // Tails at a boundary: 2 window pages (127 positions), 1 state page of 4 tokens,
        // nothing of the ratio-128 state.
        let tails: Vec<u64> = p
            .life_cycles()
            .iter()
            .map(V4LifeCycle::tail_pages)
            .collect();
        assert_eq!(tails, [0, 2, 1, 0]);
        assert_eq!(p.tail_bytes(), 2 * 44 * 37_440 + 21 * 4 * (8_192 + 2_048));
    }

    /// The block manager's plan of the compressed life cycle has this plan's pools,
    /// converters and page strides, 256-token blocks and the same bytes per block.
    #[test]
    fn the_compressed_pool_plan_agrees() {
        for spec in [V4Spec::flash(), V4Spec::pro()] {
            let p = V4Plan::new(&spec).unwrap();
            let pp = p.compressed_pool_plan().unwrap();
            assert_eq!(pp.tokens_per_block(), 256);
            assert_eq!(pp.bytes_per_block(), p.bytes_per_block());
            let lc = p.life_cycle(V4LifeCycleKind::Compressed).unwrap();
            let slots: Vec<u64> = pp.pool_groups()[0]
                .pools
                .iter()
                .map(|q| q.slot_bytes)
                .collect();
            let want: Vec<u64> = lc.pools.iter().map(V4Pool::slot_bytes).collect();
            assert_eq!(slots, want);
            let mut n = 0;
            for b in p.buffers().iter().filter(|b| b.life_cycle == lc.id) {
                let pl = pp.placement(b.layer, b.role).unwrap();
                assert_eq!(pl.converter, b.converter);
                assert_eq!(pl.pool, b.pool);
                assert_eq!(pl.page_stride, b.page_bytes());
                assert_eq!(pl.offset_in_slot, b.offset_in_slot);
                assert_eq!(pl.tokens_per_page(), 256);
                n += 1;
            }
            assert_eq!(n, pp.placements().len());
        }
        let window_only = V4Spec {
            compress_ratios: vec![0, 0],
            ..V4Spec::flash()
        };
        assert!(V4Plan::new(&window_only)
            .unwrap()
            .compressed_pool_plan()
            .is_none());
    }

    /// Every buffer has one placement, the placements of a pool tile its slot exactly,
    /// and no two buffers share a page.
    #[test]
    fn placements_tile_their_slots() {
        for spec in [V4Spec::flash(), V4Spec::pro()] {
            let p = V4Plan::new(&spec).unwrap();
            for lc in p.life_cycles() {
                for pool in &lc.pools {
                    let mut offsets: Vec<(u32, u64)> = p
                        .buffers()
                        .iter()
                        .filter(|b| b.life_cycle == lc.id && b.pool == pool.id)
                        .map(|b| {
                            assert_eq!(b.page_bytes(), pool.page_bytes);
                            assert_eq!(b.converter.scale, pool.pages_per_slot);
                            (b.converter.layer_offset, b.offset_in_slot)
                        })
                        .collect();
                    offsets.sort();
                    let want: Vec<(u32, u64)> = (0..pool.pages_per_slot)
                        .map(|i| (i, u64::from(i) * pool.page_bytes))
                        .collect();
                    assert_eq!(offsets, want);
                }
            }
        }
    }

    /// A model without ratio-128 layers has no `State128` life cycle; ids stay dense.
    #[test]
    fn absent_caches_leave_no_life_cycle() {
        let spec = V4Spec {
            compress_ratios: vec![0, 4, 4],
            ..V4Spec::flash()
        };
        let p = V4Plan::new(&spec).unwrap();
        assert_eq!(
            kinds(&p),
            [
                V4LifeCycleKind::Compressed,
                V4LifeCycleKind::Window,
                V4LifeCycleKind::State4
            ]
        );
        assert_eq!(p.life_cycles()[2].id, LifeCycleId(2));
        let window_only = V4Spec {
            compress_ratios: vec![0, 0],
            ..V4Spec::flash()
        };
        let w = V4Plan::new(&window_only).unwrap();
        assert_eq!(kinds(&w), [V4LifeCycleKind::Window]);
        assert_eq!(w.bytes_per_block(), 0);
        let bad = V4Spec {
            compress_ratios: vec![4, 3],
            ..V4Spec::flash()
        };
        assert!(V4Plan::new(&bad).is_err());
    }

    /// With the published MTP's target input, a fifth life cycle: one BF16 row of
    /// `hc_mult × hidden` values per position on the first MTP layer, 1-token pages, the
    /// last 2 positions kept and 1 carried over a block boundary (the tail a prefix hit
    /// resumes from); nothing else moves. Too wide an input is refused.
    #[test]
    fn the_mtp_input_is_its_own_life_cycle() {
        let base = V4Plan::new(&V4Spec::flash()).unwrap();
        let spec = V4Spec {
            mtp_input_width: 4 * 4096,
            ..V4Spec::flash()
        };
        let p = V4Plan::new(&spec).unwrap();
        assert_eq!(
            kinds(&p),
            [
                V4LifeCycleKind::Compressed,
                V4LifeCycleKind::Window,
                V4LifeCycleKind::State4,
                V4LifeCycleKind::State128,
                V4LifeCycleKind::MtpInput
            ]
        );
        let lc = p.life_cycle(V4LifeCycleKind::MtpInput).unwrap();
        assert_eq!(lc.id, LifeCycleId(4));
        assert_eq!(lc.retention, Retention::Window { tokens: 2 });
        assert_eq!(
            (lc.tokens_per_page, lc.tail_tokens, lc.tail_pages()),
            (1, 1, 1)
        );
        assert_eq!(lc.slot_bytes(), 32_768);
        let b = p.buffer(LayerId(43), Role::MtpInput).unwrap();
        assert_eq!(b.life_cycle, lc.id);
        assert_eq!(
            b.format,
            V4PageFormat::State {
                row_bytes: 32_768,
                tokens: 1
            }
        );
        // A decode step with 3 drafts holds 2 + 3 positions: 5 pages.
        assert_eq!(lc.window_pages(3, 1), Some(5));
        assert_eq!(p.bytes_per_block(), base.bytes_per_block());
        assert_eq!(
            p.window_bytes_per_request(0, 1),
            base.window_bytes_per_request(0, 1) + 2 * 32_768
        );
        for l in &base.life_cycles()[..4] {
            assert_eq!(p.life_cycles()[l.id.0 as usize], *l);
        }
        // No MTP layer: no input kept.
        let none = V4Spec {
            num_mtp_layers: 0,
            ..spec.clone()
        };
        assert!(V4Plan::new(&none)
            .unwrap()
            .life_cycle(V4LifeCycleKind::MtpInput)
            .is_none());
        let wide = V4Spec {
            mtp_input_width: (1 << 20) + 1,
            ..spec
        };
        assert!(matches!(
            V4Plan::new(&wide),
            Err(V4Error::Field {
                field: "mtp_input_width",
                ..
            })
        ));
    }
}
