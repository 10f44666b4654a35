//! The one recipe of a device step, written once over the hooks a backend supplies.
//!
//! A step is copies → verification of cached KV → metadata → forward → report; a draft
//! replay is bind the draft set → draft forward → restore. [`StepHooks`] is what
//! differs between backends (where the pools are, how a request's KV is read back, how
//! the forward is launched); every `StepHooks` is a [`DeviceBackend`] through the
//! implementation here, so [`HostDevice`](crate::HostDevice) and the CUDA backend's
//! device run the same sequence of the same checks.

use std::time::Instant;

use dsa_kv_core::core::scheduler::StepPlan;
use dsa_kv_core::metadata::{Bindings, DraftSnapshot, MetadataLayout};

use crate::backend::{
    verify_all, DeviceBackend, DeviceError, DeviceStepReport, Mismatch, StepCore, StepWork,
    VerifyRef, VerifySpec,
};
use crate::forward::{Phase, Proposals, Sampling};
use crate::transfer::PoolRegion;

/// What a backend supplies to the step recipe. See the module docs.
pub trait StepHooks: Send + 'static {
    /// The state every backend shares (metadata, KV source, verification settings).
    fn core(&self) -> &StepCore;
    /// The same, mutable.
    fn core_mut(&mut self) -> &mut StepCore;
    /// Makes the device current on this thread before device work (a GPU context);
    /// the host has nothing to do.
    fn bind(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Runs the plan's copies (offload, onboarding, copy-on-resume) on the target and
    /// draft caches; returns the slots copied.
    fn copies(&mut self, plan: &StepPlan) -> Result<u64, DeviceError>;
    /// Checks one request's cached KV on the target cache (and the draft cache when
    /// there is one), pushing every mismatch; returns the positions × layers read.
    fn verify_one(&mut self, r: VerifyRef<'_>, out: &mut Vec<Mismatch>)
        -> Result<u64, DeviceError>;
    /// The metadata layouts of the target cache and of the draft cache, if any.
    fn layouts(&self) -> (MetadataLayout, Option<MetadataLayout>);
    /// Runs the forward of `phase` over the bound metadata; returns the batch's tokens
    /// and what the forward sampled ([`Batch::run`](crate::Batch::run)).
    fn run_forward(
        &mut self,
        phase: Phase,
        plan: &StepPlan,
    ) -> Result<(u64, Sampling), DeviceError>;
    /// See [`DeviceBackend::cache_digest`].
    fn cache_digest(&mut self) -> Result<String, DeviceError>;
    /// See [`DeviceBackend::synchronize`].
    fn synchronize(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// See [`DeviceBackend::pool_regions`].
    fn pool_regions(&mut self) -> Vec<PoolRegion> {
        Vec::new()
    }
}

impl<T: StepHooks> DeviceBackend for T {
    fn index(&self) -> usize {
        self.core().index
    }

    fn bindings(&self) -> Option<Bindings> {
        Some(self.core().meta.bindings())
    }

    fn execute_step(&mut self, plan: &StepPlan) -> Result<DeviceStepReport, DeviceError> {
        let start = Instant::now();
        self.bind()?;
        let slot_copies = self.copies(plan)?;
        // Cached KV that was reused or moved is checked before anything new is written
        // (on a GPU the read-back is ordered after the copies and every earlier forward).
        let reqs = self.core().step_verifies(plan);
        let (verified, mismatches) = verify_all(reqs, |r, out| self.verify_one(r, out))?;
        let (target, _) = self.layouts();
        let core = self.core_mut();
        let requests = StepCore::step_requests(plan, false);
        core.meta
            .prepare(&target, &requests)
            .map_err(|e| core.meta_err(e))?;
        let (written, sampling) = self.run_forward(Phase::Target, plan)?;
        let work = StepWork {
            written,
            slot_copies,
            verified,
            mismatches,
            sampling,
        };
        Ok(self.core().step_report(plan, work, start))
    }

    fn draft_prepare(&mut self, plan: &StepPlan) -> Result<DraftSnapshot, DeviceError> {
        let (_, draft) = self.layouts();
        self.core_mut().prepare_draft(draft, plan)
    }

    fn draft_forward(&mut self, plan: &StepPlan) -> Result<(u64, Proposals), DeviceError> {
        self.bind()?;
        let has_draft = self.layouts().1.is_some();
        self.core().check_draft_forward(has_draft)?;
        let (written, sampling) = self.run_forward(Phase::Draft, plan)?;
        let drafts = match sampling {
            Sampling::Sampled(s) => s.drafts,
            Sampling::ByEngine => Proposals::new(),
        };
        Ok((written, drafts))
    }

    fn draft_restore(&mut self, snapshot: &DraftSnapshot) -> Result<(), DeviceError> {
        self.core_mut().restore(snapshot)
    }

    fn verify(&mut self, specs: &[VerifySpec]) -> Result<(u64, Vec<Mismatch>), DeviceError> {
        self.bind()?;
        let reqs = self.core().spec_verifies(specs);
        verify_all(reqs, |r, out| self.verify_one(r, out))
    }

    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        self.bind()?;
        StepHooks::cache_digest(self)
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        StepHooks::synchronize(self)
    }

    fn pool_regions(&mut self) -> Vec<PoolRegion> {
        StepHooks::pool_regions(self)
    }
}
