//! Every request's tokens checked against the reference model run alone on an unpaged
//! cache (`dsa_kv_model::unpaged::generate`, or `V4Model::generate` for DeepSeek-V4), on
//! a thread of its own so serving does not wait for it.
//!
//! The queue is bounded: a request that finds it full is counted as unverified (never
//! dropped silently). At shutdown the queue is drained before the report is written, up
//! to a deadline; what is left then counts as unverified too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dsa_kv_model::unpaged::generate;
use dsa_kv_model::v4::V4Model;
use dsa_kv_model::{CacheFormat, Model};
use serde::Serialize;

/// The model a worker serves, run alone on an unpaged cache.
#[derive(Clone)]
pub enum Reference {
    /// The DSA reference model and its cache format.
    Dsa(Arc<Model>, CacheFormat),
    /// The DeepSeek-V4 reference model.
    V4(Arc<V4Model>),
}

impl Reference {
    /// `max_new` greedy tokens after `prompt`.
    pub fn generate(&self, prompt: &[u32], max_new: u32) -> Result<Vec<u32>, String> {
        match self {
            Reference::Dsa(model, format) => generate(model, format, prompt, max_new)
                .map(|g| g.tokens)
                .map_err(|e| e.to_string()),
            Reference::V4(model) => model
                .generate(prompt, max_new)
                .map(|g| g.tokens)
                .map_err(|e| e.to_string()),
        }
    }
}

/// Requests waiting for the verifier at most (each holds its prompt and tokens: at most
/// 32 KiB at a 4,096-token context).
pub const QUEUE: usize = 1024;
/// How long the worker's cleanup waits for the queue to drain.
pub const FINISH_WITHIN: Duration = Duration::from_secs(60);
/// Differences kept for the report.
pub const DIFFERENCES_KEPT: usize = 16;

/// What the verifier found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Verification {
    /// Requests compared.
    pub verified: u64,
    /// Of those, bit-exact.
    pub exact: u64,
    /// Requests not compared: the queue was full, or the verifier is off.
    pub unverified: u64,
    /// The first differences (request, first differing position, tokens).
    pub differences: Vec<String>,
}

impl Verification {
    /// Every request compared and exact.
    pub fn all_exact(&self) -> bool {
        self.exact == self.verified && self.unverified == 0 && self.differences.is_empty()
    }
}

struct Job {
    id: u64,
    prompt: Arc<Vec<u32>>,
    generated: Vec<u32>,
}

/// The verifier thread and its queue.
pub struct Verifier {
    tx: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
    found: Arc<Mutex<Verification>>,
    /// Set when the deadline to drain passed: the rest is counted, not checked.
    give_up: Arc<AtomicBool>,
}

impl Verifier {
    /// Starts the thread checking against `model`.
    pub fn start(model: Reference) -> std::io::Result<Verifier> {
        let (tx, rx) = sync_channel::<Job>(QUEUE);
        let found = Arc::new(Mutex::new(Verification::default()));
        let give_up = Arc::new(AtomicBool::new(false));
        let (out, stop) = (found.clone(), give_up.clone());
        let thread = std::thread::Builder::new()
            .name("dsa-kv-verify".into())
            .spawn(move || {
                for job in rx {
                    if stop.load(Ordering::Relaxed) {
                        out.lock().unwrap_or_else(|e| e.into_inner()).unverified += 1;
                        continue;
                    }
                    let verdict = check(&model, &job);
                    let mut f = out.lock().unwrap_or_else(|e| e.into_inner());
                    f.verified += 1;
                    match verdict {
                        Ok(()) => f.exact += 1,
                        Err(why) => {
                            tracing::error!(request = job.id, "not exact: {why}");
                            if f.differences.len() < DIFFERENCES_KEPT {
                                f.differences.push(why);
                            }
                        }
                    }
                }
            })?;
        Ok(Verifier {
            tx: Some(tx),
            thread: Some(thread),
            found,
            give_up,
        })
    }

    /// A verifier that compares nothing (every request counts as unverified).
    pub fn off() -> Verifier {
        Verifier {
            tx: None,
            thread: None,
            found: Arc::default(),
            give_up: Arc::default(),
        }
    }

    /// Queues a request's tokens (`generated` may be empty: nothing to compare, not
    /// queued).
    pub fn submit(&self, id: u64, prompt: Arc<Vec<u32>>, generated: Vec<u32>) {
        if generated.is_empty() {
            return;
        }
        let queued = match &self.tx {
            Some(tx) => match tx.try_send(Job {
                id,
                prompt,
                generated,
            }) {
                Ok(()) => true,
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
            },
            None => false,
        };
        if !queued {
            self.found
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .unverified += 1;
        }
    }

    /// What was found so far.
    pub fn found(&self) -> Verification {
        self.found.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Verifies what is queued (for at most `within`; the rest is counted as
    /// unverified), stops the thread, and returns what was found.
    pub fn finish(&mut self, within: Duration) -> Verification {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let deadline = Instant::now() + within;
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if !t.is_finished() {
                tracing::warn!("the verifier did not drain its queue in {within:?}: the rest counts as unverified");
                self.give_up.store(true, Ordering::Relaxed);
            }
            if t.join().is_err() {
                tracing::error!("the verifier thread panicked");
            }
        }
        self.found()
    }
}

fn check(model: &Reference, job: &Job) -> Result<(), String> {
    let tokens = model
        .generate(&job.prompt, job.generated.len() as u32)
        .map_err(|e| format!("request {}: the unpaged run failed: {e}", job.id))?;
    if tokens == job.generated {
        return Ok(());
    }
    let i = job
        .generated
        .iter()
        .zip(&tokens)
        .take_while(|(a, b)| a == b)
        .count();
    Err(format!(
        "request {} ({} prompt tokens): generated token {i} is {:?}, the unpaged model's {:?}",
        job.id,
        job.prompt.len(),
        job.generated.get(i),
        tokens.get(i)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{reference_model, Settings};

    /// The verifier passes the model's own tokens and catches one changed token (it can
    /// fail), counts a full queue's overflow, and skips empty generations.
    #[test]
    fn exact_tokens_pass_and_a_changed_one_is_caught() {
        let model = reference_model(&Settings::default()).unwrap();
        let prompt: Arc<Vec<u32>> = Arc::new((0..70).map(|i| (i * 13) % 256).collect());
        let want = model.generate(&prompt, 6).unwrap();
        let mut v = Verifier::start(model).unwrap();
        v.submit(1, prompt.clone(), want.clone());
        let mut wrong = want.clone();
        wrong[4] = (wrong[4] + 1) % 256;
        v.submit(2, prompt.clone(), wrong);
        v.submit(3, prompt, Vec::new());
        let found = v.finish(FINISH_WITHIN);
        assert_eq!((found.verified, found.exact, found.unverified), (2, 1, 0));
        assert_eq!(found.differences.len(), 1);
        assert!(found.differences[0].contains("request 2"), "{found:?}");
        assert!(
            found.differences[0].contains("generated token 4"),
            "{found:?}"
        );
        assert!(!found.all_exact());
        let mut off = Verifier::off();
        off.submit(4, Arc::new(vec![1]), vec![2]);
        assert_eq!(off.finish(FINISH_WITHIN).unverified, 1);
    }

    /// Past the deadline the queue is counted, not checked: nothing is lost silently.
    #[test]
    fn a_queue_left_at_the_deadline_counts_as_unverified() {
        let model = reference_model(&Settings::default()).unwrap();
        let prompt: Arc<Vec<u32>> = Arc::new((0..200).map(|i| (i * 7) % 256).collect());
        let mut v = Verifier::start(model).unwrap();
        for id in 0..50 {
            v.submit(id, prompt.clone(), vec![1; 16]);
        }
        let found = v.finish(Duration::ZERO);
        assert_eq!(found.verified + found.unverified, 50, "{found:?}");
        assert!(found.unverified > 0, "{found:?}");
    }
}
