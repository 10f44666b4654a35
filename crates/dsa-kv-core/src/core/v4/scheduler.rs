//! Continuous batching for DeepSeek-V4 over the [`V4CacheManager`]: admission with
//! prefix reuse (resumed at a window tail), chunked prefill, decode steps with MTP drafts,
//! preemption by recompute under memory pressure, commit of verified tokens and
//! completion. Plain synchronous state, like [`Scheduler`](super::super::scheduler::Scheduler).
//!
//! A step is [`schedule`](V4Scheduler::schedule) (decide and allocate: the plan carries
//! each request's tokens, block table and window page tables, and the copies to run
//! first), then [`commit`](V4Scheduler::commit) (the forward says which drafts were
//! accepted, the token sampled, and its proposals for the next step).
//!
//! **Order.** Running requests in arrival order (their next chunk or decode step) while
//! the token budget lasts, then waiting requests, front first, while there are sequence
//! slots. **Preemption.** When a running request finds no room, the newest running
//! request not yet planned this step is closed (its committed blocks stay cached, with
//! their tails) and goes back to the front of the queue; on re-admission it recomputes
//! from its deepest cached tail. Tokens already sampled are kept: a recompute's last
//! chunk samples nothing, and decoding resumes from the token sampled before.

use std::collections::{HashMap, VecDeque};

use serde::Serialize;

use super::{V4CacheManager, V4Error};
use crate::core::scheduler::SubmitRequest;
use crate::core::KvError;
use crate::core::SeqOptions;
use crate::ids::{Fence, RequestId, SlotId, TokenId};
use crate::ops::CopyPlan;

/// The V4 scheduler's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct V4Limits {
    /// Requests per step (and running at once).
    pub max_num_sequences: u32,
    /// New tokens per step.
    pub max_num_tokens: u32,
    /// Longest prefill chunk.
    pub max_prefill_chunk: u32,
    /// Longest sequence (prompt + output).
    pub max_seq_len: u32,
    /// Draft tokens per decode step (0: no MTP).
    pub draft_tokens: u32,
    /// Steps in a row that plan nothing before the scheduler reports that the cache
    /// cannot hold any waiting request.
    pub livelock_steps: u32,
}

impl Default for V4Limits {
    fn default() -> Self {
        V4Limits {
            max_num_sequences: 64,
            max_num_tokens: 2048,
            max_prefill_chunk: 512,
            max_seq_len: 65_536,
            draft_tokens: 0,
            livelock_steps: 8,
        }
    }
}

/// What the V4 scheduler refuses.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum V4SchedError {
    /// From the cache manager.
    #[error(transparent)]
    Cache(#[from] V4Error),
    /// A request that cannot be served as submitted.
    #[error("request {id}: {what}")]
    BadRequest {
        /// The request.
        id: RequestId,
        /// What is wrong and what to do.
        what: String,
    },
    /// Limits that cannot schedule anything.
    #[error("V4 scheduler limits: {0}")]
    Limits(String),
    /// `schedule` before the previous step was committed.
    #[error("step {step} is not committed yet: commit its outcomes before the next step")]
    StepNotCommitted {
        /// The pending step.
        step: u64,
    },
    /// `commit` without a scheduled step.
    #[error("no step to commit")]
    NothingToCommit,
    /// An outcome that does not match the step (unknown request, too many drafts
    /// accepted, a sampled token missing); nothing was committed.
    #[error("step {step}, request {id}: {what}")]
    BadOutcome {
        /// The step.
        step: u64,
        /// The request.
        id: RequestId,
        /// What is wrong.
        what: String,
    },
    /// No progress for too long: the cache cannot hold the first waiting request.
    #[error(
        "nothing could be scheduled for {steps} steps ({waiting} waiting): the cache cannot \
         hold request {first}; give the V4 manager more block or window slots"
    )]
    Livelock {
        /// Steps without work.
        steps: u32,
        /// Requests waiting.
        waiting: usize,
        /// The first waiting request.
        first: RequestId,
    },
}

/// What a request does in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum V4Work {
    /// A prefill (or recompute) chunk.
    Context,
    /// The sampled token and its drafts.
    Decode,
}

/// One request's part of a step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct V4Planned {
    /// The request.
    pub id: RequestId,
    /// Context chunk or decode step.
    pub work: V4Work,
    /// Position of the first token (the tokens committed before the step).
    pub first: u64,
    /// The step's tokens: a chunk, or the sampled token then the drafts.
    pub tokens: Vec<TokenId>,
    /// How many of `tokens` are drafts (decode steps).
    pub drafts: u32,
    /// Whether the forward samples a token after the last one (and proposes drafts): a
    /// decode step, or a prompt's last chunk; not a recompute's last chunk (its token
    /// was sampled before the preemption).
    pub sample: bool,
    /// Drafts the next step may carry (the forward proposes at most this many).
    pub next_drafts: u32,
    /// The GPU slots of the request's blocks (the compressed caches' block table).
    pub blocks: Vec<SlotId>,
    /// Per window life cycle: the first position held and the slots.
    pub windows: Vec<(u64, Vec<SlotId>)>,
}

/// One step: what every device runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct V4StepPlan {
    /// Step number.
    pub step: u64,
    /// Copies to run before the forward (offload, onboarding), in order.
    pub copies: Vec<CopyPlan>,
    /// The requests.
    pub requests: Vec<V4Planned>,
    /// The step's fence.
    pub fence: Fence,
    /// Requests preempted by this step (closed; they recompute when admitted again).
    pub preempted: Vec<RequestId>,
    /// Requests ended by this step because the cache can never hold them.
    pub failed: Vec<V4Failed>,
}

/// A request the scheduler gave up on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct V4Failed {
    /// The request.
    pub id: RequestId,
    /// Why, and what to do.
    pub reason: String,
}

/// The forward's result for one planned request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct V4Outcome {
    /// The request.
    pub id: RequestId,
    /// Drafts accepted (a prefix of the step's drafts).
    pub accepted_drafts: u32,
    /// The token sampled after the accepted ones (when the step samples).
    pub next_token: Option<TokenId>,
    /// Drafts proposed for the next step (at most `next_drafts`; extra ones are
    /// dropped).
    pub drafts: Vec<TokenId>,
}

/// A finished request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct V4Finished {
    /// The request.
    pub id: RequestId,
    /// The output tokens.
    pub output: Vec<TokenId>,
    /// Prompt tokens served from the cache at the first admission.
    pub reused_tokens: u64,
    /// Times it was preempted.
    pub preemptions: u32,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct V4SchedStats {
    /// Steps scheduled.
    pub steps: u64,
    /// Prompt and recompute tokens computed.
    pub context_tokens: u64,
    /// Decode steps (one per request and step).
    pub decode_steps: u64,
    /// Drafts planned, and accepted.
    pub drafts: u64,
    /// Drafts accepted.
    pub accepted_drafts: u64,
    /// Preemptions (closed for recompute).
    pub preemptions: u64,
    /// Context tokens computed again after preemptions (positions the request had
    /// computed before, not served from the cache).
    pub recomputed_tokens: u64,
    /// Tokens served from the cache at admissions that ran, re-admissions after a
    /// preemption included (a request's first admission: [`V4Finished::reused_tokens`]).
    pub reused_tokens: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests failed (the cache can never hold them).
    pub failed: u64,
}

#[derive(Debug)]
struct Req {
    submit: SubmitRequest,
    /// The prompt, then every output token; when decoding, the last one is sampled but
    /// not yet committed.
    tokens: Vec<TokenId>,
    committed: u64,
    /// Context (prefill or recompute) runs up to here; past it the request decodes.
    context_end: u64,
    /// Positions computed before (a recompute runs up to here again).
    computed: u64,
    /// Output tokens so far.
    emitted: u32,
    drafts: Vec<TokenId>,
    running: bool,
    first_reuse: Option<u64>,
    preemptions: u32,
    arrival: u64,
}

/// Continuous batching over a [`V4CacheManager`]. See the module docs.
pub struct V4Scheduler {
    m: V4CacheManager,
    limits: V4Limits,
    reqs: HashMap<RequestId, Req>,
    waiting: VecDeque<RequestId>,
    /// Running requests, in arrival order.
    running: Vec<RequestId>,
    pending: Option<V4StepPlan>,
    next_step: u64,
    next_arrival: u64,
    idle_steps: u32,
    stats: V4SchedStats,
}

impl V4Scheduler {
    /// A scheduler over `m`.
    pub fn new(m: V4CacheManager, limits: V4Limits) -> Result<Self, V4SchedError> {
        let bad = |what: &str| Err(V4SchedError::Limits(what.into()));
        if limits.max_num_sequences == 0 || limits.max_num_tokens == 0 {
            return bad("max_num_sequences and max_num_tokens must be at least 1");
        }
        if limits.max_prefill_chunk == 0 || limits.livelock_steps == 0 {
            return bad("max_prefill_chunk and livelock_steps must be at least 1");
        }
        if limits.draft_tokens >= limits.max_num_tokens {
            return bad(
                "draft_tokens must be below max_num_tokens (a decode step carries 1 + drafts)",
            );
        }
        Ok(V4Scheduler {
            m,
            limits,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: None,
            next_step: 0,
            next_arrival: 0,
            idle_steps: 0,
            stats: V4SchedStats::default(),
        })
    }

    /// The cache manager.
    pub fn manager(&self) -> &V4CacheManager {
        &self.m
    }

    /// The limits.
    pub fn limits(&self) -> V4Limits {
        self.limits
    }

    /// Counters.
    pub fn stats(&self) -> V4SchedStats {
        self.stats
    }

    /// Requests not finished (waiting or running).
    pub fn num_unfinished(&self) -> usize {
        self.reqs.len()
    }

    /// Running requests.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The step scheduled and not yet committed.
    pub fn pending(&self) -> Option<&V4StepPlan> {
        self.pending.as_ref()
    }

    /// Queues a request.
    pub fn submit(&mut self, r: SubmitRequest) -> Result<(), V4SchedError> {
        let id = r.id;
        let bad = |what: String| Err(V4SchedError::BadRequest { id, what });
        if self.reqs.contains_key(&id) {
            return bad("a request with this id is not finished: use a new id".into());
        }
        if r.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if r.max_new_tokens == 0 {
            return bad("max_new_tokens must be at least 1".into());
        }
        if let Some((i, t)) = r
            .prompt
            .iter()
            .enumerate()
            .find(|(_, t)| t.get() > TokenId::MAX)
        {
            return bad(format!(
                "prompt token {i} has id {}, above the largest token id {}",
                t.get(),
                TokenId::MAX
            ));
        }
        let len = r.prompt.len() as u64 + u64::from(r.max_new_tokens);
        if len > u64::from(self.limits.max_seq_len) {
            return bad(format!(
                "prompt {} + {} new tokens exceeds max_seq_len {}",
                r.prompt.len(),
                r.max_new_tokens,
                self.limits.max_seq_len
            ));
        }
        let capacity =
            u64::from(self.m.blocks().gpu_slots()[0]) * u64::from(self.m.plan().tokens_per_block());
        if len > capacity {
            return bad(format!(
                "prompt {} + {} new tokens exceeds the {capacity} tokens the GPU blocks hold: \
                 give the V4 manager more block slots",
                r.prompt.len(),
                r.max_new_tokens
            ));
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        self.reqs.insert(
            id,
            Req {
                tokens: r.prompt.clone(),
                committed: 0,
                context_end: r.prompt.len() as u64,
                computed: 0,
                emitted: 0,
                drafts: Vec::new(),
                running: false,
                first_reuse: None,
                preemptions: 0,
                arrival,
                submit: r,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// The work of `r` this step with `budget` tokens left: its tokens, drafts and
    /// whether it samples.
    fn work(&self, r: &Req, budget: u32) -> Option<(V4Work, Vec<TokenId>, u32, bool)> {
        if r.committed < r.context_end {
            let n = (r.context_end - r.committed)
                .min(u64::from(self.limits.max_prefill_chunk))
                .min(u64::from(budget));
            if n == 0 {
                return None;
            }
            let from = r.committed as usize;
            let end = r.committed + n;
            // The prompt's last chunk samples the first output token.
            let sample = end == r.context_end && r.emitted == 0;
            return Some((
                V4Work::Context,
                r.tokens[from..end as usize].to_vec(),
                0,
                sample,
            ));
        }
        let drafts = r.drafts.len().min(budget.saturating_sub(1) as usize);
        if budget == 0 {
            return None;
        }
        let mut tokens = vec![*r
            .tokens
            .last()
            .expect("invariant: a decoding request has sampled")];
        tokens.extend_from_slice(&r.drafts[..drafts]);
        Some((V4Work::Decode, tokens, drafts as u32, true))
    }

    /// Drafts the step after this one may carry for `r`, once `emitted` tokens are out.
    fn draft_room(&self, r: &Req, emitted_after: u32) -> u32 {
        let left = r.submit.max_new_tokens.saturating_sub(emitted_after);
        self.limits.draft_tokens.min(left.saturating_sub(1))
    }

    /// Ends running request `id` with `reason`.
    fn fail(
        &mut self,
        id: RequestId,
        reason: String,
        failed: &mut Vec<V4Failed>,
    ) -> Result<(), V4SchedError> {
        self.m.close(id)?;
        self.reqs.remove(&id);
        self.running.retain(|&x| x != id);
        self.stats.failed += 1;
        failed.push(V4Failed { id, reason });
        Ok(())
    }

    /// Closes running request `id` for recompute and queues it first; `count`: a
    /// preemption (not a request given back at its admission, which computed nothing).
    fn preempt(&mut self, id: RequestId, count: bool) -> Result<(), V4SchedError> {
        self.m.close(id)?;
        let r = self
            .reqs
            .get_mut(&id)
            .expect("invariant: running requests are known");
        r.running = false;
        // Everything committed is recomputed (from the deepest cached tail); a decoding
        // request keeps its sampled token and resumes decoding from it; a request in its
        // prompt still runs to the prompt's end.
        r.context_end = r.context_end.max(r.committed);
        r.committed = 0;
        r.drafts.clear();
        r.preemptions += u32::from(count);
        self.running.retain(|&x| x != id);
        self.waiting.push_front(id);
        self.stats.preemptions += u64::from(count);
        Ok(())
    }

    /// Plans `id` with `budget`: grows its caches. With no room, a context chunk is
    /// halved first (down to one token); then the newest running request not yet planned
    /// this step is preempted (possibly `id` itself; one `admitting` is given back to the
    /// queue instead). `Ok(None)`: nothing planned (no budget, or `id` was preempted).
    fn plan_one(
        &mut self,
        id: RequestId,
        admitting: bool,
        mut budget: u32,
        planned: &[RequestId],
        preempted: &mut Vec<RequestId>,
        failed: &mut Vec<V4Failed>,
    ) -> Result<Option<V4Planned>, V4SchedError> {
        let full = budget;
        let (work, tokens, drafts, sample) = loop {
            let r = &self.reqs[&id];
            let Some((work, tokens, drafts, sample)) = self.work(r, budget) else {
                return Ok(None);
            };
            let (first, n) = (r.committed, tokens.len() as u32);
            match self.m.resize(id, first + u64::from(n), first) {
                Ok(true) => break (work, tokens, drafts, sample),
                Ok(false) => {}
                Err(e @ V4Error::Blocks(KvError::SequenceTooLong { .. })) => {
                    self.fail(id, e.to_string(), failed)?;
                    return Ok(None);
                }
                Err(e) => return Err(e.into()),
            }
            if work == V4Work::Context && n > 1 {
                budget = n / 2;
                continue;
            }
            let victim = self
                .running
                .iter()
                .copied()
                .filter(|v| !planned.contains(v))
                .max_by_key(|v| self.reqs[v].arrival)
                .expect("invariant: `id` is running and unplanned");
            if victim == id && planned.is_empty() && self.running.len() == 1 {
                // Alone, with every cached block evictable, it still does not fit: it
                // never will.
                let r = &self.reqs[&id];
                let why = format!(
                    "the cache cannot hold it: {} positions do not fit even with nothing \
                     else running; give the V4 manager more block or window slots, or \
                     lower max_seq_len",
                    r.committed + u64::from(n)
                );
                self.fail(id, why, failed)?;
                return Ok(None);
            }
            if victim == id && admitting {
                self.preempt(id, false)?;
                return Ok(None);
            }
            self.preempt(victim, true)?;
            preempted.push(victim);
            if victim == id {
                return Ok(None);
            }
            // Room was made: the whole chunk again.
            budget = full;
        };
        let first = self.reqs[&id].committed;
        let r = &self.reqs[&id];
        // At least the sampled token comes out; commit caps the proposals again by what
        // did.
        let next_drafts = if sample {
            self.draft_room(r, r.emitted + 1)
        } else {
            0
        };
        let windows = (0..self.m.windows().specs().len())
            .map(|lc| self.m.window_table(id, lc))
            .collect::<Result<_, _>>()?;
        Ok(Some(V4Planned {
            id,
            work,
            first,
            tokens,
            drafts,
            sample,
            next_drafts,
            blocks: self.m.block_slots(id)?,
            windows,
        }))
    }

    /// Admits the first waiting request: creates its sequence (served from its deepest
    /// cached tail) and brings its blocks to the GPU. `Ok(false)`: no room, nothing
    /// changed.
    fn admit(&mut self, id: RequestId) -> Result<bool, V4SchedError> {
        let r = &self.reqs[&id];
        let prompt = r.tokens[..r.context_end as usize].to_vec();
        let opts = SeqOptions {
            priority: r.submit.priority,
        };
        let created = self.m.create(id, r.submit.scope, &prompt, opts)?;
        if !self.m.resume(id)? {
            self.m.close(id)?;
            return Ok(false);
        }
        let r = self.reqs.get_mut(&id).expect("invariant: known");
        r.committed = created.reused_tokens;
        r.running = true;
        self.waiting.pop_front();
        self.running.push(id);
        Ok(true)
    }

    /// Plans the next step; `Ok(None)` when no request is unfinished.
    pub fn schedule(&mut self) -> Result<Option<V4StepPlan>, V4SchedError> {
        if let Some(p) = &self.pending {
            return Err(V4SchedError::StepNotCommitted { step: p.step });
        }
        if self.reqs.is_empty() {
            return Ok(None);
        }
        let mut budget = self.limits.max_num_tokens;
        let mut planned: Vec<RequestId> = Vec::new();
        let mut requests = Vec::new();
        let mut preempted = Vec::new();
        let mut failed = Vec::new();
        // Running requests, oldest first.
        let mut order = self.running.clone();
        order.sort_by_key(|id| self.reqs[id].arrival);
        for id in order {
            if budget == 0 {
                break;
            }
            if !self.reqs[&id].running {
                continue; // preempted by an older request this step
            }
            if let Some(p) =
                self.plan_one(id, false, budget, &planned, &mut preempted, &mut failed)?
            {
                budget -= p.tokens.len() as u32;
                planned.push(id);
                requests.push(p);
            }
        }
        // Waiting requests, front first, while there are sequence slots and budget, and
        // no running request had to give way this step (admitting then would only make
        // the next preemption).
        while budget > 0
            && preempted.is_empty()
            && self.running.len() < self.limits.max_num_sequences as usize
        {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            if !self.admit(id)? {
                break;
            }
            match self.plan_one(id, true, budget, &planned, &mut preempted, &mut failed)? {
                Some(p) => {
                    // Counted once it runs (a request given back at admission reused
                    // nothing).
                    self.stats.reused_tokens += p.first;
                    let r = self.reqs.get_mut(&id).expect("invariant: admitted");
                    r.first_reuse.get_or_insert(p.first);
                    budget -= p.tokens.len() as u32;
                    planned.push(id);
                    requests.push(p);
                }
                None => break,
            }
        }
        if requests.is_empty() && failed.is_empty() {
            self.idle_steps += 1;
            if self.idle_steps >= self.limits.livelock_steps {
                let first = *self.waiting.front().unwrap_or(&RequestId(0));
                return Err(V4SchedError::Livelock {
                    steps: self.idle_steps,
                    waiting: self.waiting.len(),
                    first,
                });
            }
        } else {
            self.idle_steps = 0;
        }
        for p in &requests {
            match p.work {
                V4Work::Context => {
                    let r = &self.reqs[&p.id];
                    let n = p.tokens.len() as u64;
                    let again = r.computed.saturating_sub(p.first).min(n);
                    self.stats.recomputed_tokens += again;
                    self.stats.context_tokens += n;
                }
                V4Work::Decode => {
                    self.stats.decode_steps += 1;
                    self.stats.drafts += u64::from(p.drafts);
                }
            }
        }
        let plan = V4StepPlan {
            step: self.next_step,
            copies: self.m.take_copy_plans(),
            requests,
            fence: self.m.issue_fence(),
            preempted,
            failed,
        };
        self.next_step += 1;
        self.stats.steps += 1;
        self.pending = Some(plan.clone());
        Ok(Some(plan))
    }

    /// Checks `outcomes` against the pending step (every planned request once, drafts
    /// accepted within the step's, a sampled token where the step samples).
    fn check(plan: &V4StepPlan, outcomes: &[V4Outcome]) -> Result<(), V4SchedError> {
        let bad = |id, what: String| V4SchedError::BadOutcome {
            step: plan.step,
            id,
            what,
        };
        if outcomes.len() != plan.requests.len() {
            let id = plan.requests.first().map_or(RequestId(0), |p| p.id);
            return Err(bad(
                id,
                format!(
                    "{} outcomes for {} planned requests",
                    outcomes.len(),
                    plan.requests.len()
                ),
            ));
        }
        for o in outcomes {
            let p = plan
                .requests
                .iter()
                .find(|p| p.id == o.id)
                .ok_or_else(|| bad(o.id, "not planned in this step".into()))?;
            if outcomes.iter().filter(|x| x.id == o.id).count() > 1 {
                return Err(bad(o.id, "more than one outcome".into()));
            }
            if o.accepted_drafts > p.drafts {
                return Err(bad(
                    o.id,
                    format!("{} drafts accepted of {}", o.accepted_drafts, p.drafts),
                ));
            }
            if p.sample && o.next_token.is_none() {
                return Err(bad(o.id, "the step samples, but no token was given".into()));
            }
            let above = |t: &TokenId| t.get() > TokenId::MAX;
            if let Some(t) = o.next_token.iter().chain(&o.drafts).find(|t| above(t)) {
                return Err(bad(
                    o.id,
                    format!(
                        "token {} is above the largest token id {}",
                        t.get(),
                        TokenId::MAX
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Commits the pending step's outcomes (one per planned request; checked first:
    /// a bad one commits nothing) and completes its fence. Returns the requests that
    /// finished.
    pub fn commit(&mut self, outcomes: &[V4Outcome]) -> Result<Vec<V4Finished>, V4SchedError> {
        let plan = self.pending.as_ref().ok_or(V4SchedError::NothingToCommit)?;
        Self::check(plan, outcomes)?;
        let plan = self.pending.take().expect("invariant: checked above");
        let mut finished = Vec::new();
        for p in &plan.requests {
            let o = outcomes
                .iter()
                .find(|o| o.id == p.id)
                .expect("invariant: checked");
            let kept = 1 + o.accepted_drafts as usize;
            let commit: Vec<TokenId> = match p.work {
                V4Work::Context => p.tokens.clone(),
                V4Work::Decode => p.tokens[..kept].to_vec(),
            };
            self.m.commit(p.id, &commit)?;
            let done = p.first + commit.len() as u64;
            if p.tokens.len() as u64 > commit.len() as u64 {
                // Rejected drafts: give their positions back.
                self.m.resize(p.id, done, done)?;
            }
            self.stats.accepted_drafts += u64::from(o.accepted_drafts);
            let r = &self.reqs[&p.id];
            let emitted = r.emitted + if p.sample { o.accepted_drafts + 1 } else { 0 };
            let room = (self.draft_room(r, emitted) as usize).min(p.next_drafts as usize);
            let r = self
                .reqs
                .get_mut(&p.id)
                .expect("invariant: planned requests are known");
            r.committed = done;
            // Positions this request computed (a recompute runs up to here again).
            r.computed = r.computed.max(done);
            if p.work == V4Work::Decode {
                r.tokens.extend_from_slice(&p.tokens[1..kept]);
                r.emitted += o.accepted_drafts;
            }
            if p.sample {
                r.tokens.push(o.next_token.expect("invariant: checked"));
                r.emitted += 1;
                r.drafts = o.drafts.iter().copied().take(room).collect();
            } else if done == r.context_end {
                // A recompute's end: decoding resumes from the token sampled before.
                r.drafts.clear();
            }
            if r.emitted >= r.submit.max_new_tokens {
                let r = self.reqs.remove(&p.id).expect("invariant: known");
                self.m.close(p.id)?;
                self.running.retain(|&x| x != p.id);
                self.stats.finished += 1;
                finished.push(V4Finished {
                    id: p.id,
                    output: r.tokens[r.submit.prompt.len()..].to_vec(),
                    reused_tokens: r.first_reuse.unwrap_or(0),
                    preemptions: r.preemptions,
                });
            }
        }
        self.m.complete_fences(plan.fence)?;
        Ok(finished)
    }

    /// Cancels request `id` (waiting or running, not in the pending step): its pages are
    /// freed, its committed blocks stay cached. `Ok(false)` when it is unknown.
    pub fn cancel(&mut self, id: RequestId) -> Result<bool, V4SchedError> {
        if self
            .pending
            .as_ref()
            .is_some_and(|p| p.requests.iter().any(|x| x.id == id))
        {
            return Err(V4SchedError::BadRequest {
                id,
                what: "it is in the pending step: commit the step first".into(),
            });
        }
        let Some(r) = self.reqs.remove(&id) else {
            return Ok(false);
        };
        if r.running {
            self.m.close(id)?;
            self.running.retain(|&x| x != id);
        } else {
            self.waiting.retain(|&x| x != id);
        }
        Ok(true)
    }

    /// Checks the manager's invariants and the scheduler's bookkeeping (tests; panics
    /// with the broken rule).
    pub fn check_invariants(&self) {
        self.m.check_invariants();
        for (id, r) in &self.reqs {
            assert_eq!(r.running, self.running.contains(id), "{id}: running list");
            assert_eq!(!r.running, self.waiting.contains(id), "{id}: waiting list");
            assert!(
                r.committed <= r.tokens.len() as u64,
                "{id}: committed past tokens"
            );
            assert_eq!(
                r.tokens.len(),
                r.submit.prompt.len() + r.emitted as usize,
                "{id}: tokens are the prompt and the output"
            );
            if r.running {
                assert_eq!(
                    self.m.committed(*id).ok(),
                    Some(r.committed),
                    "{id}: committed"
                );
            }
        }
        assert!(self.running.len() <= self.limits.max_num_sequences as usize);
    }
}

#[cfg(test)]
mod tests;
