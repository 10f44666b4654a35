//! The exporter's half of a transfer: offer the pinned blocks, take the importer's
//! ticket, write the pages (with their digests), hear the importer's verdict.

use tokio::io::{AsyncRead, AsyncWrite};

use dsa_kv_device::transfer::{
    plan_writes, push_plan, ExportedBlocks, ImportTicket, PushError, TransferReport,
};

use super::open::{blocking, notification};
use super::{
    host_block_digests, BlockDigest, ImportOutcome, SessionError, SessionMsg, TransferSession,
};

/// What a whole hand-over ([`TransferSession::hand_over`]) came to.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum HandOver {
    /// The importer reserved nothing (no room, or it declined): nothing moved.
    Declined {
        /// The importer's reason.
        why: String,
    },
    /// Every page was written; the importer's verdict.
    Pushed {
        /// What moved.
        report: TransferReport,
        /// What the importer made of it.
        outcome: ImportOutcome,
    },
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> TransferSession<S> {
    /// The whole exporter's side of one transfer of `export` (pinned by
    /// `Transfers::export`): [`offer`](Self::offer), [`wait_ticket`](Self::wait_ticket),
    /// [`push`](Self::push), [`wait_outcome`](Self::wait_outcome). The export is
    /// released in every case but one: a write that may still be reading its pages
    /// ([`SessionError::in_flight`]) keeps them pinned until the export's lease ends.
    /// A failure after the offer and before the outcome is reported to the peer
    /// (`Failed`) before it is returned.
    pub async fn hand_over(&mut self, export: &ExportedBlocks) -> Result<HandOver, SessionError> {
        let r = self.hand_over_pinned(export).await;
        let keep_pinned = matches!(&r, Err(e) if e.in_flight());
        if !keep_pinned {
            let released = self.kv.transfer().release_export(export.id).await;
            if r.is_ok() {
                released?;
            }
        }
        r
    }

    async fn hand_over_pinned(
        &mut self,
        export: &ExportedBlocks,
    ) -> Result<HandOver, SessionError> {
        self.offer(export).await?;
        let ticket = match self.wait_ticket(export).await {
            Ok(Ok(t)) => t,
            Ok(Err(why)) => return Ok(HandOver::Declined { why }),
            Err(e) => {
                // The importer may hold pages for a ticket this side never took: it may
                // free them now.
                self.tell_failed(export, &e, false).await;
                return Err(e);
            }
        };
        // `push` reports its own failures to the peer.
        let report = self.push(export, &ticket).await?;
        let outcome = self.wait_outcome(export, &ticket).await?;
        Ok(HandOver::Pushed { report, outcome })
    }

    /// Sends the `Offer` of `export`.
    pub async fn offer(&mut self, export: &ExportedBlocks) -> Result<(), SessionError> {
        self.wire
            .send(&SessionMsg::Offer {
                export: export.clone(),
            })
            .await?;
        Ok(())
    }

    /// The importer's answer to the offer of `export`: its ticket, or (`Err`) why it
    /// reserved nothing.
    pub async fn wait_ticket(
        &mut self,
        export: &ExportedBlocks,
    ) -> Result<Result<ImportTicket, String>, SessionError> {
        match self.wire.recv_within(self.options.reply_timeout).await? {
            SessionMsg::Ticket {
                export: id,
                ticket,
                why,
            } if id == export.id => match ticket {
                Some(t) if t.export == export.id => Ok(Ok(t)),
                Some(t) => Err(SessionError::Unexpected {
                    expected: "a ticket for this export",
                    got: format!("a ticket for export {}", t.export),
                }),
                None => Ok(Err(
                    why.unwrap_or_else(|| "the importer gave no reason".into())
                )),
            },
            SessionMsg::Failed {
                export: id,
                why,
                in_flight,
            } if id == export.id => Err(SessionError::PeerFailed {
                export: id,
                why,
                in_flight,
            }),
            other => Err(unexpected("the Ticket for this export", &other)),
        }
    }

    /// Renews the export's lease, writes the exported blocks the ticket asks for into the
    /// importer's reserved pages (the plan checks the ticket against the export and both
    /// engines' pools first), takes their digests when the session checks them, and
    /// sends `Written`.
    /// On a failure the peer is sent `Failed` (saying whether a write may still be
    /// landing) and the error returned. The export stays pinned: release it after
    /// (`Transfers::release_export`), unless the error is
    /// [`in_flight`](SessionError::in_flight). Blocks the task for the write (the
    /// transport's write is synchronous), off the async worker on a multi-thread
    /// runtime.
    pub async fn push(
        &mut self,
        export: &ExportedBlocks,
        ticket: &ImportTicket,
    ) -> Result<TransferReport, SessionError> {
        // The export's lease started at the export: the ticket may have taken a while.
        // Renewed now, its pins hold through the write and the digests (a lease that ran
        // out already is `TransferExpired`: its blocks may have moved, nothing is written).
        let r = match self.kv.transfer().renew(export.id).await {
            Ok(_) => self.push_pages(export, ticket),
            Err(e) => Err(e.into()),
        };
        match r {
            Ok((report, digests)) => {
                self.wire
                    .send(&SessionMsg::Written {
                        export: export.id,
                        import: ticket.id,
                        report,
                        digests,
                    })
                    .await?;
                Ok(report)
            }
            Err(e) => {
                self.tell_failed(export, &e, e.in_flight()).await;
                Err(e)
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn push_pages(
        &mut self,
        export: &ExportedBlocks,
        ticket: &ImportTicket,
    ) -> Result<(TransferReport, Option<Vec<BlockDigest>>), SessionError> {
        let plan = plan_writes(export, &self.local, ticket, &self.remote)?;
        #[cfg(feature = "testing")]
        let plan = match &self.plan_edit {
            Some(edit) => edit(plan),
            None => plan,
        };
        let note = notification(export.id.0, ticket.id.0);
        let (transport, peer) = (&mut self.transport, &self.peer);
        let report = blocking(|| push_plan(transport.as_mut(), peer, ticket, &plan, &note))
            .map_err(|e: PushError| SessionError::Push(e))?;
        let digests = if self.options.digests {
            // `plan_writes` checked the ticket against the export: `skipped` is in range.
            let written = &export.blocks[ticket.skipped as usize..];
            // The tail moved only where the ticket reserved pages for it.
            let tail: &[_] = if ticket.tail.is_empty() {
                &[]
            } else {
                &export.tail
            };
            let local = &self.local;
            // SAFETY: this engine's pools (registered at `open`, alive by its
            // contract); the blocks are pinned by the export, which the caller releases
            // only after this call.
            Some(blocking(|| unsafe {
                host_block_digests(local, written, tail)
            })?)
        } else {
            None
        };
        Ok((report, digests))
    }

    /// Tells the importer this export failed with `e` (best effort: the peer may be the
    /// reason it failed, so a send error is not reported).
    async fn tell_failed(&mut self, export: &ExportedBlocks, e: &SessionError, in_flight: bool) {
        let _ = self
            .wire
            .send(&SessionMsg::Failed {
                export: export.id,
                why: e.to_string(),
                in_flight,
            })
            .await;
    }

    /// The importer's verdict on the transfer `export` → `ticket` (its `Outcome`).
    pub async fn wait_outcome(
        &mut self,
        export: &ExportedBlocks,
        ticket: &ImportTicket,
    ) -> Result<ImportOutcome, SessionError> {
        // The importer waits up to the ticket's deadline for the notification, then
        // checks digests: allow that on top of the usual reply time (the ticket's
        // deadline is the peer's word: at most another reply time).
        let write = std::time::Duration::from_millis(ticket.write_within_ms)
            .min(self.options.reply_timeout);
        let within = self.options.reply_timeout.saturating_add(write);
        match self.wire.recv_within(within).await? {
            SessionMsg::Outcome {
                export: e,
                import: i,
                outcome,
            } if (e, i) == (export.id, ticket.id) => Ok(outcome),
            other => Err(unexpected("the Outcome of this transfer", &other)),
        }
    }
}

/// The error for a frame the protocol does not allow where `expected` was due.
pub(super) fn unexpected(expected: &'static str, got: &SessionMsg) -> SessionError {
    let about = match got {
        SessionMsg::Offer { export } => format!(" (export {})", export.id),
        SessionMsg::Ticket { export, .. }
        | SessionMsg::Written { export, .. }
        | SessionMsg::Failed { export, .. }
        | SessionMsg::Outcome { export, .. } => format!(" (export {export})"),
        SessionMsg::Hello { .. } | SessionMsg::Bye => String::new(),
    };
    SessionError::Unexpected {
        expected,
        got: format!("{}{about}", got.kind()),
    }
}
