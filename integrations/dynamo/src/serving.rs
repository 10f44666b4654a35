//! The engine loop: one task owns the dsa-kv runtime, admits requests, runs steps of the
//! reference model, and sends each request's tokens to its stream.
//!
//! Each round is one call to the runtime: a step, planned, run and committed (the model's
//! forward samples each request's token and the runtime commits what every device
//! sampled). Each token then gets its request's stop verdict. Requests that end early (a
//! stop id, end-of-sequence, a client that went away) are cancelled before the next step
//! (no step is in flight then); the pages a cancellation releases are checked: the slots
//! in use never grow across it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use dsa_kv::actors::{Drafts, KvCacheHandle, RuntimeStats, StepReport};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::ids::{RequestId, Tier, TokenId};
use dynamo_backend_common::{ComponentSnapshot, FinishReason, SnapshotPublisher};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::stop::{StopRule, Verdict};
use crate::verify::Verifier;

/// How often the load snapshot is published while steps run.
pub const SNAPSHOT_EVERY: Duration = Duration::from_millis(100);

/// The pause before planning again after a step that scheduled nothing while requests
/// were live.
pub const IDLE_RETRY: Duration = Duration::from_millis(1);

/// A request for the loop.
pub enum Command {
    /// Admit a request; its events go to `events`.
    Submit {
        /// The runtime's id for it.
        id: RequestId,
        /// Its prompt.
        prompt: Arc<Vec<u32>>,
        /// Tokens to generate at most.
        max_new: u32,
        /// When it ends early.
        rule: StopRule,
        /// Where its tokens go.
        events: mpsc::UnboundedSender<Event>,
    },
    /// End a request early (its client stopped or went away).
    Cancel(RequestId),
    /// Answer with the GPU-tier slots in use and in total, and the requests live.
    Load(tokio::sync::oneshot::Sender<Result<Load, String>>),
    /// Stop serving now (the worker's cleanup): live requests fail with that reason. A
    /// stream still held elsewhere keeps a sender alive, so the loop cannot wait for
    /// every sender to go.
    Shutdown,
}

/// The cache's load as the loop sees it between steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// GPU-tier slots held by requests (neither free nor evictable).
    pub in_use: u64,
    /// GPU-tier slots in total.
    pub total: u64,
    /// Requests admitted and not ended.
    pub live: usize,
}

/// What a request's stream receives.
#[derive(Debug, PartialEq)]
pub enum Event {
    /// A generated token.
    Token(u32),
    /// The request ended: why, the last token it returns (if any), and the prompt
    /// tokens served from the cache.
    End {
        /// Why.
        reason: FinishReason,
        /// The last token returned, with the end.
        last: Option<u32>,
        /// Prompt tokens served from the cache.
        cached_tokens: u64,
    },
    /// The request failed: the runtime's reason.
    Failed(String),
}

/// What the loop counted, for the worker's report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Requests admitted.
    pub admitted: u64,
    /// Requests refused at admission (by the runtime, or past the worker's limit).
    pub refused: u64,
    /// Requests that reached `max_tokens`.
    pub length: u64,
    /// Requests ended by a stop id.
    pub stop: u64,
    /// Requests ended by end-of-sequence.
    pub eos: u64,
    /// Requests cancelled because their client stopped or went away.
    pub cancelled: u64,
    /// Requests the runtime failed.
    pub failed: u64,
    /// Tokens sent to clients.
    pub tokens_out: u64,
    /// Prompt tokens of the requests that ended (not failed).
    pub prompt_tokens: u64,
    /// Of those, served from the cache (the usage's `cached_tokens`).
    pub cached_tokens: u64,
    /// Steps run.
    pub steps: u64,
    /// Cancellation rounds, with the GPU-tier slots in use before and after.
    pub cancel_rounds: u64,
    /// Slots released by those rounds in total.
    pub slots_released: u64,
    /// Rounds after which more slots were in use than before (must stay 0).
    pub cancel_leaks: u64,
}

struct Live {
    prompt: Arc<Vec<u32>>,
    max_new: u32,
    rule: StopRule,
    events: mpsc::UnboundedSender<Event>,
    generated: Vec<u32>,
    /// What the admission probe found cached (the usage of a request that does not
    /// finish by length; one that does reports the runtime's own count).
    probe_cached: u64,
    /// The client stopped or went away.
    cancel: bool,
}

/// The loop's state (owned by its task).
pub struct Serving {
    kv: KvCacheHandle,
    commands: mpsc::UnboundedReceiver<Command>,
    live: HashMap<RequestId, Live>,
    /// Requests admitted at most (running and waiting): what clients can make it hold.
    max_live: usize,
    verifier: Verifier,
    snapshots: Arc<OnceLock<Arc<SnapshotPublisher>>>,
    last_snapshot: Option<Instant>,
    counts: Arc<Mutex<Counts>>,
}

/// Why the loop stopped serving.
#[derive(Debug)]
pub struct Stopped {
    /// `None`: a clean shutdown ([`Command::Shutdown`], or every command sender dropped).
    pub error: Option<String>,
    /// The runtime's prompt tokens served from the cache over those looked up, at the end.
    pub prefix_hit_rate: Option<f64>,
    /// The runtime's coordinator time (schedule, commit, bookkeeping) and device time
    /// (the model's forward and the cache copies), microseconds in total.
    pub manager_us: u64,
    /// See `manager_us`.
    pub device_us: u64,
}

impl Serving {
    /// A loop over `kv` (whose forward samples each step's tokens), holding at most
    /// `max_live` requests.
    pub fn new(
        kv: KvCacheHandle,
        commands: mpsc::UnboundedReceiver<Command>,
        max_live: usize,
        verifier: Verifier,
        snapshots: Arc<OnceLock<Arc<SnapshotPublisher>>>,
        counts: Arc<Mutex<Counts>>,
    ) -> Serving {
        Serving {
            kv,
            commands,
            live: HashMap::new(),
            max_live,
            verifier,
            snapshots,
            last_snapshot: None,
            counts,
        }
    }

    /// Serves until [`Command::Shutdown`], every command sender gone, or a runtime
    /// failure; then ends every live request (failed, with the reason), shuts the runtime
    /// down, and returns the verifier for its final count.
    pub async fn run(mut self) -> (Stopped, Verifier) {
        let error = self.serve().await.err();
        let why = error
            .clone()
            .unwrap_or_else(|| "the worker is shutting down".into());
        for (_, r) in self.live.drain() {
            let _ = r.events.send(Event::Failed(why.clone()));
        }
        let st = self.kv.stats().await.ok();
        self.kv.shutdown().await;
        (
            Stopped {
                error,
                prefix_hit_rate: st.as_ref().map(|s| s.prefix_hit_rate),
                manager_us: st.as_ref().map_or(0, |s| s.manager_us),
                device_us: st.as_ref().map_or(0, |s| s.device_us),
            },
            self.verifier,
        )
    }

    async fn serve(&mut self) -> Result<(), String> {
        loop {
            // Wait for work only when nothing is live.
            if self.live.is_empty() {
                self.publish_snapshot(true).await;
                match self.commands.recv().await {
                    Some(Command::Shutdown) | None => return Ok(()),
                    Some(c) => self.take(c).await,
                }
            }
            loop {
                match self.commands.try_recv() {
                    Ok(Command::Shutdown) | Err(mpsc::error::TryRecvError::Disconnected) => {
                        return Ok(())
                    }
                    Ok(c) => self.take(c).await,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                }
            }
            // No step is in flight between rounds: requests whose clients went away end
            // before the next one.
            let gone = self.flagged();
            if !gone.is_empty() {
                self.cancel(gone).await?;
            }
            if self.live.is_empty() {
                continue;
            }
            let report = self
                .kv
                .step(Drafts::none())
                .await
                .map_err(|e| format!("step: {e}"))?;
            self.stepped(&report);
            if report.scheduled.is_empty() {
                // Live requests the scheduler could not place now (none running frees
                // room by itself): poll again shortly instead of spinning.
                if !self.live.is_empty() {
                    tokio::time::sleep(IDLE_RETRY).await;
                }
                continue;
            }
            self.finish_step(report).await?;
        }
    }

    /// Takes one command.
    async fn take(&mut self, c: Command) {
        match c {
            Command::Submit {
                id,
                prompt,
                max_new,
                rule,
                events,
            } => {
                if self.live.len() >= self.max_live {
                    bump(&self.counts, |c| c.refused += 1);
                    let _ = events.send(Event::Failed(format!(
                        "the worker holds {} requests, its limit: retry later",
                        self.max_live
                    )));
                    return;
                }
                let tokens: Vec<TokenId> = prompt.iter().map(|&t| TokenId(t)).collect();
                match self
                    .kv
                    .submit(SubmitRequest::new(id, tokens, max_new))
                    .await
                {
                    Ok(probe_cached) => {
                        bump(&self.counts, |c| c.admitted += 1);
                        self.live.insert(
                            id,
                            Live {
                                prompt,
                                max_new,
                                rule,
                                events,
                                generated: Vec::new(),
                                probe_cached,
                                cancel: false,
                            },
                        );
                    }
                    Err(e) => {
                        bump(&self.counts, |c| c.refused += 1);
                        let _ = events.send(Event::Failed(format!("the runtime refused it: {e}")));
                    }
                }
            }
            Command::Cancel(id) => {
                if let Some(r) = self.live.get_mut(&id) {
                    r.cancel = true;
                }
            }
            Command::Load(reply) => {
                let load = self
                    .kv
                    .stats()
                    .await
                    .map(|st| {
                        let (in_use, total) = load(&st);
                        Load {
                            in_use,
                            total,
                            live: self.live.len(),
                        }
                    })
                    .map_err(|e| format!("stats: {e}"));
                let _ = reply.send(load);
            }
            Command::Shutdown => {}
        }
    }

    /// After a step ran: the requests it failed end.
    fn stepped(&mut self, report: &StepReport) {
        bump(&self.counts, |c| c.steps += 1);
        for (id, why) in &report.failed {
            if let Some(r) = self.live.remove(id) {
                bump(&self.counts, |c| c.failed += 1);
                let _ = r.events.send(Event::Failed(why.clone()));
            }
        }
    }

    /// Sends the tokens a committed step sampled to their streams, ends the requests that
    /// finished or stop now, and cancels those that end before reaching `max_tokens`.
    async fn finish_step(&mut self, mut report: StepReport) -> Result<(), String> {
        let Some(commit) = report.committed.take() else {
            return Err(format!(
                "step {}: the model's forward sampled nothing (the runtime committed no \
                 tokens)",
                report.step
            ));
        };
        // (request, token, verdict, whether it is the last) of each token sampled (the
        // runtime's commit checked that every request producing one has it).
        let mut sampled = Vec::new();
        for o in &report.outcomes {
            if let (Some(token), Some(l)) = (o.next_token, self.live.get(&o.id)) {
                let n = l.generated.len() as u32 + 1;
                sampled.push((o.id, token.0, l.rule.verdict(token.0, n), n == l.max_new));
            }
        }
        // Requests that end now without reaching `max_tokens`: cancelled after the commit.
        let mut ending = self.flagged();
        for (id, _, verdict, last) in &sampled {
            if !matches!(verdict, Verdict::Emit) && !last {
                ending.insert(*id);
            }
        }
        let finished: HashMap<RequestId, u64> = commit
            .finished
            .iter()
            .map(|f| (f.finished.id, f.finished.reused_tokens))
            .collect();
        for (id, token, verdict, _) in sampled {
            let Some(l) = self.live.get_mut(&id) else {
                continue;
            };
            l.generated.push(token);
            if l.cancel {
                continue;
            }
            let cached = finished.get(&id).copied();
            let (reason, last) = match verdict {
                Verdict::Emit if cached.is_none() => {
                    bump(&self.counts, |c| c.tokens_out += 1);
                    let _ = l.events.send(Event::Token(token));
                    continue;
                }
                Verdict::Emit => (FinishReason::Length, Some(token)),
                Verdict::EmitAndEnd(why) => (why, Some(token)),
                Verdict::End(why) => (why, None),
            };
            let cached = cached.unwrap_or(l.probe_cached);
            self.end(id, reason, last, cached);
        }
        // A request whose client stopped while it reached `max_tokens` in this commit ends
        // as cancelled; the runtime already released it.
        let cancelled_at_length: Vec<RequestId> = finished
            .keys()
            .filter(|id| self.live.contains_key(id))
            .copied()
            .collect();
        for id in cancelled_at_length {
            self.end_cancelled(id);
        }
        ending.retain(|id| !finished.contains_key(id));
        if !ending.is_empty() {
            self.cancel(ending).await?;
        }
        self.publish_snapshot(false).await;
        Ok(())
    }

    /// Cancels requests outside any step (none of them finished): the client ones end
    /// as cancelled (the others were already told why they ended), and the slots in use
    /// must not grow.
    async fn cancel(&mut self, ids: HashSet<RequestId>) -> Result<(), String> {
        let before = self.in_use().await?;
        for id in ids {
            self.end_cancelled(id);
            self.kv
                .cancel(id)
                .await
                .map_err(|e| format!("cancel {id}: {e}"))?;
        }
        let after = self.in_use().await?;
        bump(&self.counts, |c| {
            c.cancel_rounds += 1;
            c.slots_released += before.saturating_sub(after);
        });
        if after > before {
            bump(&self.counts, |c| c.cancel_leaks += 1);
            tracing::error!(before, after, "a cancellation left more slots in use");
        }
        Ok(())
    }

    /// Ends a request whose client stopped or went away (if it is still live).
    fn end_cancelled(&mut self, id: RequestId) {
        if let Some(cached) = self.live.get(&id).map(|l| l.probe_cached) {
            self.end(id, FinishReason::Cancelled, None, cached);
        }
    }

    /// Ends a live request: its stream gets the end (with `last`, its last token, if it
    /// returns one), it is counted, queued for verification and forgotten.
    fn end(&mut self, id: RequestId, reason: FinishReason, last: Option<u32>, cached: u64) {
        let Some(l) = self.live.remove(&id) else {
            return;
        };
        let prompt = l.prompt.len() as u64;
        bump(&self.counts, |c| {
            match reason {
                FinishReason::Length => c.length += 1,
                FinishReason::Stop => c.stop += 1,
                FinishReason::EoS => c.eos += 1,
                FinishReason::Cancelled => c.cancelled += 1,
                _ => c.failed += 1,
            }
            c.tokens_out += u64::from(last.is_some());
            c.prompt_tokens += prompt;
            c.cached_tokens += cached;
        });
        let _ = l.events.send(Event::End {
            reason,
            last,
            cached_tokens: cached,
        });
        self.verifier.submit(id.0, l.prompt, l.generated);
    }

    /// The live requests whose clients stopped or went away.
    fn flagged(&self) -> HashSet<RequestId> {
        self.live
            .iter()
            .filter(|(_, l)| l.cancel)
            .map(|(id, _)| *id)
            .collect()
    }

    /// GPU-tier slots held by requests (neither free nor evictable).
    async fn in_use(&self) -> Result<u64, String> {
        let st = self.kv.stats().await.map_err(|e| format!("stats: {e}"))?;
        Ok(load(&st).0)
    }

    /// Publishes the load (at most every [`SNAPSHOT_EVERY`] unless `now`).
    async fn publish_snapshot(&mut self, now: bool) {
        let Some(p) = self.snapshots.get() else {
            return;
        };
        if !now
            && self
                .last_snapshot
                .is_some_and(|t| t.elapsed() < SNAPSHOT_EVERY)
        {
            return;
        }
        let Ok(st) = self.kv.stats().await else {
            return;
        };
        let (used, total) = load(&st);
        p.publish(
            0,
            ComponentSnapshot {
                kv_used_blocks: used,
                kv_total_blocks: total,
                gpu_cache_usage: if total == 0 {
                    0.0
                } else {
                    used as f32 / total as f32
                },
                kv_cache_hit_rate: Some(st.prefix_hit_rate as f32),
                dp_rank: 0,
            },
        );
        self.last_snapshot = Some(Instant::now());
    }
}

fn bump(counts: &Mutex<Counts>, f: impl FnOnce(&mut Counts)) {
    f(&mut counts.lock().unwrap_or_else(|e| e.into_inner()));
}

/// GPU-tier slots in use (neither free nor evictable) and in total, of the first pool
/// group (every group of the target cache shares one allocation life cycle).
pub fn load(st: &RuntimeStats) -> (u64, u64) {
    st.utilization
        .iter()
        .find(|u| u.tier == Tier::Gpu)
        .map_or((0, 0), |u| {
            let g = &u.usage;
            (
                u64::from(g.total.saturating_sub(g.free).saturating_sub(g.evictable)),
                u64::from(g.total),
            )
        })
}
