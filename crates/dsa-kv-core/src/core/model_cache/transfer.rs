//! Moving a windowed model's prefix between engines (P/D disaggregation), by role:
//!
//! * **Moved:** the compressed life cycle's whole blocks (compressed KV and indexer keys
//!   of every layer, with their chained keys), and at the last moved block boundary `E`
//!   the window life cycles' **tail**: the raw-window pages covering `[E − 128, E)` and
//!   the ratio-4 state page `[E − 4, E)` (the ratio-128 state carries nothing across a
//!   boundary). These are exactly what a request resuming at `E` reads from before `E`.
//! * **Recomputed:** everything after `E` (less than a block of the prompt, plus any
//!   positions past the exporter's deepest tail): the importer runs them as a prefill
//!   resumed at `E`. Re-prefilling the window itself would not be bit-exact (its rows
//!   depend on every earlier position through attention), so it is moved, never
//!   recomputed.
//!
//! The exporter pins what it offers ([`export_prefix`](ModelCache::export_prefix): the block
//! manager's export pins the blocks, and a ring adopting the tail holds its pages) until
//! [`close_prefix_export`](ModelCache::close_prefix_export). The importer reserves fresh block
//! pages and fresh tail pages ([`begin_prefix_import`](ModelCache::begin_prefix_import)); the
//! transport writes them; [`commit_prefix_import`](ModelCache::commit_prefix_import) links the
//! blocks into the prefix tree and the tail at `E` (a later request for the prompt then
//! resumes at `E`), or [`abort_prefix_import`](ModelCache::abort_prefix_import) frees them with
//! nothing linked. Both sides' slots are valid only after the steps that wrote them
//! completed (the exporter offers only blocks whose bytes are in place).

use super::window::WindowKind;
use super::ModelCache;
use crate::core::manager::KvCacheManager;
use crate::core::manager::SeqHandle;
use crate::core::transfer::BlockLoc;
use crate::core::{BlockKey, KvError, ReuseScope};
use crate::ids::{RequestId, SlotId, TokenId};

/// What moves: whole blocks and, at their last boundary, the windows' tail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixPages {
    /// Leading blocks the importer already holds (not moved; 0 on an export).
    pub skipped: u32,
    /// The blocks to move (pages of the compressed life cycle), in prefix order, after
    /// the skipped ones.
    pub blocks: Vec<BlockLoc>,
    /// The block boundary the tail belongs to: the tokens the transfer covers.
    pub boundary: u64,
    /// Per window life cycle (the manager's `lc` order): the tail's first position and
    /// its slots, in position order. Empty on an import when the importer already keeps
    /// a tail at the boundary (nothing of the windows moves).
    pub tails: Vec<(u64, Vec<SlotId>)>,
}

/// An export or import in flight.
#[derive(Debug)]
pub(crate) enum Transfer {
    Export {
        handle: SeqHandle,
    },
    Import {
        handle: SeqHandle,
        boundary: u64,
        key: BlockKey,
    },
}

impl ModelCache {
    fn transfer_error(id: RequestId, why: impl Into<String>) -> KvError {
        KvError::Transfer {
            id,
            why: why.into(),
        }
    }

    /// The block manager and the window kind, for a transfer `id` (refused without
    /// windows: a model without them moves blocks through the scheduler's transfers).
    fn window_parts(
        &mut self,
        id: RequestId,
    ) -> Result<(&mut KvCacheManager, &mut WindowKind), KvError> {
        match self.window.as_deref_mut() {
            Some(w) => Ok((&mut self.blocks, w)),
            None => Err(Self::transfer_error(
                id,
                "prefix transfers with window tails need a model with sliding windows: \
                 move blocks through the scheduler's transfers",
            )),
        }
    }

    fn window_tables(w: &WindowKind, id: RequestId) -> Result<Vec<(u64, Vec<SlotId>)>, KvError> {
        let mut out = Vec::new();
        w.tables_into(id, &mut out)?;
        Ok(out)
    }

    /// Offers the prefix of `tokens` this engine can move: its cached whole blocks up to
    /// the deepest boundary that keeps a tail, pinned with that tail until
    /// [`close_prefix_export`](Self::close_prefix_export). `Ok(None)` (nothing pinned) when no such
    /// boundary is cached: the importer prefills the prompt itself.
    pub fn export_prefix(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<PrefixPages>, KvError> {
        let (blocks, w) = self.window_parts(id)?;
        if w.taken(id) {
            return Err(KvError::DuplicateRequest { id });
        }
        let t = w.block_tokens() as usize;
        let whole = tokens.len() / t * t;
        if whole == 0 {
            return Ok(None);
        }
        // Only the blocks up to the deepest boundary with a tail are pinned.
        let keys = blocks.block_keys(scope, &tokens[..whole]);
        let deepest = w.deepest_tail(&keys);
        if deepest == 0 {
            return Ok(None);
        }
        let (mut handle, locs) = blocks.export_blocks(id, scope, &tokens[..deepest * t])?;
        // Fewer may be in place (a block still to be copied between tiers).
        let placed: Vec<BlockKey> = locs.iter().map(|l| l.key).collect();
        let hit = w.deepest_tail(&placed);
        if hit == 0 {
            blocks.close(&mut handle)?;
            w.sync(blocks);
            return Ok(None);
        }
        // A ring adopting the tail holds its pages while the transfer reads them.
        if let Err(e) = w.cache.open(id, Some(&locs[hit - 1].key)) {
            blocks.close(&mut handle)?;
            return Err(e.into());
        }
        let tails = Self::window_tables(w, id)?;
        w.transfers.insert(id, Transfer::Export { handle });
        w.sync(blocks);
        Ok(Some(PrefixPages {
            skipped: 0,
            blocks: locs[..hit].to_vec(),
            boundary: (hit * t) as u64,
            tails,
        }))
    }

    /// Releases an export's pins.
    pub fn close_prefix_export(&mut self, id: RequestId) -> Result<(), KvError> {
        self.end_transfer(id, true)
    }

    /// Closes transfer `id` (an export when `export`, else an import) with nothing
    /// linked: its rings and its block sequence go, and with them its pins or its
    /// reserved pages. The other kind is refused, and stays open.
    fn end_transfer(&mut self, id: RequestId, export: bool) -> Result<(), KvError> {
        let (blocks, w) = self.window_parts(id)?;
        let mut handle = match w.transfers.remove(&id) {
            Some(Transfer::Export { handle }) if export => handle,
            Some(Transfer::Import { handle, .. }) if !export => handle,
            Some(other) => {
                w.transfers.insert(id, other);
                return Err(Self::transfer_error(
                    id,
                    if export {
                        "close_prefix_export on an import: use commit_prefix_import or \
                         abort_prefix_import"
                    } else {
                        "abort_prefix_import on an export: use close_prefix_export"
                    },
                ));
            }
            None => return Err(KvError::UnknownRequest { id }),
        };
        let issued = blocks.issued_fence();
        w.cache.close(id, issued)?;
        blocks.close(&mut handle)?;
        w.sync(blocks);
        Ok(())
    }

    /// Reserves pages for importing the whole blocks of `tokens` (a multiple of 256
    /// tokens: the exporter's `boundary`) and their tail: leading blocks cached here are
    /// skipped, the others get fresh GPU pages; the tail gets fresh window pages unless a
    /// tail is kept here at the boundary already. `Ok(None)`, nothing reserved, when the
    /// GPU or the windows have no room now.
    pub fn begin_prefix_import(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<PrefixPages>, KvError> {
        let (blocks, w) = self.window_parts(id)?;
        if w.taken(id) {
            return Err(KvError::DuplicateRequest { id });
        }
        let boundary = tokens.len() as u64;
        let Some(mut imp) = blocks.begin_import(id, scope, tokens)? else {
            w.sync(blocks);
            return Ok(None);
        };
        let key = *blocks
            .block_keys(scope, tokens)
            .last()
            .expect("invariant: begin_import took at least one whole block");
        let fresh_tail = !w.cache.has_tail(&key);
        let (completed, issued) = (blocks.completed_fence(), blocks.issued_fence());
        let opened = if fresh_tail {
            w.cache.open_at(id, boundary).and_then(|()| {
                // Fresh pages must be writable at once: slots a step in flight may still
                // read (released behind a fence not yet completed) are refused, as the
                // block half refuses them; it fits after that step completed.
                let ok = w.cache.ensure(id, boundary, completed, issued)?
                    && w.cache.wait_for(id)? <= completed;
                if !ok {
                    w.cache.close(id, issued)?;
                }
                Ok(ok)
            })
        } else {
            // Held while the import lasts; nothing of the windows moves.
            w.cache.open(id, Some(&key)).map(|_| true)
        };
        match opened {
            Ok(true) => {}
            Ok(false) => {
                blocks.close(&mut imp.handle)?;
                w.sync(blocks);
                return Ok(None);
            }
            Err(e) => {
                blocks.close(&mut imp.handle)?;
                w.sync(blocks);
                return Err(e.into());
            }
        }
        let tails = if fresh_tail {
            Self::window_tables(w, id)?
        } else {
            Vec::new()
        };
        w.transfers.insert(
            id,
            Transfer::Import {
                handle: imp.handle,
                boundary,
                key,
            },
        );
        w.sync(blocks);
        Ok(Some(PrefixPages {
            skipped: imp.skipped,
            blocks: imp.blocks,
            boundary,
            tails,
        }))
    }

    /// Links an import whose bytes have landed: its blocks enter the prefix tree, its
    /// tail is kept at the boundary, and the reservation closes. `tokens`: those given
    /// to [`begin_prefix_import`](Self::begin_prefix_import) (the block manager refuses others, and the
    /// import stays open).
    pub fn commit_prefix_import(
        &mut self,
        id: RequestId,
        tokens: &[TokenId],
    ) -> Result<(), KvError> {
        let (blocks, w) = self.window_parts(id)?;
        let t = w.block_tokens();
        let Some(Transfer::Import {
            handle,
            boundary,
            key,
        }) = w.transfers.get_mut(&id)
        else {
            return Err(Self::transfer_error(
                id,
                "commit_prefix_import without an import in flight",
            ));
        };
        // Linked in either case: a tail kept here is only touched; one evicted while the
        // import held its pages is linked again from them.
        let links = [(*boundary, *key)];
        // What the windows would refuse is refused before the blocks change.
        w.cache.check_commit(id, *boundary, &links, t)?;
        blocks.commit_import(handle, tokens)?;
        w.transfers.remove(&id);
        let issued = blocks.issued_fence();
        w.cache.commit(id, links[0].0, &links, t, issued)?;
        w.cache.close(id, issued)?;
        w.sync(blocks);
        Ok(())
    }

    /// Gives an import's pages back with nothing linked (a failed or cancelled
    /// transfer).
    pub fn abort_prefix_import(&mut self, id: RequestId) -> Result<(), KvError> {
        self.end_transfer(id, false)
    }
}
