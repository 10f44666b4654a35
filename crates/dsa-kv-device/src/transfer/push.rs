//! The exporter's half of a transfer: pair the exported blocks with the importer's
//! ticket ([`plan_writes`]), write them through a [`KvTransport`], and deliver the
//! notification the importer commits on.

use serde::{Deserialize, Serialize};

use super::{
    plan_writes, ExportedBlocks, ImportTicket, KvTransport, PeerId, PlanError, PoolRegion,
    TransportError, WritePlan, WriteReport,
};

/// What [`push`] moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferReport {
    /// Blocks written (the exported blocks the importer did not hold).
    pub blocks: usize,
    /// Leading blocks the importer already held (not written).
    pub skipped: u32,
    /// Pages written (blocks × life cycles × caches × devices).
    pub pages: u64,
    /// Descriptors before coalescing (one per page per pool).
    pub uncoalesced: usize,
    /// What the transport did (descriptors posted, bytes, time).
    pub write: WriteReport,
}

/// A failed [`push`]: nothing is committed on either side; the importer must abort.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// The two sides cannot be paired.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// The exporter's half of a transfer: pairs the exported blocks with the importer's
/// ticket and pool regions ([`plan_writes`]) and writes them through `transport`, which
/// then delivers `notification` to the importer. The importer commits after the
/// notification (or aborts when told the push failed). Renew the export's lease
/// (`KvCacheHandle::renew_transfer`)
/// first when the push may outlast what is left of it.
pub fn push(
    transport: &mut dyn KvTransport,
    peer: &PeerId,
    export: &ExportedBlocks,
    local: &[PoolRegion],
    ticket: &ImportTicket,
    remote: &[PoolRegion],
    notification: &[u8],
) -> Result<TransferReport, PushError> {
    let plan = plan_writes(export, local, ticket, remote)?;
    push_plan(transport, peer, ticket, &plan, notification)
}

/// [`push`] of a plan already made (e.g. altered by [`WritePlan::without_pools`] in a
/// mutation drill).
pub fn push_plan(
    transport: &mut dyn KvTransport,
    peer: &PeerId,
    ticket: &ImportTicket,
    plan: &WritePlan,
    notification: &[u8],
) -> Result<TransferReport, PushError> {
    let write = transport.write(peer, &plan.batches, notification)?;
    Ok(TransferReport {
        blocks: ticket.blocks.len(),
        skipped: ticket.skipped,
        pages: plan.pages,
        uncoalesced: plan.uncoalesced,
        write,
    })
}
