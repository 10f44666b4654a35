//! DeepSeek-V4's cache bytes (the plan in ARCHITECTURE.md): what one 256-token block of
//! the full life cycle costs (the ratio-4 layers' compressed KV and indexer keys, the
//! ratio-128 layers' compressed KV), and the fixed cost of a decoding request's window
//! life cycles (every layer's raw window, the compressors' fp32 state), page by page.

use crate::config::{IndexerDtype, V4Spec, V4_BLOCK_TOKENS, V4_WINDOW_PAGE_TOKENS};
use crate::layout::{IndexerPageLayout, Model1PageLayout, INDEXER_SCALE_BYTES};

/// Compressor state bytes per token slot: a ratio-4 layer's main compressor (two
/// overlapping series of `[kv | score]`, 512 wide, f32), its indexer's (128 wide), a
/// ratio-128 layer's (one series).
const C4_STATE: u64 = 2 * 2 * 512 * 4;
const C4_INDEXER_STATE: u64 = 2 * 2 * 128 * 4;
const C128_STATE: u64 = 2 * 512 * 4;
/// Tokens per page of the ratio-4 and ratio-128 compressor states, and the tokens each
/// keeps (`2 · ratio` and `ratio`).
const C4_STATE_PAGE: u64 = 4;
const C128_STATE_PAGE: u64 = 8;
const C4_STATE_WINDOW: u64 = 8;

/// The full life cycle's bytes per 256-token block.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct V4BlockBytes {
    /// The ratio-4 layers' compressed KV (a 64-entry MODEL1 page each).
    pub compressed4: u64,
    /// Their indexer keys (a 64-entry indexer page each).
    pub indexer: u64,
    /// The ratio-128 layers' compressed KV (a 2-entry MODEL1 page each).
    pub compressed128: u64,
}

impl V4BlockBytes {
    /// The bytes of `spec`'s full life cycle per block.
    pub fn of(spec: &V4Spec) -> V4BlockBytes {
        let (_, c4, c128) = spec.layer_counts();
        let block = u64::from(V4_BLOCK_TOKENS);
        let c4_page = Model1PageLayout {
            entries: (block / 4) as u32,
        };
        let c128_page = Model1PageLayout {
            entries: (block / 128) as u32,
        };
        let indexer_page = IndexerPageLayout {
            tokens_per_block: (block / 4) as u32,
            data_bytes: match spec.indexer_dtype {
                IndexerDtype::Fp8 => 128,
                IndexerDtype::Fp4 => 64,
            },
            scale_bytes: INDEXER_SCALE_BYTES,
        };
        V4BlockBytes {
            compressed4: c4 as u64 * c4_page.page_bytes(),
            indexer: c4 as u64 * indexer_page.page_bytes(),
            compressed128: c128 as u64 * c128_page.page_bytes(),
        }
    }

    /// All of it.
    pub fn total(&self) -> u64 {
        self.compressed4 + self.indexer + self.compressed128
    }
}

/// The window life cycles' bytes a decoding request holds at most: the pages covering
/// each window's span (window + drafts + the step's new tokens − 1 tokens, at any page
/// alignment).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct V4WindowBytes {
    /// Every layer's raw window (the MTP layers' too), 64-token MODEL1 pages.
    pub window: u64,
    /// The ratio-4 layers' compressor states (main and indexer), 4-token pages.
    pub state4: u64,
    /// The ratio-128 layers' compressor state, 8-token pages.
    pub state128: u64,
    /// The MTP layer's target input (BF16 `mtp_input_width` values), 1-token pages over
    /// the last 2 positions (0 without it).
    pub mtp_input: u64,
}

/// Pages of `page` tokens that a span of `span` consecutive tokens may touch.
pub(crate) fn pages_touched(span: u64, page: u64) -> u64 {
    (span.saturating_sub(1)).div_ceil(page) + 1
}

impl V4WindowBytes {
    /// The fixed cost of one request of `spec` decoding `new_tokens` per step with
    /// `drafts` draft tokens kept for rollback.
    pub fn of(spec: &V4Spec, drafts: u32, new_tokens: u32) -> V4WindowBytes {
        let (_, c4, c128) = spec.layer_counts();
        let layers = spec.compress_ratios.len() as u64 + u64::from(spec.num_mtp_layers);
        let extra = u64::from(drafts) + u64::from(new_tokens.max(1)) - 1;
        let window_page = Model1PageLayout {
            entries: V4_WINDOW_PAGE_TOKENS,
        };
        let window_pages = pages_touched(
            u64::from(spec.window) + extra,
            u64::from(V4_WINDOW_PAGE_TOKENS),
        );
        let s4_pages = pages_touched(C4_STATE_WINDOW + extra, C4_STATE_PAGE);
        let s128_pages = pages_touched(128 + extra, C128_STATE_PAGE);
        V4WindowBytes {
            window: layers * window_pages * window_page.page_bytes(),
            state4: c4 as u64 * s4_pages * C4_STATE_PAGE * (C4_STATE + C4_INDEXER_STATE),
            state128: c128 as u64 * s128_pages * C128_STATE_PAGE * C128_STATE,
            mtp_input: if spec.num_mtp_layers > 0 {
                pages_touched(2 + extra, 1) * 2 * u64::from(spec.mtp_input_width)
            } else {
                0
            },
        }
    }

    /// All of it.
    pub fn total(&self) -> u64 {
        self.window + self.state4 + self.state128 + self.mtp_input
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worked by hand: a ratio-4 layer's block is a 64-entry MODEL1 page (64 · 584 =
    /// 37,376, padded to 37,440) and a 64-entry FP8 indexer page (64 · 132 = 8,448; 4,352
    /// in MXFP4); a ratio-128 layer's, a 2-entry page (1,168 → 1,728). Flash: 21 · 45,888 +
    /// 20 · 1,728 = 998,208 (3,899.25 per token); Pro: 30 · 45,888 + 31 · 1,728 =
    /// 1,430,208.
    #[test]
    fn a_blocks_bytes() {
        let f = V4BlockBytes::of(&V4Spec::flash());
        assert_eq!(
            (f.compressed4, f.indexer, f.compressed128),
            (21 * 37_440, 21 * 8_448, 20 * 1_728)
        );
        assert_eq!(f.total(), 998_208);
        let fp4 = V4Spec {
            indexer_dtype: IndexerDtype::Fp4,
            ..V4Spec::flash()
        };
        assert_eq!(V4BlockBytes::of(&fp4).total(), 912_192);
        assert_eq!(V4BlockBytes::of(&V4Spec::pro()).total(), 1_430_208);
    }

    /// Worked by hand, one token per step, no drafts: a window of 128 touches 3 pages of
    /// 64 (37,440 each: 112,320 per layer, 44 layers in Flash with the MTP layer); the
    /// ratio-4 state (window 8) 3 pages of 4 tokens at 8,192 + 2,048 B a token (122,880
    /// per layer); the ratio-128 state (window 128) 17 pages of 8 tokens at 4,096 B a
    /// token (557,056 per layer). Flash: 4,942,080 + 2,580,480 + 11,141,120 =
    /// 18,663,680; Pro (62 window layers, 30 and 31): 27,918,976.
    #[test]
    fn a_decoding_requests_window_bytes() {
        let f = V4WindowBytes::of(&V4Spec::flash(), 0, 1);
        assert_eq!(
            (f.window, f.state4, f.state128),
            (4_942_080, 2_580_480, 11_141_120)
        );
        assert_eq!(f.total(), 18_663_680);
        assert_eq!(V4WindowBytes::of(&V4Spec::pro(), 0, 1).total(), 27_918_976);
        // Three drafts kept: the window spans 131 tokens (4 pages of 64), the ratio-4
        // state 11 (4 pages of 4), the ratio-128 state 131 (18 pages of 8).
        let d = V4WindowBytes::of(&V4Spec::flash(), 3, 1);
        assert_eq!(d.window, 44 * 4 * 37_440);
        assert_eq!(d.state4, 21 * 4 * 4 * (8_192 + 2_048));
        assert_eq!(d.state128, 20 * 18 * 8 * 4_096);
        assert_eq!(pages_touched(1, 4), 1);
        assert_eq!(pages_touched(5, 4), 2);
    }
}
