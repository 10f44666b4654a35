//! [`BlockRow`]: a request's block-table row as the scheduler keeps it between steps
//! and hands it to the plans, with a [`RowStamp`] saying what changed since the row the
//! previous plan carried.
//!
//! A plan shares the row (a reference count, no copy), so a step of long requests
//! costs the scheduler only the blocks that changed, and a consumer that keeps its own
//! copy (the device's persistent page tables) can apply the change instead of
//! rewriting the row: when its copy is the stamp's `base` version, only columns from
//! `from` on differ. Anything else (version 0, another base) means "rewrite the row".
//!
//! The scheduler keeps two buffers per request and writes the one no plan shares (the
//! previous step's plan usually is still held by the caller's report while the next
//! step is scheduled); see [`KeptRow`].

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Serialize, Serializer};

use super::manager::{KvCacheManager, SeqHandle};
use super::KvError;
use crate::ids::LifeCycleId;

/// What changed in a [`BlockRow`]: its version and the version it was derived from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RowStamp {
    /// This row's contents; unique in the process. 0: unknown (a row built or changed
    /// outside the scheduler): consumers rewrite it whole.
    pub version: u64,
    /// The version of a row an earlier plan carried for this request, from which this
    /// one differs only from `from` on (0: none).
    pub base: u64,
    /// Columns before `from` equal `base`'s; from `from` on they may differ, and the
    /// row may be longer or shorter.
    pub from: u32,
}

impl RowStamp {
    /// A row with no history: consumers rewrite it whole.
    pub const UNKNOWN: RowStamp = RowStamp {
        version: 0,
        base: 0,
        from: 0,
    };

    /// The first column a consumer holding version `held` of this request's row must
    /// rewrite: `len` (nothing) when it holds this version, `from` when it holds the
    /// base, 0 otherwise (or when either is unknown). Never above `len`.
    pub fn rewrite_from(&self, held: u64, len: usize) -> usize {
        if held == 0 || self.version == 0 {
            0
        } else if held == self.version {
            len
        } else if held == self.base {
            (self.from as usize).min(len)
        } else {
            0
        }
    }
}

/// Versions are unique in the process, so a consumer fed by several schedulers (or a
/// restarted one) never mistakes one request's row for another's.
static NEXT_VERSION: AtomicU64 = AtomicU64::new(1);

fn next_version() -> u64 {
    NEXT_VERSION.fetch_add(1, Ordering::Relaxed)
}

/// A request's block-table row (the GPU slot of every block, life cycle 0), shared by
/// the scheduler and its plans. Dereferences to the slots. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct BlockRow {
    slots: Arc<Vec<i32>>,
    stamp: RowStamp,
}

impl BlockRow {
    /// What changed since the row the previous plan carried for the request.
    pub fn stamp(&self) -> RowStamp {
        self.stamp
    }

    /// The slots, to change them (tests, fault injection): copies them first when the
    /// row is shared, and marks the row unknown so that every consumer rewrites it.
    pub fn make_mut(&mut self) -> &mut Vec<i32> {
        self.stamp = RowStamp::UNKNOWN;
        Arc::make_mut(&mut self.slots)
    }

    /// The slots as a vector of their own.
    pub fn to_vec(&self) -> Vec<i32> {
        self.slots.as_ref().clone()
    }
}

impl Deref for BlockRow {
    type Target = [i32];
    fn deref(&self) -> &[i32] {
        &self.slots
    }
}

impl From<Vec<i32>> for BlockRow {
    /// A row with no history ([`RowStamp::UNKNOWN`]).
    fn from(slots: Vec<i32>) -> Self {
        BlockRow {
            slots: Arc::new(slots),
            stamp: RowStamp::UNKNOWN,
        }
    }
}

/// Rows are equal when their slots are (the stamps say how a row was reached, not what
/// it is).
impl PartialEq for BlockRow {
    fn eq(&self, other: &Self) -> bool {
        self.slots[..] == other.slots[..]
    }
}

impl Eq for BlockRow {}

impl PartialEq<Vec<i32>> for BlockRow {
    fn eq(&self, other: &Vec<i32>) -> bool {
        self.slots[..] == other[..]
    }
}

impl Serialize for BlockRow {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.slots[..].serialize(s)
    }
}

/// A request's row for one manager, kept across steps in two buffers: the newest is
/// the one the last plan carried; the other is written when that plan is still shared.
#[derive(Debug, Default)]
pub(crate) struct KeptRow {
    bufs: [BlockRow; 2],
    newest: usize,
}

impl KeptRow {
    /// Brings the row up to date with the sequence's block table and returns it for a
    /// plan. Work: the columns that changed since the last call (and, when the other
    /// buffer is behind, those that changed in the step before), not the row; except
    /// when plans still share both buffers (a caller holding reports of several steps),
    /// where the row is copied whole into a new buffer.
    pub(crate) fn publish(
        &mut self,
        m: &mut KvCacheManager,
        h: &SeqHandle,
    ) -> Result<BlockRow, KvError> {
        let lc = LifeCycleId(0);
        let cur = self.newest;
        let (mark, blocks) = m.block_table_mark(h)?;
        let newest = &self.bufs[cur];
        if newest.stamp.version != 0 && mark >= blocks && newest.len() == blocks {
            // Nothing changed: the same row again.
            return Ok(newest.clone());
        }
        let other = 1 - cur;
        let (a, b) = self.bufs.split_at_mut(1);
        let (newest, spare) = if cur == 0 {
            (&a[0], &mut b[0])
        } else {
            (&b[0], &mut a[0])
        };
        // The spare buffer holds the row before `newest` when nobody shares it: bring
        // it to `newest`'s contents from the column `newest` changed at, then apply the
        // manager's changes since.
        let base_from = if spare.stamp.version != 0 && newest.stamp.base == spare.stamp.version {
            newest.stamp.from as usize
        } else {
            0
        };
        let slots = match Arc::get_mut(&mut spare.slots) {
            Some(v) => {
                let keep = base_from.min(v.len()).min(newest.len());
                v.truncate(keep);
                v.extend_from_slice(&newest[keep..]);
                v
            }
            None => {
                // Both shared (plans of two steps alive): a buffer of its own.
                spare.slots = Arc::new(newest.to_vec());
                Arc::get_mut(&mut spare.slots).expect("invariant: just created")
            }
        };
        let from = m.sync_block_table(h, lc, slots)?;
        spare.stamp = RowStamp {
            version: next_version(),
            base: newest.stamp.version,
            from: from as u32,
        };
        self.newest = other;
        Ok(self.bufs[other].clone())
    }
}
