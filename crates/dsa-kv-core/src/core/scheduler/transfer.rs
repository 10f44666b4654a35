//! Export and import of full blocks on the scheduler: the target cache and the mirrored
//! draft cache in lockstep (see `core/transfer.rs` for the per-manager rules). Ids share
//! one space with requests: an id in use by either is refused.
//!
//! Every export and import holds a **lease**
//! ([`SchedulerLimits::transfer_lease`](super::SchedulerLimits::transfer_lease)) from when
//! it opens; [`Scheduler::renew_transfer`] starts it again. [`Scheduler::expire_transfers`] closes those whose lease ran out, as
//! a release or an abort would (an export's pins go, an import's reserved pages are
//! freed and nothing of it enters the reuse tree), and remembers their ids, so that a
//! late commit, renewal or close gets [`SchedError::TransferExpired`] instead of an
//! unknown-id error. An importer whose exporter died therefore gets its pages back
//! within one lease; the transport side of that promise (no write lands after the
//! window closes, a margin before the lease ends) is the window's deadline
//! ([`ImportReservation::write_by`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{SchedError, Scheduler};
use crate::core::manager::SeqHandle;
use crate::core::transfer::{BlockLoc, MAX_BLOCK_PAGES};
use crate::core::{BlockKey, KvCacheManager, KvError, PageLoc, PrefixPages, ReuseScope};
use crate::ids::{RequestId, TokenId};
use serde::{Deserialize, Serialize};

/// A full block: its chained reuse key and its pages in the target and draft caches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockPages {
    /// The chained reuse key.
    pub key: BlockKey,
    /// Target cache: one page per life cycle.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, MAX_BLOCK_PAGES>")]
    pub target: Vec<PageLoc>,
    /// Draft cache: one page per life cycle (empty without a separate draft cache).
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, MAX_BLOCK_PAGES>")]
    pub draft: Vec<PageLoc>,
}

/// A reservation for incoming blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportReservation {
    /// Leading blocks already cached here (not transferred).
    pub skipped: u32,
    /// Pages reserved for the blocks `skipped..`, in prefix order.
    pub blocks: Vec<BlockPages>,
    /// When the lease ends (the import is then aborted).
    pub expires: Instant,
    /// The last moment a write may land: the lease's end less its drain margin
    /// ([`TRANSFER_DRAIN`]). A transport window opened for the import closes here.
    pub write_by: Instant,
}

/// The margin between the last moment an import's bytes may land (its window's
/// deadline) and the end of its lease (its pages freed): time for a transport to stop a
/// write cut off at the deadline. At most half the lease.
pub const TRANSFER_DRAIN: Duration = Duration::from_secs(2);

/// Transfers that expired: how many of each kind, and the most recent ids.
#[derive(Debug, Default)]
pub(super) struct Expired {
    /// Recent expired ids, oldest first, at most [`EXPIRED_KEPT`].
    ids: VecDeque<RequestId>,
    exports: u64,
    imports: u64,
}

/// Expired ids remembered for their typed error (older ones get "unknown").
const EXPIRED_KEPT: usize = 4096;

impl Expired {
    fn remember(&mut self, id: RequestId, import: bool) {
        if self.ids.len() == EXPIRED_KEPT {
            self.ids.pop_front();
        }
        self.ids.push_back(id);
        if import {
            self.imports += 1;
        } else {
            self.exports += 1;
        }
    }

    /// Forgets `id` (it is reused by a new request or transfer).
    fn forget(&mut self, id: RequestId) {
        if let Some(i) = self.ids.iter().position(|&x| x == id) {
            self.ids.remove(i);
        }
    }
}

/// Open and expired transfers, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferStats {
    /// Open exports.
    pub open_exports: u32,
    /// Open imports.
    pub open_imports: u32,
    /// Exports whose lease ran out (released by the scheduler).
    pub expired_exports: u64,
    /// Imports whose lease ran out (aborted by the scheduler: their pages freed).
    pub expired_imports: u64,
}

/// What [`Scheduler::expire_transfers`] closed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpiredTransfers {
    /// Exports released.
    pub exports: Vec<RequestId>,
    /// Imports aborted.
    pub imports: Vec<RequestId>,
}

#[derive(Debug)]
pub(super) enum TransferKind {
    Export,
    Import {
        tokens: Vec<TokenId>,
    },
    /// A windowed model's prefix export (blocks and the tail at their boundary; the
    /// cache keeps its handles).
    PrefixExport,
    /// A windowed model's prefix import of `tokens`, `brings` whole blocks of them new.
    PrefixImport {
        tokens: Vec<TokenId>,
        brings: u32,
    },
}

#[derive(Debug)]
pub(super) struct Transfer {
    kind: TransferKind,
    /// The block transfers' sequences (`None` for a prefix transfer: the cache holds it).
    target: Option<SeqHandle>,
    draft: Option<SeqHandle>,
    /// When the lease ends.
    expires: Instant,
}

fn no_handle(id: RequestId) -> SchedError {
    KvError::Transfer {
        id,
        why: "a windowed model's prefix transfer: commit it with commit_prefix_import".into(),
    }
    .into()
}

/// A block of the target cache alone (no draft cache, or a windowed model's block).
impl From<BlockLoc> for BlockPages {
    fn from(b: BlockLoc) -> Self {
        BlockPages {
            key: b.key,
            target: b.pages,
            draft: Vec::new(),
        }
    }
}

fn pair(t: Vec<BlockLoc>, d: Option<Vec<BlockLoc>>) -> Option<Vec<BlockPages>> {
    match d {
        None => Some(t.into_iter().map(BlockPages::from).collect()),
        Some(d) if d.len() == t.len() && d.iter().zip(&t).all(|(a, b)| a.key == b.key) => Some(
            t.into_iter()
                .zip(d)
                .map(|(t, d)| BlockPages {
                    key: t.key,
                    target: t.pages,
                    draft: d.pages,
                })
                .collect(),
        ),
        Some(_) => None,
    }
}

impl Scheduler {
    fn check_free_id(&mut self, id: RequestId) -> Result<(), SchedError> {
        if self.transfers.contains_key(&id) || self.reqs.iter().any(|r| r.id == id) {
            return Err(KvError::DuplicateRequest { id }.into());
        }
        self.expired.forget(id);
        Ok(())
    }

    /// Open exports and imports.
    pub fn num_transfers(&self) -> usize {
        self.transfers.len()
    }

    /// Open and expired exports and imports.
    pub fn transfer_stats(&self) -> TransferStats {
        let imports = self
            .transfers
            .values()
            .filter(|t| {
                matches!(
                    t.kind,
                    TransferKind::Import { .. } | TransferKind::PrefixImport { .. }
                )
            })
            .count() as u32;
        TransferStats {
            open_exports: self.transfers.len() as u32 - imports,
            open_imports: imports,
            expired_exports: self.expired.exports,
            expired_imports: self.expired.imports,
        }
    }

    /// The transfer `id`, or why there is none: expired (its lease ran out) or unknown.
    fn open_transfer(&self, id: RequestId) -> Result<&Transfer, SchedError> {
        match self.transfers.get(&id) {
            Some(t) => Ok(t),
            None if self.expired.ids.contains(&id) => Err(SchedError::TransferExpired { id }),
            None => Err(KvError::UnknownRequest { id }.into()),
        }
    }

    /// Closes every transfer whose lease ended by `now`: exports are released, imports
    /// aborted (their reserved pages freed). Their ids are remembered, so a late
    /// commit, renewal or close is told [`SchedError::TransferExpired`].
    pub fn expire_transfers(&mut self, now: Instant) -> Result<ExpiredTransfers, SchedError> {
        let mut due: Vec<RequestId> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.expires <= now)
            .map(|(&id, _)| id)
            .collect();
        due.sort_unstable();
        let mut out = ExpiredTransfers::default();
        for id in due {
            let mut t = self.transfers.remove(&id).expect("listed above");
            let import = matches!(
                t.kind,
                TransferKind::Import { .. } | TransferKind::PrefixImport { .. }
            );
            self.close_handles(id, &mut t)?;
            self.expired.remember(id, import);
            if import {
                out.imports.push(id);
            } else {
                out.exports.push(id);
            }
        }
        Ok(out)
    }

    /// Starts the lease of transfer `id` again from `now`; returns when it now ends.
    pub fn renew_transfer(&mut self, id: RequestId, now: Instant) -> Result<Instant, SchedError> {
        self.expire_transfers(now)?;
        self.open_transfer(id)?;
        let expires = now + self.limits.transfer_lease;
        self.transfers.get_mut(&id).expect("checked").expires = expires;
        Ok(expires)
    }

    /// How long a transfer lives without a renewal.
    pub fn transfer_lease(&self) -> Duration {
        self.limits.transfer_lease
    }

    /// When transfer `id`'s lease ends.
    pub fn transfer_expires(&self, id: RequestId) -> Result<Instant, SchedError> {
        Ok(self.open_transfer(id)?.expires)
    }

    /// The last moment bytes may land for a lease ending at `expires`.
    pub(super) fn write_by(&self, expires: Instant) -> Instant {
        expires - TRANSFER_DRAIN.min(self.limits.transfer_lease / 2)
    }

    /// The chained reuse keys of `tokens`' full blocks under `scope`.
    pub fn block_keys(&mut self, scope: ReuseScope, tokens: &[TokenId]) -> Vec<BlockKey> {
        self.target.block_keys(scope, tokens)
    }

    /// Pins the cached full blocks of `tokens` in both caches for a transfer to read
    /// (see [`KvCacheManager::export_blocks`](crate::core::KvCacheManager::export_blocks));
    /// [`close_transfer`](Self::close_transfer) releases them.
    pub fn export_blocks(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
        now: Instant,
    ) -> Result<Vec<BlockPages>, SchedError> {
        self.expire_transfers(now)?;
        self.check_free_id(id)?;
        let (mut th, tb) = self
            .target
            .blocks_for_transfer(id)?
            .export_blocks(id, scope, tokens)?;
        let draft = match &mut self.draft {
            Some(d) => match d.export_blocks(id, scope, tokens) {
                Ok((dh, db)) => Some((dh, db)),
                Err(e) => {
                    self.target.close(&mut th)?;
                    return Err(e.into());
                }
            },
            None => None,
        };
        let (dh, db) = match draft {
            Some((h, b)) => (Some(h), Some(b)),
            None => (None, None),
        };
        let mut t = Transfer {
            kind: TransferKind::Export,
            target: Some(th),
            draft: dh,
            expires: now + self.limits.transfer_lease,
        };
        let Some(blocks) = pair(tb, db) else {
            self.close_handles(id, &mut t)?;
            return Err(SchedError::DraftDiverged {
                id,
                what: "the draft cache holds other blocks than the target cache",
            });
        };
        self.transfers.insert(id, t);
        Ok(blocks)
    }

    /// Reserves pages in both caches for the full blocks of `tokens`, whose chained keys
    /// the exporter computed as `keys` (checked here against our own hashing of `scope`
    /// and `tokens`, which must be the importer's own: the request it will serve).
    /// `Ok(None)` when there is no room now; nothing stays reserved then, nor on an error.
    pub fn begin_import(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
        keys: &[BlockKey],
        now: Instant,
    ) -> Result<Option<ImportReservation>, SchedError> {
        self.expire_transfers(now)?;
        self.check_free_id(id)?;
        self.check_import_keys(id, scope, tokens, keys)?;
        // Both caches make the same calls whatever the target decides, so the draft cache
        // mirrors every eviction the target's attempt made (it decides the same way).
        let t = self
            .target
            .blocks_for_transfer(id)?
            .begin_import(id, scope, tokens);
        let d = self
            .draft
            .as_mut()
            .map(|d| d.begin_import(id, scope, tokens));
        let (t, d) = match (t, d) {
            (Ok(Some(t)), None) => (t, None),
            (Ok(Some(t)), Some(Ok(Some(i)))) if i.skipped == t.skipped => (t, Some(i)),
            (t, d) => {
                let refused = matches!(t, Ok(None)) && matches!(d, None | Some(Ok(None)));
                let mut first_err = None;
                match t {
                    Ok(Some(mut i)) => self.target.close(&mut i.handle)?,
                    Err(e) => first_err = Some(SchedError::from(e)),
                    Ok(None) => {}
                }
                match d {
                    Some(Ok(Some(mut i))) => {
                        self.draft.as_mut().expect("draft").close(&mut i.handle)?
                    }
                    Some(Err(e)) if first_err.is_none() => first_err = Some(e.into()),
                    _ => {}
                }
                if refused {
                    return Ok(None);
                }
                return Err(first_err.unwrap_or(SchedError::DraftDiverged {
                    id,
                    what: "the draft cache decided an import differently from the target",
                }));
            }
        };
        let (dh, db) = match d {
            Some(i) => (Some(i.handle), Some(i.blocks)),
            None => (None, None),
        };
        let skipped = t.skipped;
        let expires = now + self.limits.transfer_lease;
        let mut tr = Transfer {
            kind: TransferKind::Import {
                tokens: tokens.to_vec(),
            },
            target: Some(t.handle),
            draft: dh,
            expires,
        };
        let Some(blocks) = pair(t.blocks, db) else {
            self.close_handles(id, &mut tr)?;
            return Err(SchedError::DraftDiverged {
                id,
                what: "the draft cache reserved other blocks than the target cache",
            });
        };
        self.transfers.insert(id, tr);
        Ok(Some(ImportReservation {
            skipped,
            blocks,
            expires,
            write_by: self.write_by(expires),
        }))
    }

    /// Links an import's blocks into both reuse trees (their bytes have landed) and
    /// closes it; returns the blocks it brought. An import whose lease ended by `now` is
    /// aborted instead ([`SchedError::TransferExpired`]): its window has closed, so its
    /// bytes may be partial.
    pub fn commit_import(&mut self, id: RequestId, now: Instant) -> Result<u32, SchedError> {
        self.expire_transfers(now)?;
        let t = self.open_transfer(id)?;
        let tokens = match &t.kind {
            TransferKind::Import { tokens } => tokens,
            TransferKind::PrefixImport { .. } => return Err(no_handle(id)),
            TransferKind::Export | TransferKind::PrefixExport => {
                return Err(KvError::Transfer {
                    id,
                    why: "this is an export: release it instead of committing".into(),
                }
                .into())
            }
        };
        let tokens = tokens.clone();
        let target = t.target.as_ref().ok_or_else(|| no_handle(id))?;
        // Both sequences are checked before either commits (the only ways a commit can
        // fail), so the two trees gain the same blocks or neither does.
        let fits = |m: &KvCacheManager, h: &SeqHandle| {
            m.info_of(h).map(|i| i.capacity == tokens.len() as u64)
        };
        let ok = fits(&self.target, target)?
            && match (&self.draft, &t.draft) {
                (Some(d), Some(h)) => fits(d, h)?,
                _ => true,
            };
        let mut t = self.transfers.remove(&id).expect("checked");
        if !ok {
            self.close_handles(id, &mut t)?;
            return Err(SchedError::DraftDiverged {
                id,
                what: "the caches reserved different lengths for an import",
            });
        }
        let target = t.target.as_mut().expect("checked above");
        let before = self.target.info_of(target)?.committed;
        let mut res = self
            .target
            .blocks_for_transfer(id)?
            .commit_import(target, &tokens);
        if let (Ok(()), Some(d), Some(h)) = (&res, &mut self.draft, &mut t.draft) {
            res = d.commit_import(h, &tokens);
        }
        if let Err(e) = res {
            // Close what is still open: nothing half-imported stays reserved.
            self.close_handles(id, &mut t)?;
            return Err(e.into());
        }
        Ok(((tokens.len() as u64 - before) / self.target.tokens_per_block()) as u32)
    }

    /// Releases an export, or aborts an import (its reserved pages are freed, nothing
    /// enters the reuse tree). An expired one is [`SchedError::TransferExpired`] (it was
    /// closed when its lease ran out).
    pub fn close_transfer(&mut self, id: RequestId) -> Result<(), SchedError> {
        self.open_transfer(id)?;
        let mut t = self.transfers.remove(&id).expect("checked");
        self.close_handles(id, &mut t)
    }

    fn close_handles(&mut self, id: RequestId, t: &mut Transfer) -> Result<(), SchedError> {
        match t.kind {
            TransferKind::PrefixExport => return Ok(self.target.close_prefix_export(id)?),
            TransferKind::PrefixImport { .. } => return Ok(self.target.abort_prefix_import(id)?),
            TransferKind::Export | TransferKind::Import { .. } => {}
        }
        if let Some(h) = &mut t.target {
            self.target.close(h)?;
        }
        if let (Some(d), Some(h)) = (&mut self.draft, &mut t.draft) {
            d.close(h)?;
        }
        Ok(())
    }

    /// Checks the exporter's chained `keys` against our own hashing of `scope` and
    /// `tokens` (the request this engine will serve): one key per whole block.
    fn check_import_keys(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
        keys: &[BlockKey],
    ) -> Result<(), SchedError> {
        let ours = self.target.block_keys(scope, tokens);
        let t = self.target.tokens_per_block();
        if ours.len() != keys.len() || !tokens.len().is_multiple_of(t as usize) {
            return Err(KvError::Transfer {
                id,
                why: format!(
                    "{} keys for {} tokens: one key per full {t}-token block",
                    keys.len(),
                    tokens.len(),
                ),
            }
            .into());
        }
        if let Some(b) = (0..keys.len()).find(|&b| keys[b] != ours[b]) {
            return Err(KvError::Transfer {
                id,
                why: format!(
                    "block {b}'s key is {} on the exporter and {} here: the engines disagree on \
                     the scope (LoRA, salt) or the tokens; nothing was reserved",
                    keys[b], ours[b]
                ),
            }
            .into());
        }
        Ok(())
    }

    /// A windowed model's prefix for a transfer to read: the cached whole blocks of
    /// `tokens` up to the deepest that keeps a window tail, and that tail (see
    /// [`ModelCache::export_prefix`](crate::core::ModelCache::export_prefix)), pinned
    /// under a lease until [`close_transfer`](Self::close_transfer). `Ok(None)`: nothing
    /// to offer (no whole block with a tail), nothing pinned.
    pub fn export_prefix(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
        now: Instant,
    ) -> Result<Option<PrefixPages>, SchedError> {
        self.expire_transfers(now)?;
        self.check_free_id(id)?;
        let Some(pages) = self.target.export_prefix(id, scope, tokens)? else {
            return Ok(None);
        };
        self.transfers.insert(
            id,
            Transfer {
                kind: TransferKind::PrefixExport,
                target: None,
                draft: None,
                expires: now + self.limits.transfer_lease,
            },
        );
        Ok(Some(pages))
    }

    /// Reserves fresh pages for a windowed model's incoming prefix: the whole blocks of
    /// `tokens` (which end at the exporter's boundary) and the tail there, unless held
    /// here already (see
    /// [`ModelCache::begin_prefix_import`](crate::core::ModelCache::begin_prefix_import)),
    /// under a lease; the keys are checked as [`begin_import`](Self::begin_import) does.
    /// `Ok(None)`: no room now, nothing reserved.
    pub fn begin_prefix_import(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
        keys: &[BlockKey],
        now: Instant,
    ) -> Result<Option<(PrefixPages, Instant)>, SchedError> {
        self.expire_transfers(now)?;
        self.check_free_id(id)?;
        if keys.is_empty() {
            return Err(KvError::Transfer {
                id,
                why: "no block keys: a prefix import brings at least one whole block".into(),
            }
            .into());
        }
        self.check_import_keys(id, scope, tokens, keys)?;
        let Some(pages) = self.target.begin_prefix_import(id, scope, tokens)? else {
            return Ok(None);
        };
        let expires = now + self.limits.transfer_lease;
        self.transfers.insert(
            id,
            Transfer {
                kind: TransferKind::PrefixImport {
                    tokens: tokens.to_vec(),
                    brings: pages.blocks.len() as u32,
                },
                target: None,
                draft: None,
                expires,
            },
        );
        Ok(Some((pages, self.write_by(expires))))
    }

    /// Links a windowed model's imported prefix (blocks and tail; their bytes have
    /// landed) and closes the import; a later request for the prompt resumes at its
    /// boundary. Returns the blocks it brought. Expired: aborted instead
    /// ([`SchedError::TransferExpired`]).
    pub fn commit_prefix_import(&mut self, id: RequestId, now: Instant) -> Result<u32, SchedError> {
        self.expire_transfers(now)?;
        let t = self.open_transfer(id)?;
        let TransferKind::PrefixImport { tokens, brings } = &t.kind else {
            return Err(KvError::Transfer {
                id,
                why: "not a windowed prefix import: commit a block import with commit_import, \
                      release an export with close_transfer"
                    .into(),
            }
            .into());
        };
        let (tokens, brings) = (tokens.clone(), *brings);
        let mut t = self.transfers.remove(&id).expect("checked");
        if let Err(e) = self.target.commit_prefix_import(id, &tokens) {
            // Nothing half-imported stays reserved.
            self.close_handles(id, &mut t)?;
            return Err(e.into());
        }
        Ok(brings)
    }
}
