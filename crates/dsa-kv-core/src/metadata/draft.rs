//! Draft replay for speculative decoding with a separate draft cache (MTP / Eagle3 with
//! their own manager): the draft forward must read the **draft** manager's pages, through
//! buffers whose addresses a captured CUDA graph already knows.
//!
//! `prepare_draft` snapshots the target bindings, rebinds every DSA buffer to its
//! dedicated draft twin and recomputes it from the draft manager's slots; `restore` puts
//! back exactly the same buffers (identity, not contents) and the full-KV alias state.
//! Target buffers are never written during a replay. A snapshot is valid for one restore
//! of the replay it came from; any other restore is refused. [`DraftReplay`] restores on
//! drop (also when a draft forward fails or panics).

use serde::Serialize;

use super::buffers::Bindings;
use super::step::{MetadataDims, MetadataLayout, StepCounts, StepMetadata, StepRequest};
use super::MetadataError;

/// The target state a replay must restore.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct DraftSnapshot {
    bindings: Bindings,
    dims: MetadataDims,
    layout: MetadataLayout,
    counts: StepCounts,
    epoch: u64,
}

impl DraftSnapshot {
    /// The target bindings captured at prepare.
    pub fn bindings(&self) -> Bindings {
        self.bindings
    }
}

impl StepMetadata {
    /// Rebinds every DSA buffer to its draft twin and fills it from `reqs` (the same
    /// batch as the prepared step, with the draft manager's block slots). Returns the
    /// snapshot that [`restore`](Self::restore) needs.
    pub fn prepare_draft(
        &mut self,
        draft_layout: &MetadataLayout,
        reqs: &[StepRequest],
    ) -> Result<DraftSnapshot, MetadataError> {
        let (set, dims) = self.draft.ok_or(MetadataError::NoDraftBuffers)?;
        if self.replay.is_some() {
            return Err(MetadataError::ReplayActive);
        }
        if reqs.len() != self.counts.num_requests {
            return Err(MetadataError::RequestCount {
                got: reqs.len(),
                expected: self.counts.num_requests,
            });
        }
        let cached = self.num_cached().to_vec();
        for (i, r) in reqs.iter().enumerate() {
            if r.kind != self.kinds[i]
                || r.num_new != self.num_new[i]
                || r.helix_inactive != self.helix_inactive[i]
                || r.num_cached as i32 != cached[i]
            {
                return Err(MetadataError::DraftBatchMismatch { index: i });
            }
        }
        let counts = self.validate_for(1, draft_layout, &dims, reqs)?;
        let snap = DraftSnapshot {
            bindings: self.bound,
            dims: self.bound_dims,
            layout: self.layout,
            counts: self.counts,
            epoch: self.epoch + 1,
        };
        self.epoch += 1;
        self.replay = Some(self.epoch);
        self.layout = *draft_layout;
        self.bound_dims = dims;
        self.bound = set.with_alias(true);
        self.counts = counts;
        self.blocks_given[1].clear();
        self.blocks_given[1].extend(reqs.iter().map(|r| r.block_slots.len() as u32));
        self.fill_set(&set, dims, reqs, counts);
        Ok(snap)
    }

    /// Puts back the target bindings, layout and counts captured by `snap`. Refused
    /// (nothing changes) outside a replay or with a snapshot of another replay.
    pub fn restore(&mut self, snap: &DraftSnapshot) -> Result<(), MetadataError> {
        match self.replay {
            None => Err(MetadataError::NotInReplay),
            Some(e) if e != snap.epoch => Err(MetadataError::StaleSnapshot {
                snapshot: snap.epoch,
                current: e,
            }),
            Some(_) => {
                self.bound = snap.bindings;
                self.bound_dims = snap.dims;
                self.layout = snap.layout;
                self.counts = snap.counts;
                self.replay = None;
                self.epoch += 1;
                Ok(())
            }
        }
    }

    /// Starts a draft replay guarded by [`DraftReplay`], which restores on drop.
    pub fn draft_replay(
        &mut self,
        draft_layout: &MetadataLayout,
        reqs: &[StepRequest],
    ) -> Result<DraftReplay<'_>, MetadataError> {
        let snap = self.prepare_draft(draft_layout, reqs)?;
        Ok(DraftReplay {
            meta: self,
            snap: Some(snap),
        })
    }
}

/// An active draft replay. Reads (and slot-mapping recomputes) go to the draft buffers;
/// dropping it restores the target bindings.
#[derive(Debug)]
pub struct DraftReplay<'a> {
    meta: &'a mut StepMetadata,
    snap: Option<DraftSnapshot>,
}

impl DraftReplay<'_> {
    /// The snapshot taken at prepare.
    pub fn snapshot(&self) -> DraftSnapshot {
        self.snap
            .expect("invariant: the snapshot lives until finish or drop")
    }

    /// Restores now, reporting a refused restore.
    pub fn finish(mut self) -> Result<(), MetadataError> {
        let snap = self
            .snap
            .take()
            .expect("invariant: the snapshot lives until finish or drop");
        self.meta.restore(&snap)
    }
}

impl std::ops::Deref for DraftReplay<'_> {
    type Target = StepMetadata;
    fn deref(&self) -> &StepMetadata {
        self.meta
    }
}

impl std::ops::DerefMut for DraftReplay<'_> {
    fn deref_mut(&mut self) -> &mut StepMetadata {
        self.meta
    }
}

impl Drop for DraftReplay<'_> {
    fn drop(&mut self) {
        if let Some(snap) = self.snap.take() {
            // Refused only if the replay was already restored by hand.
            let _ = self.meta.restore(&snap);
        }
    }
}
