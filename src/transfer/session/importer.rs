//! The importer's half of a transfer: take an offer, reserve pages for the request this
//! engine serves (with a transport window over exactly them), answer the ticket, wait
//! for the bytes, check them, commit or abort, tell the exporter.

use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite};

use dsa_kv_core::core::scheduler::SchedError;
use dsa_kv_core::core::ReuseScope;
use dsa_kv_core::ids::{RequestId, TokenId};
use dsa_kv_device::transfer::{ExportedBlocks, ImportTicket, TransferReport};

use super::exporter::unexpected;
use super::open::{blocking, notification};
use super::TransferSession;
use super::{
    host_block_digests, AbortReason, BlockDigest, ImportOutcome, SessionError, SessionMsg,
};
use crate::actors::RuntimeError;

/// The exporter's `Written`: what it says it wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Written {
    /// What moved.
    pub report: TransferReport,
    /// The exporter's digest of each written block (when the session checks them).
    pub digests: Option<Vec<BlockDigest>>,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> TransferSession<S> {
    /// The next `Offer` from the exporter; `None` when it ended the session (`Bye`; a
    /// connection closed without it is [`WireError::Closed`](super::WireError::Closed)).
    /// Waits as long as it takes: the exporter offers when a prefill is done.
    pub async fn next_offer(&mut self) -> Result<Option<ExportedBlocks>, SessionError> {
        match self.wire.recv().await? {
            SessionMsg::Offer { export } => Ok(Some(export)),
            SessionMsg::Bye => Ok(None),
            other => Err(unexpected("an Offer or Bye", &other)),
        }
    }

    /// Reserves pages for the blocks of `offer` this engine lacks, as import `id` of
    /// the request it will serve — `scope` and `tokens` are **this engine's own** (the
    /// request's reuse scope and prompt, never the offer's): the offer's keys must equal
    /// the keys computed from them, or the import is refused — and opens the
    /// transport window over exactly those pages until the ticket's deadline. Sends
    /// nothing: answer with [`reply`](Self::reply) (or [`finish`](Self::finish)).
    /// `Ok(None)`: no room now (nothing reserved; a step may free some: try again, or
    /// decline).
    pub async fn begin(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
        offer: &ExportedBlocks,
    ) -> Result<Option<ImportTicket>, SessionError> {
        let kv = self.kv.clone();
        Ok(kv
            .transfer()
            .begin_import_with(
                self.transport.as_mut(),
                &self.peer,
                &self.local,
                id,
                scope,
                tokens,
                offer,
            )
            .await?)
    }

    /// Answers the offer of `export` with `ticket`, or with none and `why`.
    pub async fn reply(
        &mut self,
        export: RequestId,
        ticket: Result<&ImportTicket, &str>,
    ) -> Result<(), SessionError> {
        let (ticket, why) = match ticket {
            Ok(t) => (Some(t.clone()), None),
            Err(why) => (None, Some(why.to_string())),
        };
        self.wire
            .send(&SessionMsg::Ticket {
                export,
                ticket,
                why,
            })
            .await?;
        Ok(())
    }

    /// The exporter's `Written` for `ticket`, before the ticket's deadline. A `Failed`
    /// is [`SessionError::PeerFailed`].
    pub async fn wait_written(&mut self, ticket: &ImportTicket) -> Result<Written, SessionError> {
        let within = deadline(ticket).saturating_duration_since(Instant::now());
        match self.wire.recv_within(within).await? {
            SessionMsg::Written {
                export,
                import,
                report,
                digests,
            } if (export, import) == (ticket.export, ticket.id) => {
                if let Some(d) = &digests {
                    let units = ticket.blocks.len() + usize::from(!ticket.tail.is_empty());
                    if d.len() != units {
                        return Err(SessionError::Unexpected {
                            expected: "one digest per block of the ticket (and one for its tail)",
                            got: format!(
                                "{} digests for {} blocks{}",
                                d.len(),
                                ticket.blocks.len(),
                                if ticket.tail.is_empty() {
                                    ""
                                } else {
                                    " and a tail"
                                }
                            ),
                        });
                    }
                }
                if digests.is_some() != self.options.digests {
                    return Err(SessionError::Unexpected {
                        expected: "digests as agreed at the handshake",
                        got: format!(
                            "a Written {} digests",
                            if digests.is_some() { "with" } else { "without" }
                        ),
                    });
                }
                Ok(Written { report, digests })
            }
            SessionMsg::Failed {
                export,
                why,
                in_flight,
            } if export == ticket.export => Err(SessionError::PeerFailed {
                export,
                why,
                in_flight,
            }),
            other => Err(unexpected("the Written of this transfer", &other)),
        }
    }

    /// After the exporter's `Written`: waits for the transport's notification (the
    /// bytes have landed) until the ticket's deadline, closes the import's window (what
    /// is checked is what is committed), checks the pages' digests when the session
    /// takes them, then commits the import, or aborts it: bytes that are not the
    /// exporter's never enter the cache. Tells the
    /// exporter the outcome (`Outcome`; an exporter gone by then changes nothing) and
    /// returns it.
    pub async fn complete(
        &mut self,
        ticket: &ImportTicket,
        written: &Written,
    ) -> Result<ImportOutcome, SessionError> {
        let note = notification(ticket.export.0, ticket.id.0);
        let outcome = if !self.wait_notification(&note, deadline(ticket)).await? {
            self.abort(ticket, AbortReason::NoNotification).await?
        } else {
            self.check_and_commit(ticket, written).await?
        };
        // The import is decided: an exporter that is gone by now does not change it.
        let told = self
            .wire
            .send(&SessionMsg::Outcome {
                export: ticket.export,
                import: ticket.id,
                outcome: outcome.clone(),
            })
            .await;
        if let Err(e) = told {
            tracing::warn!(export = %ticket.export, import = %ticket.id, error = %e, "the exporter was not told the import's outcome");
        }
        Ok(outcome)
    }

    /// The whole importer's side after [`begin`](Self::begin) gave `ticket`:
    /// [`reply`](Self::reply), [`wait_written`](Self::wait_written),
    /// [`complete`](Self::complete). A failure of the exporter or the wire aborts the
    /// import (or leaves it to its lease when a write may still be landing) and is
    /// returned as the outcome; only this engine's own failures are errors.
    pub async fn finish(&mut self, ticket: &ImportTicket) -> Result<ImportOutcome, SessionError> {
        if let Err(e) = self.reply(ticket.export, Ok(ticket)).await {
            return self.abort(ticket, peer_gone(&e)).await;
        }
        match self.wait_written(ticket).await {
            Ok(w) => self.complete(ticket, &w).await,
            Err(SessionError::PeerFailed { why, in_flight, .. }) => {
                if in_flight {
                    Ok(ImportOutcome::LeftToLease {
                        why: format!("the exporter's write may still be landing: {why}"),
                    })
                } else {
                    self.abort(ticket, AbortReason::PeerFailed { why }).await
                }
            }
            Err(e @ (SessionError::Wire(_) | SessionError::Unexpected { .. })) => {
                self.abort(ticket, peer_gone(&e)).await
            }
            Err(e) => Err(e),
        }
    }

    /// Aborts the import of `ticket`: closes its window, then frees its pages. When the
    /// transport cannot establish that no write still lands, the import is left open
    /// for its lease to end ([`ImportOutcome::LeftToLease`]).
    pub async fn abort(
        &mut self,
        ticket: &ImportTicket,
        reason: AbortReason,
    ) -> Result<ImportOutcome, SessionError> {
        let kv = self.kv.clone();
        match kv
            .transfer()
            .abort_import_with(self.transport.as_mut(), ticket.id)
            .await
        {
            Ok(()) => Ok(ImportOutcome::Aborted { reason }),
            Err(RuntimeError::Transport(e)) if e.in_flight() => Ok(ImportOutcome::LeftToLease {
                why: format!("{reason}; and {e}"),
            }),
            // The lease ended first: the pages are free already.
            Err(RuntimeError::Scheduler(SchedError::TransferExpired { .. })) => {
                Ok(ImportOutcome::Aborted {
                    reason: AbortReason::Expired,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The bytes have landed: closes the window (no write lands after this, so what is
    /// checked is what is committed), renews the import (its lease must outlast the
    /// check), compares the digests, and commits or aborts.
    async fn check_and_commit(
        &mut self,
        ticket: &ImportTicket,
        written: &Written,
    ) -> Result<ImportOutcome, SessionError> {
        match self.transport.close_window(ticket.id.0) {
            Ok(()) => {}
            Err(e) if e.in_flight() => {
                return Ok(ImportOutcome::LeftToLease {
                    why: format!("the window could not be closed: {e}"),
                })
            }
            Err(e) => return Err(e.into()),
        }
        let kv = self.kv.clone();
        let expired = |e: &RuntimeError| {
            matches!(
                e,
                RuntimeError::Scheduler(SchedError::TransferExpired { .. })
            )
        };
        match kv.transfer().renew(ticket.id).await {
            Ok(_) => {}
            Err(e) if expired(&e) => {
                return Ok(ImportOutcome::Aborted {
                    reason: AbortReason::Expired,
                })
            }
            Err(e) => return Err(e.into()),
        }
        if let Some(block) = self.first_differing_block(ticket, written)? {
            return self
                .abort(ticket, AbortReason::DigestsDiffer { block })
                .await;
        }
        match kv.transfer().commit_import(ticket.id).await {
            Ok(blocks) => Ok(ImportOutcome::Committed { blocks }),
            Err(e) if expired(&e) => Ok(ImportOutcome::Aborted {
                reason: AbortReason::Expired,
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// The first block of the ticket whose pages differ from the exporter's digest
    /// (`None`: all equal, or the session takes no digests).
    fn first_differing_block(
        &self,
        ticket: &ImportTicket,
        written: &Written,
    ) -> Result<Option<usize>, SessionError> {
        let Some(theirs) = &written.digests else {
            return Ok(None);
        };
        let local = &self.local;
        // SAFETY: this engine's pools (registered at `open`, alive by its contract);
        // the pages are reserved by the import, renewed just now, whose bytes have landed
        // (the notification came) and whose window is closed: nothing writes them until
        // it is committed or aborted.
        let ours = blocking(|| unsafe { host_block_digests(local, &ticket.blocks, &ticket.tail) })?;
        Ok(ours.iter().zip(theirs).position(|(a, b)| a != b))
    }
}

/// When the ticket's bytes must have landed.
fn deadline(ticket: &ImportTicket) -> Instant {
    ticket
        .write_by
        .unwrap_or_else(|| Instant::now() + Duration::from_millis(ticket.write_within_ms))
}

fn peer_gone(e: &SessionError) -> AbortReason {
    AbortReason::PeerGone { why: e.to_string() }
}
