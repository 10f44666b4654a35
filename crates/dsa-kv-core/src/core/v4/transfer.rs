//! Moving a DeepSeek-V4 prefix between engines (P/D disaggregation), by role:
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
//! The exporter pins what it offers ([`export`](V4CacheManager::export): the block
//! manager's export pins the blocks, and a ring adopting the tail holds its pages) until
//! [`close_export`](V4CacheManager::close_export). The importer reserves fresh block
//! pages and fresh tail pages ([`begin_import`](V4CacheManager::begin_import)); the
//! transport writes them; [`commit_import`](V4CacheManager::commit_import) links the
//! blocks into the prefix tree and the tail at `E` (a later request for the prompt then
//! resumes at `E`), or [`abort_import`](V4CacheManager::abort_import) frees them with
//! nothing linked. Both sides' slots are valid only after the steps that wrote them
//! completed (the exporter offers only blocks whose bytes are in place).

use super::{V4CacheManager, V4Error};
use crate::core::manager::SeqHandle;
use crate::core::transfer::BlockLoc;
use crate::core::{BlockKey, KvError, ReuseScope};
use crate::ids::{RequestId, SlotId, TokenId};

/// What moves: whole blocks and, at their last boundary, the windows' tail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V4TransferPages {
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
pub(super) enum Transfer {
    Export {
        handle: SeqHandle,
    },
    Import {
        handle: SeqHandle,
        boundary: u64,
        key: BlockKey,
    },
}

impl V4CacheManager {
    fn transfer_error(id: RequestId, why: impl Into<String>) -> V4Error {
        V4Error::Blocks(KvError::Transfer {
            id,
            why: why.into(),
        })
    }

    fn check_new_transfer(&self, id: RequestId) -> Result<(), V4Error> {
        if self.seqs.contains_key(&id) || self.transfers.contains_key(&id) {
            return Err(KvError::DuplicateRequest { id }.into());
        }
        Ok(())
    }

    fn window_tables(&self, id: RequestId) -> Result<Vec<(u64, Vec<SlotId>)>, V4Error> {
        (0..self.windows.specs().len())
            .map(|lc| Ok(self.windows.page_table(id, lc)?))
            .collect()
    }

    /// Offers the prefix of `tokens` this engine can move: its cached whole blocks up to
    /// the deepest boundary that keeps a tail, pinned with that tail until
    /// [`close_export`](Self::close_export). `Ok(None)` (nothing pinned) when no such
    /// boundary is cached: the importer prefills the prompt itself.
    pub fn export(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<V4TransferPages>, V4Error> {
        self.check_new_transfer(id)?;
        let t = self.block_tokens() as usize;
        let whole = tokens.len() / t * t;
        if whole == 0 {
            return Ok(None);
        }
        // Only the blocks up to the deepest boundary with a tail are pinned.
        let keys = self.blocks.block_keys(scope, &tokens[..whole]);
        let Some(deepest) = (1..=keys.len())
            .rev()
            .find(|&j| self.windows.has_tail(&keys[j - 1]))
        else {
            return Ok(None);
        };
        let (mut handle, blocks) = self
            .blocks
            .export_blocks(id, scope, &tokens[..deepest * t])?;
        // Fewer may be in place (a block still to be copied between tiers).
        let hit = (1..=blocks.len())
            .rev()
            .find(|&j| self.windows.has_tail(&blocks[j - 1].key))
            .unwrap_or(0);
        if hit == 0 {
            self.blocks.close(&mut handle)?;
            self.sync_events();
            return Ok(None);
        }
        // A ring adopting the tail holds its pages while the transfer reads them.
        if let Err(e) = self.windows.open(id, Some(&blocks[hit - 1].key)) {
            self.blocks.close(&mut handle)?;
            return Err(e.into());
        }
        let tails = self.window_tables(id)?;
        self.transfers.insert(id, Transfer::Export { handle });
        self.sync_events();
        Ok(Some(V4TransferPages {
            skipped: 0,
            blocks: blocks[..hit].to_vec(),
            boundary: (hit * t) as u64,
            tails,
        }))
    }

    /// Releases an export's pins.
    pub fn close_export(&mut self, id: RequestId) -> Result<(), V4Error> {
        self.end_transfer(id, true)
    }

    /// Closes transfer `id` (an export when `export`, else an import) with nothing
    /// linked: its rings and its block sequence go, and with them its pins or its
    /// reserved pages. The other kind is refused, and stays open.
    fn end_transfer(&mut self, id: RequestId, export: bool) -> Result<(), V4Error> {
        let mut handle = match self.transfers.remove(&id) {
            Some(Transfer::Export { handle }) if export => handle,
            Some(Transfer::Import { handle, .. }) if !export => handle,
            Some(other) => {
                self.transfers.insert(id, other);
                return Err(Self::transfer_error(
                    id,
                    if export {
                        "close_export on an import: use commit_import or abort_import"
                    } else {
                        "abort_import on an export: use close_export"
                    },
                ));
            }
            None => return Err(KvError::UnknownRequest { id }.into()),
        };
        let issued = self.blocks.issued_fence();
        self.windows.close(id, issued)?;
        self.blocks.close(&mut handle)?;
        self.sync_events();
        Ok(())
    }

    /// Reserves pages for importing the whole blocks of `tokens` (a multiple of 256
    /// tokens: the exporter's `boundary`) and their tail: leading blocks cached here are
    /// skipped, the others get fresh GPU pages; the tail gets fresh window pages unless a
    /// tail is kept here at the boundary already. `Ok(None)`, nothing reserved, when the
    /// GPU or the windows have no room now.
    pub fn begin_import(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<V4TransferPages>, V4Error> {
        self.check_new_transfer(id)?;
        let boundary = tokens.len() as u64;
        let Some(mut imp) = self.blocks.begin_import(id, scope, tokens)? else {
            self.sync_events();
            return Ok(None);
        };
        let key = *self
            .blocks
            .block_keys(scope, tokens)
            .last()
            .expect("invariant: begin_import took at least one whole block");
        let fresh_tail = !self.windows.has_tail(&key);
        let (completed, issued) = (self.blocks.completed_fence(), self.blocks.issued_fence());
        let opened = if fresh_tail {
            self.windows.open_at(id, boundary).and_then(|()| {
                // Fresh pages must be writable at once: slots a step in flight may still
                // read (released behind a fence not yet completed) are refused, as the
                // block half refuses them; it fits after that step completed.
                let ok = self.windows.ensure(id, boundary, completed, issued)?
                    && self.windows.wait_for(id)? <= completed;
                if !ok {
                    self.windows.close(id, issued)?;
                }
                Ok(ok)
            })
        } else {
            // Held while the import lasts; nothing of the windows moves.
            self.windows.open(id, Some(&key)).map(|_| true)
        };
        match opened {
            Ok(true) => {}
            Ok(false) => {
                self.blocks.close(&mut imp.handle)?;
                self.sync_events();
                return Ok(None);
            }
            Err(e) => {
                self.blocks.close(&mut imp.handle)?;
                self.sync_events();
                return Err(e.into());
            }
        }
        let tails = if fresh_tail {
            self.window_tables(id)?
        } else {
            Vec::new()
        };
        self.transfers.insert(
            id,
            Transfer::Import {
                handle: imp.handle,
                boundary,
                key,
            },
        );
        self.sync_events();
        Ok(Some(V4TransferPages {
            skipped: imp.skipped,
            blocks: imp.blocks,
            boundary,
            tails,
        }))
    }

    /// Links an import whose bytes have landed: its blocks enter the prefix tree, its
    /// tail is kept at the boundary, and the reservation closes. `tokens`: those given
    /// to [`begin_import`](Self::begin_import) (the block manager refuses others, and the
    /// import stays open).
    pub fn commit_import(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), V4Error> {
        let t = self.block_tokens();
        let Some(Transfer::Import {
            handle,
            boundary,
            key,
        }) = self.transfers.get_mut(&id)
        else {
            return Err(Self::transfer_error(
                id,
                "commit_import without an import in flight",
            ));
        };
        // Linked in either case: a tail kept here is only touched; one evicted while the
        // import held its pages is linked again from them.
        let links = [(*boundary, *key)];
        // What the windows would refuse is refused before the blocks change.
        self.windows.check_commit(id, *boundary, &links, t)?;
        self.blocks.commit_import(handle, tokens)?;
        self.transfers.remove(&id);
        let issued = self.blocks.issued_fence();
        self.windows.commit(id, links[0].0, &links, t, issued)?;
        self.windows.close(id, issued)?;
        self.sync_events();
        Ok(())
    }

    /// Gives an import's pages back with nothing linked (a failed or cancelled
    /// transfer).
    pub fn abort_import(&mut self, id: RequestId) -> Result<(), V4Error> {
        self.end_transfer(id, false)
    }
}
