//! Continuous batching on top of the cache managers: admission with prefix reuse,
//! chunked prefill, decode steps with draft tokens, preemption under memory pressure,
//! commit of verified tokens, rollback of rejected drafts, and completion. Plain
//! synchronous state; the coordinator actor is a thin adapter around it.
//!
//! A step is `schedule` (decide and allocate; the plan goes to every device), then
//! `commit` (the framework says which draft tokens were accepted and which token was
//! sampled). With a separate draft cache, every operation is mirrored on the draft
//! manager, which has the same slot counts, so its decisions mirror the target's.

mod transfer;
pub use transfer::{
    BlockPages, ExpiredTransfers, ImportReservation, TransferStats, TRANSFER_DRAIN,
};

use std::collections::HashMap;

use serde::Serialize;

use super::block_row::{BlockRow, KeptRow};
use super::error::{KvError, SeqStatus};
use super::manager::{KvCacheManager, SeqHandle, SeqOptions};
use super::model_cache::ModelCache;
use super::reset::ResetReport;
use super::reuse_key::{PrefixHash, ReuseScope};
use crate::ids::{Fence, LifeCycleId, RequestId, SlotId, Tier, TokenId};
use crate::ops::CopyPlan;

/// Scheduler limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SchedulerLimits {
    /// Requests per step.
    pub max_num_sequences: u32,
    /// New tokens per step.
    pub max_num_tokens: u32,
    /// Longest prefill chunk.
    pub max_prefill_chunk: u32,
    /// Longest sequence (prompt + output).
    pub max_seq_len: u32,
    /// Draft tokens per decode step.
    pub draft_tokens: u32,
    /// Steps without progress before the scheduler reports a livelock.
    pub livelock_steps: u32,
    /// KV tokens (cached + new) of all context requests of one step: the size of the
    /// devices' full-KV mapping buffers. A context request that would exceed it waits.
    pub max_context_kv_tokens: u32,
    /// How long an export or import lives without a renewal (see `transfer.rs`).
    pub transfer_lease: std::time::Duration,
}

/// A request as a client submits it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubmitRequest {
    /// Unique id.
    pub id: RequestId,
    /// Reuse scope (tenant salt, LoRA).
    pub scope: ReuseScope,
    /// Prompt tokens.
    pub prompt: Vec<TokenId>,
    /// Output tokens to generate.
    pub max_new_tokens: u32,
    /// Eviction and preemption priority (0–100; lower goes first).
    pub priority: u8,
}

impl SubmitRequest {
    /// A request in the shared reuse scope ([`ReuseScope::SHARED`]) with the default
    /// priority ([`DEFAULT_PRIORITY`](crate::core::DEFAULT_PRIORITY)); set `scope` or
    /// `priority` on the result for others.
    pub fn new(id: RequestId, prompt: Vec<TokenId>, max_new_tokens: u32) -> Self {
        SubmitRequest {
            id,
            scope: ReuseScope::SHARED,
            prompt,
            max_new_tokens,
            priority: crate::core::DEFAULT_PRIORITY,
        }
    }
}

/// What a request does in a step: a context (prefill) chunk or a decode step (possibly
/// with draft tokens). The scheduler plans it, the step metadata and the framework read it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub enum RequestKind {
    /// A prefill chunk.
    Context,
    /// A decode step (the last sampled token, then draft tokens).
    Generation,
}

/// One request of a step plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlannedRequest {
    /// The request.
    pub id: RequestId,
    /// Context or generation.
    pub kind: RequestKind,
    /// KV tokens before this step.
    pub num_cached: u32,
    /// Tokens this step processes (their KV is written), drafts included.
    pub tokens: Vec<TokenId>,
    /// Draft tokens among `tokens` (the last ones).
    pub num_drafts: u32,
    /// GPU slot of every target block: the scheduler's kept row, shared (its
    /// [`RowStamp`](super::RowStamp) says which columns changed since the row the
    /// previous plan carried for this request).
    pub block_slots: BlockRow,
    /// GPU slot of every draft-manager block (a kept row as well).
    pub draft_block_slots: Option<BlockRow>,
    /// Token ids of positions `[0, num_cached)` when the cached KV must be verified this
    /// step (after reuse or a preemption that may have moved it).
    pub verify_tokens: Option<Vec<TokenId>>,
    /// The request's reuse scope.
    pub scope: ReuseScope,
    /// [`PrefixHash`] of the scope and tokens `[0, num_cached)`: a forward that derives
    /// KV from the whole prefix (the synthetic source) chains the new tokens onto it.
    pub prefix: PrefixHash,
    /// The step ends with a sampled token for this request (a decode step, or the last
    /// chunk of its prompt): its outcome needs `next_token`.
    pub produces_token: bool,
    /// Draft tokens the next step may carry for this request (a forward that proposes
    /// drafts proposes at most this many): the configured count, fewer near the end of
    /// the request's output, 0 when the step samples nothing.
    pub next_drafts: u32,
    /// Per window life cycle of a model with sliding windows (DeepSeek-V4): the first
    /// position its ring holds and the ring's slots, in position order. Empty for a model
    /// without windows.
    pub window_tables: Vec<(u64, Vec<SlotId>)>,
}

/// Everything the devices need for one step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StepPlan {
    /// Step number.
    pub step: u64,
    /// Fence of the target manager that completes with this step.
    pub target_fence: Fence,
    /// Fence of the draft manager.
    pub draft_fence: Option<Fence>,
    /// Target copies to run before the step.
    pub copies: Vec<CopyPlan>,
    /// Draft copies to run before the step.
    pub draft_copies: Vec<CopyPlan>,
    /// Scheduled requests, context requests first.
    pub requests: Vec<PlannedRequest>,
    /// Requests suspended to make room this step.
    pub preempted: Vec<RequestId>,
    /// Requests resumed this step.
    pub resumed: Vec<RequestId>,
    /// Requests that failed this step, with the reason.
    pub failed: Vec<(RequestId, String)>,
}

/// What the framework decided after the forward pass of one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RequestOutcome {
    /// The request.
    pub id: RequestId,
    /// Draft tokens accepted (a prefix of the step's drafts).
    pub accepted_drafts: u32,
    /// The token sampled after the accepted ones (required for decode steps and for the
    /// last prefill chunk).
    pub next_token: Option<TokenId>,
}

/// A finished request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Output tokens sampled.
    pub generated: u32,
    /// Prompt tokens served from the cache.
    pub reused_tokens: u64,
    /// Times it was preempted.
    pub preemptions: u32,
    /// Every token with KV (prompt + committed outputs).
    pub tokens: Vec<TokenId>,
    /// Prompt tokens (the first of `tokens`).
    pub prompt_len: u32,
    /// The last token sampled (an output with no KV: generation stopped there).
    pub last_token: TokenId,
    /// Its reuse scope.
    pub scope: ReuseScope,
    /// Its block table at the end (for a final verification).
    pub block_slots: Vec<i32>,
    /// The draft manager's block table.
    pub draft_block_slots: Option<Vec<i32>>,
}

impl Finished {
    /// Every output token, in order: the committed ones, then the last sampled.
    pub fn output(&self) -> Vec<TokenId> {
        let from = (self.prompt_len as usize).min(self.tokens.len());
        let mut out = self.tokens[from..].to_vec();
        out.push(self.last_token);
        out
    }
}

/// Scheduler counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SchedulerStats {
    /// Steps planned.
    pub steps: u64,
    /// Requests admitted.
    pub submitted: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests failed.
    pub failed: u64,
    /// Preemptions (suspensions to make room).
    pub preemptions: u64,
    /// Prefill tokens processed.
    pub prefill_tokens: u64,
    /// Decode tokens processed (drafts included).
    pub decode_tokens: u64,
    /// Draft tokens proposed.
    pub drafts_proposed: u64,
    /// Draft tokens accepted.
    pub drafts_accepted: u64,
}

/// Scheduler errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedError {
    /// A request's own problem.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// An empty prompt.
    #[error("request {id} has an empty prompt")]
    EmptyPrompt {
        /// The request.
        id: RequestId,
    },
    /// Too long for the configuration.
    #[error("request {id}: prompt {prompt} + {max_new_tokens} new tokens exceeds max_seq_len {max_seq_len}")]
    TooLong {
        /// The request.
        id: RequestId,
        /// Prompt tokens.
        prompt: usize,
        /// Output tokens.
        max_new_tokens: u32,
        /// The limit.
        max_seq_len: u32,
    },
    /// A prompt longer than the whole GPU cache: a running request needs every block on
    /// the GPU, so it could never be prefilled. (A request whose outputs would outgrow
    /// the cache is admitted: it may stop early; it fails when it grows past it.)
    #[error(
        "request {id}: the prompt's {prompt} tokens exceed the {capacity} tokens the GPU \
         blocks hold even with nothing else running: give the cache more GPU memory or \
         send a shorter prompt"
    )]
    ExceedsCache {
        /// The request.
        id: RequestId,
        /// Prompt tokens.
        prompt: usize,
        /// Tokens the GPU blocks hold.
        capacity: u64,
    },
    /// Zero output tokens.
    #[error("request {id}: max_new_tokens must be at least 1")]
    NoOutput {
        /// The request.
        id: RequestId,
    },
    /// `schedule` before the previous step was committed.
    #[error(
        "step {step} is not committed yet: commit its outcome before scheduling the next step \
         (a client that lost the step's report gets it again from `pending_step`)"
    )]
    StepNotCommitted {
        /// The pending step.
        step: u64,
    },
    /// `commit` without a scheduled step.
    #[error("no step to commit")]
    NothingToCommit,
    /// An outcome for a request the step did not run.
    #[error("request {id} was not part of step {step}")]
    NotInStep {
        /// The request.
        id: RequestId,
        /// The step.
        step: u64,
    },
    /// A missing outcome or sampled token.
    #[error("request {id}: {what}")]
    BadOutcome {
        /// The request.
        id: RequestId,
        /// What is wrong.
        what: String,
    },
    /// No progress for too long.
    #[error(
        "no request could be scheduled for {steps} consecutive steps ({waiting} waiting): the \
         cache cannot hold any of them; the smallest needs {smallest_blocks} blocks of {capacity}"
    )]
    Livelock {
        /// Steps without progress.
        steps: u32,
        /// Requests waiting.
        waiting: usize,
        /// Blocks the smallest waiting request needs.
        smallest_blocks: u64,
        /// GPU blocks of the target pool.
        capacity: u32,
    },
    /// The draft manager diverged from the target (an internal invariant).
    #[error("the draft cache diverged from the target cache for request {id}: {what}")]
    DraftDiverged {
        /// The request.
        id: RequestId,
        /// What happened.
        what: &'static str,
    },
    /// A transfer whose lease ran out: it was closed then (an export released, an
    /// import aborted with its pages freed).
    #[error(
        "transfer {id} expired: its lease ran out before it was committed or closed, so it was \
         closed then (an import's pages freed, nothing of it in the cache; an export's pins \
         released); renew long transfers (renew_transfer) and import again"
    )]
    TransferExpired {
        /// The export or import.
        id: RequestId,
    },
    /// `reset_prefix_cache` while requests hold pages.
    #[error(
        "cannot reset the prefix cache: {requests} request(s) hold KV pages (running, in the \
         step in flight, or preempted with their pages kept); let them finish or cancel them \
         first (nothing was changed)"
    )]
    PrefixCacheInUse {
        /// Requests whose target or draft sequence holds at least one page.
        requests: usize,
    },
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    Prefill { done: u32 },
    Decode { next: TokenId, generated: u32 },
}

#[derive(Debug)]
struct Pending {
    kind: RequestKind,
    tokens: Vec<TokenId>,
    num_drafts: u32,
    /// Index of the request in the plan (its outcome is looked up there).
    at: u32,
}

/// A request's sequences in the target and (mirrored) draft manager.
#[derive(Debug)]
struct Seqs {
    target: SeqHandle,
    draft: Option<SeqHandle>,
}

#[derive(Debug)]
struct Req {
    id: RequestId,
    scope: ReuseScope,
    /// Open sequences; `None` until first scheduled, and after a recompute preemption.
    seq: Option<Seqs>,
    /// Tokens to prefill (the prompt; after a recompute preemption, every token with
    /// KV).
    prefill_len: u32,
    /// The prompt's length.
    prompt_len: u32,
    /// After a recompute preemption: the decode state to return to once re-prefilled.
    resume_decode: Option<(TokenId, u32)>,
    max_new_tokens: u32,
    priority: u8,
    /// Every token whose KV exists or is planned (prompt, then committed outputs).
    tokens: Vec<TokenId>,
    /// `(n, PrefixHash of tokens[..n])`, extended as the request advances.
    prefix: (u32, PrefixHash),
    phase: Phase,
    suspended: bool,
    verify: bool,
    reused: u64,
    preemptions: u32,
    pending: Option<Pending>,
    /// Failed during this `schedule` call; removed at its end.
    dead: bool,
    /// Paused by the framework: not scheduled until resumed.
    paused: bool,
    /// The block-table rows the plans carry (target, draft manager), kept across steps
    /// and updated by the blocks that changed.
    row: KeptRow,
    draft_row: KeptRow,
}

impl Req {
    /// [`PrefixHash`] of `tokens[..n]`: extends the memo, or starts over when `n` went
    /// back (a recompute). Committed tokens never change, so the memo stays valid.
    fn prefix_hash(&mut self, n: u32) -> PrefixHash {
        let (mut done, mut h) = self.prefix;
        if n < done {
            (done, h) = (0, PrefixHash::root(self.scope));
        }
        for &t in &self.tokens[done as usize..n as usize] {
            h = h.then(t);
        }
        self.prefix = (n, h);
        h
    }

    fn kv_len(&self) -> u32 {
        match self.phase {
            Phase::Prefill { done } => done,
            Phase::Decode { .. } => self.tokens.len() as u32,
        }
    }

    fn seqs(&self) -> &Seqs {
        self.seq
            .as_ref()
            .expect("invariant: a scheduled request has open sequences")
    }
}

/// The scheduler. See the module docs.
pub struct Scheduler {
    target: ModelCache,
    draft: Option<KvCacheManager>,
    limits: SchedulerLimits,
    reqs: Vec<Req>,
    step: u64,
    step_pending: bool,
    stalled: u32,
    /// Injected room refusals counted before the last `inject_room_failures` call.
    injected_before: u64,
    stats: SchedulerStats,
    /// Buffers of retired plans and commits ([`recycle`](Self::recycle)), reused by the
    /// next plans instead of allocating.
    spare: Spare,
    /// Open exports and imports of blocks (`transfer.rs`).
    transfers: std::collections::HashMap<RequestId, transfer::Transfer>,
    /// Transfers whose lease ran out.
    expired: transfer::Expired,
}

/// Emptied buffers kept for the next plans: a step of 256 decoding requests otherwise
/// allocates and frees ~1,000 small vectors (tokens, and block tables before they were
/// kept per request), which costs more
/// than a tenth of the step. At most [`Spare::cap`] of each kind are kept.
#[derive(Debug, Default)]
struct Spare {
    tokens: Vec<Vec<TokenId>>,
    requests: Option<Vec<PlannedRequest>>,
    cap: usize,
    /// `schedule`'s visiting order.
    order: Vec<usize>,
    /// `commit`'s lookups.
    outcomes: OutcomeBufs,
}

/// `commit`'s lookups, kept between steps.
#[derive(Debug, Default)]
struct OutcomeBufs {
    /// Index in the outcomes of each plan entry's outcome (`u32::MAX`: none).
    outcome_of: Vec<u32>,
    /// Index in `reqs` of each plan entry.
    by_at: Vec<usize>,
    /// `(id, index in reqs)` of the plan's requests by id, built on the first outcome
    /// out of plan order.
    by_id: Vec<(RequestId, usize)>,
}

impl Spare {
    fn tokens(&mut self) -> Vec<TokenId> {
        self.tokens.pop().unwrap_or_default()
    }

    fn keep_tokens(&mut self, mut v: Vec<TokenId>) {
        if self.tokens.len() < self.cap {
            v.clear();
            self.tokens.push(v);
        }
    }
}

impl Scheduler {
    /// A scheduler over a target cache (a [`KvCacheManager`], or a [`ModelCache`] with
    /// more attention kinds) and an optional draft manager (same slot counts, MTP layers
    /// only; not with sliding windows).
    pub fn new(
        target: impl Into<ModelCache>,
        draft: Option<KvCacheManager>,
        limits: SchedulerLimits,
    ) -> Self {
        let target = target.into();
        let cap = 2 * limits.max_num_sequences as usize + 8;
        Scheduler {
            target,
            draft,
            limits,
            reqs: Vec::new(),
            step: 0,
            step_pending: false,
            stalled: 0,
            injected_before: 0,
            stats: SchedulerStats::default(),
            spare: Spare {
                cap,
                ..Spare::default()
            },
            transfers: std::collections::HashMap::new(),
            expired: transfer::Expired::default(),
        }
    }

    /// Takes back a plan nobody reads any more (the devices are done with it): its
    /// buffers serve the next plans, so a steady decode loop allocates almost nothing
    /// per step. Optional: a plan that is simply dropped is freed as usual.
    pub fn recycle(&mut self, plan: StepPlan) {
        let mut requests = plan.requests;
        // Taken in place (moving each planned request out would copy it whole).
        for r in &mut requests {
            self.spare.keep_tokens(std::mem::take(&mut r.tokens));
            if let Some(v) = r.verify_tokens.take() {
                self.spare.keep_tokens(v);
            }
        }
        // The rows are shared with the requests' kept rows: dropping the plan's
        // references lets the next step write them in place (a finished request's rows
        // go with the plan).
        requests.clear();
        self.spare.requests = Some(requests);
    }

    /// The target and draft block tables of request `id`, read whole (tests).
    #[cfg(test)]
    pub(crate) fn tables_of(&self, id: RequestId) -> (Vec<i32>, Option<Vec<i32>>) {
        let r = self
            .reqs
            .iter()
            .find(|r| r.id == id)
            .expect("a live request");
        let s = r.seqs();
        let draft = match (&self.draft, &s.draft) {
            (Some(d), Some(h)) => Some(Self::table(d, h).expect("an active sequence")),
            _ => None,
        };
        (
            Self::table(&self.target, &s.target).expect("an active sequence"),
            draft,
        )
    }

    /// Spare token buffers kept, and the cap (tests).
    #[cfg(test)]
    pub(crate) fn spare_counts(&self) -> (usize, usize) {
        (self.spare.tokens.len(), self.spare.cap)
    }

    /// The target cache (it dereferences to its block manager).
    pub fn target(&self) -> &ModelCache {
        &self.target
    }

    /// Tokens of `prompt` the target cache would serve now
    /// ([`KvCacheManager::probe_reuse`]); holds nothing.
    pub fn probe_reuse(&mut self, scope: ReuseScope, prompt: &[TokenId]) -> Result<u64, KvError> {
        self.target.probe_reuse(scope, prompt)
    }

    /// The draft manager.
    pub fn draft(&self) -> Option<&KvCacheManager> {
        self.draft.as_ref()
    }

    /// Counters.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// Fault drills: the target manager's GPU-room requests are refused with
    /// probability `percent`, as if the storage could not supply the memory (see
    /// [`KvCacheManager::inject_room_failures`]); the scheduler sees memory pressure.
    /// The draft cache mirrors the target's decisions in lockstep (same slot counts,
    /// same operations), so a refusal of the pair is modelled on the target: a draft
    /// refusing what the target accepted is an invariant violation, reported as
    /// [`SchedError::DraftDiverged`], not a fault to survive. Returns the refusals
    /// injected before this call; `percent = 0` turns it off.
    pub fn inject_room_failures(&mut self, seed: u64, percent: u8) -> u64 {
        let before = self.injected_room_failures();
        self.target.inject_room_failures(seed, percent);
        self.injected_before = before;
        before
    }

    /// Room requests refused by injection since the scheduler started.
    pub fn injected_room_failures(&self) -> u64 {
        self.injected_before + self.target.injected_room_failures()
    }

    /// The step scheduled and not committed yet, if any.
    pub fn pending_step(&self) -> Option<u64> {
        self.step_pending.then_some(self.step)
    }

    /// Requests admitted and not finished.
    pub fn num_active(&self) -> usize {
        self.reqs.len()
    }

    /// Requests waiting (not running: never scheduled, suspended or preempted).
    pub fn num_waiting(&self) -> usize {
        self.reqs.iter().filter(|r| r.suspended).count()
    }

    /// Drains the target manager's KV events (the draft cache mirrors its blocks, so
    /// routers need one stream).
    pub fn take_events(&mut self) -> Vec<super::KvEvent> {
        if let Some(d) = &mut self.draft {
            d.take_events();
        }
        self.target.take_events()
    }

    /// Drains the target manager's router events (see
    /// [`KvCacheManager::take_router_events`]; the draft cache records none).
    pub fn take_router_events(&mut self) -> Vec<super::RouterEvent> {
        self.target.take_router_events()
    }

    /// Starts or stops recording router events on the target manager (see
    /// [`KvCacheManager::set_record_router_events`]).
    pub fn set_record_router_events(&mut self, on: bool) {
        self.target.set_record_router_events(on);
    }

    /// Admits a request. Its sequence is created (with prefix reuse) when it is first
    /// scheduled; the returned value is the reuse a probe sees now.
    pub fn submit(&mut self, r: SubmitRequest) -> Result<u64, SchedError> {
        if r.prompt.is_empty() {
            return Err(SchedError::EmptyPrompt { id: r.id });
        }
        if r.max_new_tokens == 0 {
            return Err(SchedError::NoOutput { id: r.id });
        }
        if r.prompt.len() as u64 + u64::from(r.max_new_tokens) > u64::from(self.limits.max_seq_len)
        {
            return Err(SchedError::TooLong {
                id: r.id,
                prompt: r.prompt.len(),
                max_new_tokens: r.max_new_tokens,
                max_seq_len: self.limits.max_seq_len,
            });
        }
        let capacity = u64::from(self.target.gpu_slots().iter().copied().min().unwrap_or(0))
            * self.target.tokens_per_block();
        // The prompt and the token the prefill samples after it.
        if r.prompt.len() as u64 + 1 > capacity {
            return Err(SchedError::ExceedsCache {
                id: r.id,
                prompt: r.prompt.len(),
                capacity,
            });
        }
        if r.priority > super::MAX_PRIORITY {
            return Err(KvError::InvalidOption {
                field: "priority",
                value: r.priority.to_string(),
                why: "priorities are 0..=100",
            }
            .into());
        }
        if self.reqs.iter().any(|q| q.id == r.id) || self.transfers.contains_key(&r.id) {
            return Err(KvError::DuplicateRequest { id: r.id }.into());
        }
        let probe = self.target.probe_reuse(r.scope, &r.prompt)?;
        self.reqs.push(Req {
            id: r.id,
            scope: r.scope,
            seq: None,
            prefill_len: r.prompt.len() as u32,
            prompt_len: r.prompt.len() as u32,
            resume_decode: None,
            max_new_tokens: r.max_new_tokens,
            priority: r.priority,
            tokens: r.prompt,
            prefix: (0, PrefixHash::root(r.scope)),
            phase: Phase::Prefill { done: 0 },
            suspended: true,
            verify: false,
            reused: 0,
            preemptions: 0,
            pending: None,
            dead: false,
            paused: false,
            row: KeptRow::default(),
            draft_row: KeptRow::default(),
        });
        self.stats.submitted += 1;
        Ok(probe)
    }

    /// Applies `f` to the request's target sequence, then `g` to its draft mirror.
    fn both(
        &mut self,
        i: usize,
        f: impl FnOnce(&mut ModelCache, &SeqHandle) -> Result<(), KvError>,
        g: impl FnOnce(&mut KvCacheManager, &SeqHandle) -> Result<(), KvError>,
    ) -> Result<(), KvError> {
        let s = self.reqs[i].seqs();
        f(&mut self.target, &s.target)?;
        if let (Some(m), Some(h)) = (&mut self.draft, &s.draft) {
            g(m, h)?;
        }
        Ok(())
    }

    /// Opens the request's sequences (with reuse) if needed and resumes them; `false`
    /// when there is no room now (nothing changed).
    fn activate(&mut self, i: usize) -> Result<bool, SchedError> {
        if self.reqs[i].seq.is_none() {
            let r = &self.reqs[i];
            let opts = SeqOptions {
                priority: r.priority,
            };
            let prompt = &r.tokens[..r.prefill_len as usize];
            let c = self.target.create(r.id, r.scope, prompt, opts)?;
            let draft = match &mut self.draft {
                Some(d) => {
                    let dc = d.create(r.id, r.scope, prompt, opts)?;
                    if dc.reused_tokens != c.reused_tokens {
                        return Err(SchedError::DraftDiverged {
                            id: r.id,
                            what: "reused a different prefix",
                        });
                    }
                    Some(dc.handle)
                }
                None => None,
            };
            let r = &mut self.reqs[i];
            if r.resume_decode.is_none() {
                r.reused = c.reused_tokens;
            }
            r.phase = Phase::Prefill {
                done: c.reused_tokens as u32,
            };
            r.verify = c.reused_tokens > 0;
            r.seq = Some(Seqs {
                target: c.handle,
                draft,
            });
        }
        let s = self.reqs[i].seqs();
        if !self.target.resume(&s.target)? {
            return Ok(false);
        }
        if let (Some(d), Some(h)) = (&mut self.draft, &s.draft) {
            if !d.resume(h)? {
                return Err(SchedError::DraftDiverged {
                    id: self.reqs[i].id,
                    what: "the draft cache refused a resume the target accepted",
                });
            }
        }
        self.reqs[i].suspended = false;
        Ok(true)
    }

    fn close_seqs(&mut self, i: usize) -> Result<(), KvError> {
        if let Some(mut s) = self.reqs[i].seq.take() {
            self.target.close(&mut s.target)?;
            if let (Some(d), Some(h)) = (&mut self.draft, &mut s.draft) {
                d.close(h)?;
            }
        }
        Ok(())
    }

    /// Preempts request `i`. With a host tier it is suspended (its pages may be
    /// offloaded and come back on resume). Without one, suspended pages could never leave
    /// the GPU, so it is recomputed instead: its sequences are closed (committed blocks
    /// stay cached) and it prefills again, from whatever is still cached, when it is
    /// next scheduled.
    fn preempt(&mut self, i: usize) -> Result<(), SchedError> {
        self.reqs[i].preemptions += 1;
        self.stats.preemptions += 1;
        if self.host_can_take(i)? {
            self.both(i, |m, h| m.suspend(h), |m, h| m.suspend(h))?;
            let r = &mut self.reqs[i];
            r.suspended = true;
            r.verify = true;
            Ok(())
        } else {
            self.recompute(i)
        }
    }

    /// Whether suspending request `i` can free GPU memory: its pages must be able to
    /// move to the host tier (free or evictable host slots for all of them).
    fn host_can_take(&self, i: usize) -> Result<bool, KvError> {
        if !self.target.has_host_tier() || !self.target.can_suspend() {
            return Ok(false);
        }
        let Some(s) = &self.reqs[i].seq else {
            return Ok(false);
        };
        let blocks = self.target.info_of(&s.target)?.num_blocks as u32;
        Ok(self
            .target
            .usage(Tier::Host)
            .iter()
            .all(|u| u.free + u.evictable >= blocks))
    }

    /// Closes request `i`'s sequences (committed blocks stay cached) so that it prefills
    /// again, from whatever is still cached, when it is next scheduled.
    fn recompute(&mut self, i: usize) -> Result<(), SchedError> {
        self.close_seqs(i)?;
        let r = &mut self.reqs[i];
        if let Phase::Decode { next, generated } = r.phase {
            r.prefill_len = r.tokens.len() as u32;
            r.resume_decode = Some((next, generated));
        }
        r.phase = Phase::Prefill { done: 0 };
        r.suspended = true;
        r.verify = true;
        Ok(())
    }

    /// Whether waiting request `i` could run its next step now: a decode step needs its
    /// whole KV plus the step's tokens on the GPU, a prefill its first chunk; the blocks
    /// must be free or evictable in every pool group.
    fn fits_now(&self, i: usize) -> bool {
        let r = &self.reqs[i];
        let tokens = match r.phase {
            Phase::Decode { .. } => r.tokens.len() as u64 + 1 + u64::from(self.limits.draft_tokens),
            Phase::Prefill { .. } => u64::from(r.prefill_len.min(self.limits.max_prefill_chunk)),
        };
        let needed = tokens.div_ceil(self.target.tokens_per_block());
        self.target
            .usage(Tier::Gpu)
            .iter()
            .all(|u| u64::from(u.free + u.evictable) >= needed)
    }

    /// A waiting request that still holds pages (suspended with open sequences), to be
    /// recomputed so that `for_idx` can resume: lowest priority, then most recently
    /// admitted. Breaks the deadlock where every waiting request holds memory the others
    /// need.
    fn holding_waiter(&self, for_idx: usize) -> Option<usize> {
        (0..self.reqs.len())
            .filter(|&j| {
                j != for_idx
                    && self.reqs[j].suspended
                    && self.reqs[j].seq.is_some()
                    && !self.reqs[j].dead
            })
            .min_by_key(|&j| (self.reqs[j].priority, std::cmp::Reverse(j)))
    }

    fn table(m: &KvCacheManager, h: &SeqHandle) -> Result<Vec<i32>, KvError> {
        Self::table_into(m, h, Vec::new())
    }

    /// [`table`](Self::table) written into `row` (a spare buffer).
    fn table_into(
        m: &KvCacheManager,
        h: &SeqHandle,
        mut row: Vec<i32>,
    ) -> Result<Vec<i32>, KvError> {
        row.clear();
        row.resize(m.info_of(h)?.num_blocks as usize, 0);
        m.write_block_table(h, LifeCycleId(0), &mut row)?;
        Ok(row)
    }

    /// The request to preempt to make room for `for_idx`: running, not scheduled this
    /// step; lowest priority first, then the most recently admitted.
    fn victim(&self, for_idx: usize) -> Option<usize> {
        (0..self.reqs.len())
            .filter(|&j| {
                j != for_idx
                    && !self.reqs[j].suspended
                    && !self.reqs[j].dead
                    && self.reqs[j].pending.is_none()
            })
            .min_by_key(|&j| (self.reqs[j].priority, std::cmp::Reverse(j)))
    }

    fn fail(
        &mut self,
        i: usize,
        why: String,
        failed: &mut Vec<(RequestId, String)>,
    ) -> Result<(), KvError> {
        self.close_seqs(i)?;
        let r = self.reqs.remove(i);
        self.stats.failed += 1;
        failed.push((r.id, why));
        Ok(())
    }

    /// Plans one step: decode requests first, then prefill chunks, within the token and
    /// sequence budgets; preempts lower-priority requests when memory is short.
    /// `drafts` holds each decoding request's draft tokens (truncated to the configured
    /// count).
    pub fn schedule(
        &mut self,
        drafts: &HashMap<RequestId, Vec<TokenId>>,
    ) -> Result<StepPlan, SchedError> {
        if self.step_pending {
            return Err(SchedError::StepNotCommitted { step: self.step });
        }
        // Drafts become committed tokens when accepted: refuse a bad one now, before
        // anything is planned, rather than at the commit that would accept it.
        let used = self.limits.draft_tokens as usize;
        for (id, d) in drafts {
            if let Some(t) = d[..d.len().min(used)]
                .iter()
                .find(|t| t.get() > TokenId::MAX)
            {
                return Err(SchedError::BadOutcome {
                    id: *id,
                    what: format!(
                        "draft token {} is above the largest token id {}",
                        t.get(),
                        TokenId::MAX
                    ),
                });
            }
        }
        let mut budget = self.limits.max_num_tokens;
        let mut context_kv = 0u32;
        let mut seqs = 0;
        let mut plan = StepPlan {
            step: self.step + 1,
            target_fence: Fence::NONE,
            draft_fence: None,
            copies: Vec::new(),
            draft_copies: Vec::new(),
            requests: self.spare.requests.take().unwrap_or_default(),
            preempted: Vec::new(),
            resumed: Vec::new(),
            failed: Vec::new(),
        };
        // Decode first (they hold memory and latency matters), then prefill; admission
        // order within each.
        let decoding = |r: &Req| matches!(r.phase, Phase::Decode { .. });
        let runnable = |r: &Req| !r.paused;
        let mut order = std::mem::take(&mut self.spare.order);
        order.clear();
        order.extend(
            (0..self.reqs.len()).filter(|&i| runnable(&self.reqs[i]) && decoding(&self.reqs[i])),
        );
        order.extend(
            (0..self.reqs.len()).filter(|&i| runnable(&self.reqs[i]) && !decoding(&self.reqs[i])),
        );
        for &i in &order {
            if seqs == self.limits.max_num_sequences || budget == 0 {
                break;
            }
            let id = self.reqs[i].id;
            // Only requests that were already running may take memory from others; a
            // waiting request starts only when there is room (no thrashing between
            // newcomers and the requests they would preempt).
            let was_running = !self.reqs[i].suspended;
            if self.reqs[i].suspended
                && self.reqs.iter().any(|r| !r.suspended && !r.dead)
                && !self.fits_now(i)
            {
                // Others are running and this one could not even take its next step:
                // leave it waiting rather than activate it only to preempt it again.
                continue;
            }
            if self.reqs[i].suspended {
                let mut active = self.activate(i)?;
                if !active && !self.reqs.iter().any(|r| !r.suspended && !r.dead) {
                    // Nothing runs and this request cannot resume: the memory is held by
                    // other waiting requests. Recompute them, newest first, until it fits.
                    while let Some(j) = self.holding_waiter(i) {
                        self.reqs[j].preemptions += 1;
                        self.stats.preemptions += 1;
                        plan.preempted.push(self.reqs[j].id);
                        self.recompute(j)?;
                        active = self.activate(i)?;
                        if active {
                            break;
                        }
                    }
                }
                if !active {
                    continue;
                }
                plan.resumed.push(id);
            }
            let mut t = self.spare.tokens();
            let r = &self.reqs[i];
            let (kind, new, num_drafts) = match r.phase {
                Phase::Decode { next, generated } => {
                    let d = drafts.get(&id).map_or(&[][..], |v| v.as_slice());
                    // No draft past the request's last output token.
                    let room = r.max_new_tokens.saturating_sub(generated + 1);
                    let d = &d[..d.len().min(self.limits.draft_tokens.min(room) as usize)];
                    t.push(next);
                    t.extend_from_slice(d);
                    (RequestKind::Generation, t, d.len() as u32)
                }
                Phase::Prefill { done } => {
                    let n = (r.prefill_len - done)
                        .min(self.limits.max_prefill_chunk)
                        .min(budget);
                    t.extend_from_slice(&r.tokens[done as usize..(done + n) as usize]);
                    (RequestKind::Context, t, 0)
                }
            };
            let n = new.len() as u32;
            if n == 0 || n > budget {
                continue;
            }
            let cached = self.reqs[i].kv_len();
            if kind == RequestKind::Context {
                if context_kv + cached + n > self.limits.max_context_kv_tokens {
                    continue;
                }
                context_kv += cached + n;
            }
            let ok = loop {
                let h = &self.reqs[i].seqs().target;
                match self
                    .target
                    .resize(h, u64::from(cached + n), u64::from(cached))
                {
                    Ok(true) => break true,
                    Ok(false) => match self.victim(i).filter(|_| was_running) {
                        Some(v) => {
                            plan.preempted.push(self.reqs[v].id);
                            self.preempt(v)?;
                        }
                        // No running victim left: memory held by waiting requests goes to
                        // the running one (they are recomputed later).
                        None if was_running && self.holding_waiter(i).is_some() => {
                            let j = self.holding_waiter(i).expect("invariant: just checked");
                            self.reqs[j].preemptions += 1;
                            self.stats.preemptions += 1;
                            plan.preempted.push(self.reqs[j].id);
                            self.recompute(j)?;
                        }
                        None => {
                            // Nothing left to preempt: this request waits.
                            plan.preempted.push(id);
                            self.preempt(i)?;
                            break false;
                        }
                    },
                    Err(e @ KvError::SequenceTooLong { .. }) => {
                        self.close_seqs(i)?;
                        self.reqs[i].dead = true;
                        self.stats.failed += 1;
                        plan.failed.push((id, e.to_string()));
                        break false;
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            if !ok {
                continue;
            }
            let s = self.reqs[i].seqs();
            if let (Some(d), Some(h)) = (&mut self.draft, &s.draft) {
                if !d.resize(h, u64::from(cached + n), u64::from(cached))? {
                    return Err(SchedError::DraftDiverged {
                        id,
                        what: "the draft cache refused a resize the target accepted",
                    });
                }
            }
            let prefix = self.reqs[i].prefix_hash(cached);
            let mut tokens = self.spare.tokens();
            tokens.extend_from_slice(&new);
            // The kept rows, updated by the blocks that changed (not rewritten).
            let r = &mut self.reqs[i];
            let open = r
                .seq
                .as_ref()
                .expect("invariant: a scheduled request has open sequences");
            let block_slots = r.row.publish(self.target.blocks_for_rows(), &open.target)?;
            let draft_block_slots = match (&mut self.draft, &open.draft) {
                (Some(d), Some(h)) => Some(r.draft_row.publish(d, h)?),
                _ => None,
            };
            let r = &self.reqs[i];
            let verify_tokens =
                (r.verify && cached > 0).then(|| r.tokens[..cached as usize].to_vec());
            let produces_token = match kind {
                RequestKind::Generation => true,
                RequestKind::Context => r.resume_decode.is_none() && cached + n == r.prefill_len,
            };
            // Output tokens out once this step sampled (at least one more).
            let out_after = match r.phase {
                Phase::Decode { generated, .. } => generated + 1,
                Phase::Prefill { .. } => 1,
            };
            let next_drafts = if produces_token {
                self.limits
                    .draft_tokens
                    .min(r.max_new_tokens.saturating_sub(out_after + 1))
            } else {
                0
            };
            let mut window_tables = Vec::new();
            self.target.window_tables_into(id, &mut window_tables)?;
            plan.requests.push(PlannedRequest {
                id,
                kind,
                num_cached: cached,
                tokens,
                num_drafts,
                block_slots,
                draft_block_slots,
                verify_tokens,
                scope: r.scope,
                prefix,
                produces_token,
                next_drafts,
                window_tables,
            });
            let r = &mut self.reqs[i];
            r.verify = false;
            r.pending = Some(Pending {
                kind,
                tokens: new,
                num_drafts,
                at: 0, // set below, once the plan is in its final order
            });
            budget -= n;
            seqs += 1;
        }
        // A request preempted after it was planned (as a victim of a later one) cannot
        // be: victims are never scheduled in the same step.
        // (A stable sort allocates scratch space: skip it for a batch already in order,
        // such as one that only decodes.)
        if !plan
            .requests
            .is_sorted_by_key(|p| p.kind == RequestKind::Generation)
        {
            plan.requests
                .sort_by_key(|p| p.kind == RequestKind::Generation);
        }
        // Where each planned request sits in the plan, for `commit`: visiting order,
        // context requests first (the sort above is stable).
        let mut at = 0u32;
        for ctx in [true, false] {
            for &i in &order {
                let r = &mut self.reqs[i];
                if let Some(p) = &mut r.pending {
                    if (p.kind == RequestKind::Context) == ctx {
                        p.at = at;
                        at += 1;
                    }
                }
            }
        }
        debug_assert_eq!(at as usize, plan.requests.len());
        self.spare.order = order;
        // Requests that failed this step (their sequences are closed) leave now: they
        // are in `plan.failed`, never planned again.
        if !plan.failed.is_empty() {
            self.reqs.retain(|r| !r.dead);
        }
        plan.copies = self.target.take_copy_plans();
        plan.target_fence = self.target.issue_fence();
        if let Some(d) = &mut self.draft {
            plan.draft_copies = d.take_copy_plans();
            plan.draft_fence = Some(d.issue_fence());
        }
        self.step += 1;
        self.stats.steps += 1;
        if plan.requests.is_empty() && self.reqs.iter().any(|r| !r.paused) {
            self.stalled += 1;
            if self.stalled >= self.limits.livelock_steps {
                let t = self.target.tokens_per_block();
                let smallest = self
                    .reqs
                    .iter()
                    .map(|r| (u64::from(r.kv_len()) + 1).div_ceil(t))
                    .min()
                    .unwrap_or(0);
                return Err(SchedError::Livelock {
                    steps: self.stalled,
                    waiting: self.reqs.len(),
                    smallest_blocks: smallest,
                    capacity: self.target.gpu_slots()[0],
                });
            }
        } else {
            self.stalled = 0;
        }
        self.step_pending = !plan.requests.is_empty();
        Ok(plan)
    }

    /// Records that the devices completed the step's work up to these fences.
    pub fn complete(&mut self, target: Fence, draft: Option<Fence>) -> Result<(), KvError> {
        self.target.complete_fences(target)?;
        if let (Some(d), Some(f)) = (&mut self.draft, draft) {
            d.complete_fences(f)?;
        }
        Ok(())
    }

    /// Commits the outcome of the last step: prefill chunks are committed; decode steps
    /// commit the last sampled token and the accepted drafts and roll back the rest.
    /// Returns the requests that reached their output length (their sequences are still
    /// open: call [`finalize`](Self::finalize) after any last verification). An invalid
    /// outcome is refused and changes nothing.
    pub fn commit(&mut self, outcomes: &[RequestOutcome]) -> Result<Vec<Finished>, SchedError> {
        if !self.step_pending {
            return Err(SchedError::NothingToCommit);
        }
        // Each outcome's request: where the plan put it (outcomes usually come in plan
        // order), else found by id. Validate everything before changing anything.
        let mut bufs = std::mem::take(&mut self.spare.outcomes);
        let checked = self.match_outcomes(outcomes, &mut bufs);
        let outcome_of = &bufs.outcome_of;
        let checked = checked.and_then(|()| {
            for r in &self.reqs {
                let Some(p) = &r.pending else { continue };
                let needs_token = match (p.kind, r.phase) {
                    (RequestKind::Generation, _) => true,
                    (RequestKind::Context, Phase::Prefill { done }) => {
                        r.resume_decode.is_none() && done + p.tokens.len() as u32 == r.prefill_len
                    }
                    _ => false,
                };
                let o = outcome_of[p.at as usize];
                if needs_token && (o == u32::MAX || outcomes[o as usize].next_token.is_none()) {
                    return Err(SchedError::BadOutcome {
                        id: r.id,
                        what: "the step produced a token: give next_token".into(),
                    });
                }
            }
            Ok(())
        });
        if let Err(e) = checked {
            self.spare.outcomes = bufs;
            return Err(e);
        }
        let mut finished = Vec::new();
        for i in 0..self.reqs.len() {
            let Some(p) = self.reqs[i].pending.take() else {
                continue;
            };
            let o = match outcome_of[p.at as usize] {
                u32::MAX => None,
                k => Some(&outcomes[k as usize]),
            };
            match p.kind {
                RequestKind::Context => {
                    self.both(
                        i,
                        |m, h| m.commit(h, &p.tokens),
                        |m, h| m.commit(h, &p.tokens),
                    )?;
                    self.stats.prefill_tokens += p.tokens.len() as u64;
                    let r = &mut self.reqs[i];
                    let Phase::Prefill { done } = r.phase else {
                        unreachable!("context steps are prefill")
                    };
                    let done = done + p.tokens.len() as u32;
                    r.phase = if done < r.prefill_len {
                        Phase::Prefill { done }
                    } else if let Some((next, generated)) = r.resume_decode.take() {
                        Phase::Decode { next, generated }
                    } else {
                        Phase::Decode {
                            next: o
                                .and_then(|o| o.next_token)
                                .expect("invariant: validated above"),
                            generated: 1,
                        }
                    };
                }
                RequestKind::Generation => {
                    let k = o.map_or(0, |o| o.accepted_drafts) as usize;
                    let accepted = &p.tokens[..1 + k];
                    self.both(
                        i,
                        |m, h| m.accept_tokens(h, accepted),
                        |m, h| m.accept_tokens(h, accepted),
                    )?;
                    self.stats.decode_tokens += p.tokens.len() as u64;
                    self.stats.drafts_proposed += u64::from(p.num_drafts);
                    self.stats.drafts_accepted += k as u64;
                    let r = &mut self.reqs[i];
                    r.tokens.extend_from_slice(accepted);
                    let Phase::Decode { generated, .. } = r.phase else {
                        unreachable!("generation steps decode")
                    };
                    r.phase = Phase::Decode {
                        next: o
                            .and_then(|o| o.next_token)
                            .expect("invariant: validated above"),
                        generated: generated + 1 + k as u32,
                    };
                }
            }
            self.spare.keep_tokens(p.tokens);
            let r = &self.reqs[i];
            if let Phase::Decode { generated, next } = r.phase {
                if generated >= r.max_new_tokens {
                    let s = r.seqs();
                    finished.push(Finished {
                        id: r.id,
                        generated,
                        reused_tokens: r.reused,
                        preemptions: r.preemptions,
                        tokens: r.tokens.clone(),
                        prompt_len: r.prompt_len,
                        last_token: next,
                        scope: r.scope,
                        block_slots: Self::table(&self.target, &s.target)?,
                        draft_block_slots: match (&self.draft, &s.draft) {
                            (Some(d), Some(h)) => Some(Self::table(d, h)?),
                            _ => None,
                        },
                    });
                }
            }
        }
        self.spare.outcomes = bufs;
        self.step_pending = false;
        Ok(finished)
    }

    /// Fills `outcome_of[at]` with the index in `outcomes` of the outcome of the plan's
    /// request `at` (`u32::MAX` for none) and checks each outcome on its own: a request
    /// of this step, once, a token id in range, no more drafts accepted than proposed.
    /// Linear in the outcomes when they come in plan order; otherwise the requests of
    /// the step are sorted by id once.
    fn match_outcomes(
        &self,
        outcomes: &[RequestOutcome],
        bufs: &mut OutcomeBufs,
    ) -> Result<(), SchedError> {
        let OutcomeBufs {
            outcome_of,
            by_at,
            by_id,
        } = bufs;
        by_at.clear();
        by_id.clear();
        for (i, r) in self.reqs.iter().enumerate() {
            if let Some(p) = &r.pending {
                let at = p.at as usize;
                if by_at.len() <= at {
                    by_at.resize(at + 1, usize::MAX);
                }
                by_at[at] = i;
            }
        }
        outcome_of.clear();
        outcome_of.resize(by_at.len(), u32::MAX);
        for (k, o) in outcomes.iter().enumerate() {
            if let Some(t) = o.next_token.filter(|t| t.get() > TokenId::MAX) {
                return Err(SchedError::BadOutcome {
                    id: o.id,
                    what: format!(
                        "next_token {} is above the largest token id {}",
                        t.get(),
                        TokenId::MAX
                    ),
                });
            }
            // The plan's request `k` when the outcomes follow the plan's order; else
            // the requests of the step sorted by id, once.
            // (A plan entry whose request left since, `finalize`d, is `usize::MAX`.)
            let i = match by_at
                .get(k)
                .copied()
                .filter(|&i| i != usize::MAX && self.reqs[i].id == o.id)
            {
                Some(i) => i,
                None => {
                    if by_id.is_empty() {
                        by_id.extend(
                            by_at
                                .iter()
                                .filter(|&&i| i != usize::MAX)
                                .map(|&i| (self.reqs[i].id, i)),
                        );
                        by_id.sort_unstable_by_key(|e| e.0);
                    }
                    match by_id.binary_search_by_key(&o.id, |e| e.0) {
                        Ok(j) => by_id[j].1,
                        Err(_) => {
                            return Err(SchedError::NotInStep {
                                id: o.id,
                                step: self.step,
                            })
                        }
                    }
                }
            };
            let p = self.reqs[i]
                .pending
                .as_ref()
                .expect("invariant: only requests of the step are matched");
            if o.accepted_drafts > p.num_drafts {
                return Err(SchedError::BadOutcome {
                    id: o.id,
                    what: format!(
                        "{} drafts accepted of {} proposed",
                        o.accepted_drafts, p.num_drafts
                    ),
                });
            }
            let slot = &mut outcome_of[p.at as usize];
            if *slot != u32::MAX {
                return Err(SchedError::BadOutcome {
                    id: o.id,
                    what: "two outcomes for one request".into(),
                });
            }
            *slot = k as u32;
        }
        Ok(())
    }

    /// Closes finished requests (their committed blocks stay cached for reuse).
    pub fn finalize(&mut self, ids: &[RequestId]) -> Result<(), SchedError> {
        for id in ids {
            if let Some(i) = self.reqs.iter().position(|r| r.id == *id) {
                self.close_seqs(i)?;
                self.reqs.remove(i);
                self.stats.finished += 1;
            }
        }
        Ok(())
    }

    /// The index of request `id`, refused (`what` it is for) while it is part of the
    /// step in flight.
    fn outside_step(&self, id: RequestId, what: &str) -> Result<usize, SchedError> {
        let i = self
            .reqs
            .iter()
            .position(|r| r.id == id)
            .ok_or(KvError::UnknownRequest { id })?;
        if self.reqs[i].pending.is_some() {
            return Err(SchedError::BadOutcome {
                id,
                what: format!("it is part of the step in flight: {what} after committing the step"),
            });
        }
        Ok(i)
    }

    /// Pauses a request: it is suspended (or recomputed without room on the host) and not
    /// scheduled until [`resume`](Self::resume). Not allowed during its step.
    pub fn pause(&mut self, id: RequestId) -> Result<(), SchedError> {
        let i = self.outside_step(id, "pause")?;
        if !self.reqs[i].suspended {
            self.preempt(i)?;
        }
        self.reqs[i].paused = true;
        Ok(())
    }

    /// Lets a paused request be scheduled again (it resumes when there is room).
    pub fn resume(&mut self, id: RequestId) -> Result<(), SchedError> {
        let r = self
            .reqs
            .iter_mut()
            .find(|r| r.id == id)
            .ok_or(KvError::UnknownRequest { id })?;
        r.paused = false;
        Ok(())
    }

    /// Cancels a request (its sequences are closed; committed blocks stay cached).
    pub fn cancel(&mut self, id: RequestId) -> Result<(), SchedError> {
        let i = self.outside_step(id, "cancel")?;
        let mut failed = Vec::new();
        self.fail(i, "cancelled".into(), &mut failed)?;
        Ok(())
    }

    /// Fails every request (e.g. a device holding their pages died); returns their ids.
    /// A step in flight is abandoned: closing drops its uncommitted capacity.
    pub fn fail_all(&mut self, why: &str) -> Result<Vec<RequestId>, SchedError> {
        let mut failed = Vec::new();
        while !self.reqs.is_empty() {
            self.fail(0, why.to_string(), &mut failed)?;
        }
        self.step_pending = false;
        Ok(failed.into_iter().map(|f| f.0).collect())
    }

    /// Whether a request is waiting (`Suspended`) or running (`Active`); `None` once
    /// finished, failed or unknown.
    pub fn status(&self, id: RequestId) -> Option<SeqStatus> {
        self.reqs.iter().find(|r| r.id == id).map(|r| {
            if r.suspended {
                SeqStatus::Suspended
            } else {
                SeqStatus::Active
            }
        })
    }
}

impl Scheduler {
    /// Drops every cached block of the target cache and of the mirrored draft cache, e.g.
    /// after a weight update (see [`KvCacheManager::reset_prefix_cache`]); returns the
    /// target's report (the draft cache mirrors it) and records one
    /// [`KvEvent::AllBlocksCleared`](super::KvEvent::AllBlocksCleared) for
    /// [`take_events`](Self::take_events).
    ///
    /// Refused with [`SchedError::PrefixCacheInUse`] while any request holds pages
    /// (running, in the step in flight, or preempted with its pages kept), and with
    /// [`KvError::PrefixCacheInUse`] should either cache hold pages of a sequence that is
    /// not the scheduler's; both caches are checked before either changes, so a refusal
    /// changes neither. Requests waiting without pages (not started yet, or preempted
    /// by recomputation) stay queued and later prefill from the emptied cache.
    pub fn reset_prefix_cache(&mut self) -> Result<ResetReport, SchedError> {
        let holds = |m: &KvCacheManager, h: &SeqHandle| m.info_of(h).map(|i| i.num_blocks > 0);
        let mut requests = 0;
        for r in &self.reqs {
            let Some(s) = &r.seq else { continue };
            let mut held = holds(&self.target, &s.target)?;
            if let (Some(d), Some(h)) = (&self.draft, &s.draft) {
                held |= holds(d, h)?;
            }
            requests += usize::from(held);
        }
        requests += self.transfers.len();
        if requests > 0 {
            return Err(SchedError::PrefixCacheInUse { requests });
        }
        self.target.close_dropped();
        if let Some(d) = &mut self.draft {
            d.close_dropped();
        }
        for m in std::iter::once(self.target.blocks()).chain(&self.draft) {
            let sequences = m.sequences_holding_pages();
            if sequences > 0 {
                return Err(KvError::PrefixCacheInUse { sequences }.into());
            }
        }
        let report = self.target.reset_prefix_cache()?;
        if let Some(d) = &mut self.draft {
            d.reset_prefix_cache()?;
        }
        Ok(report)
    }
}
