//! KV transfer between engines on the runtime: the coordinator's export / import
//! messages (thin: the scheduler does the work), the lease timer, and the handle's
//! methods. See [`crate::transfer`] for the protocol.

use std::time::{Duration, Instant};

use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use sha2::{Digest, Sha256};

use super::coordinator::{Coordinator, Devices};
use super::device::PoolRegions;
use super::error::RuntimeError;
use super::handle::KvCacheHandle;
use dsa_kv_core::core::scheduler::{BlockPages, TRANSFER_DRAIN};
use dsa_kv_core::core::{BlockKey, ReuseScope};
use dsa_kv_core::ids::{PoolGroupId, RequestId, TokenId};
use dsa_kv_core::layout::Retention;
use dsa_kv_device::transfer::{
    CacheKind, ExportedBlocks, ImportTicket, KvTransport, PeerId, PoolRef, PoolRegion, WindowTail,
};

impl Coordinator {
    /// What both engines of a transfer must agree on: the pool plans of the target and
    /// draft caches and the number of devices.
    fn layout_fingerprint(&self) -> String {
        let mut h = Sha256::new();
        // The plans' debug form is deterministic (vectors and ordered maps) and covers
        // every field; builds of different versions may disagree, which is the safe side.
        h.update(format!("{:?}", self.sched.target().plan()));
        if let Some(d) = self.sched.draft() {
            h.update(format!("draft {:?}", d.plan()));
        }
        if let Some(w) = &self.windowed {
            h.update(format!("windowed {w:?}"));
        }
        h.update((self.num_devices() as u64).to_le_bytes());
        h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Every pool of both caches, and of a windowed model's window life cycles (what
    /// each transfer must cover).
    fn layout_pools(&self) -> Vec<PoolRef> {
        let caches = std::iter::once((CacheKind::Target, self.sched.target().blocks()))
            .chain(self.sched.draft().map(|d| (CacheKind::Draft, d)));
        let mut out: Vec<PoolRef> = caches
            .flat_map(|(cache, m)| {
                m.plan().pool_groups().iter().flat_map(move |g| {
                    g.pools.iter().map(move |p| PoolRef {
                        cache,
                        group: g.id,
                        pool: p.id.get(),
                    })
                })
            })
            .collect();
        if let Some(plan) = &self.windowed {
            let windows = plan
                .life_cycles()
                .iter()
                .filter(|lc| lc.retention != Retention::Full);
            for (w, lc) in windows.enumerate() {
                out.extend(lc.pools.iter().map(|p| PoolRef {
                    cache: CacheKind::Window(w as u16),
                    group: PoolGroupId(0),
                    pool: p.id.get(),
                }));
            }
        }
        out
    }

    /// A windowed model's export: its cached whole blocks up to the deepest boundary
    /// with a tail, and that tail.
    fn export_prefix(&mut self, m: ExportBlocks) -> Result<ExportedBlocks, RuntimeError> {
        let Some(p) = self
            .sched
            .export_prefix(m.id, m.scope, &m.tokens, Instant::now())?
        else {
            return Err(RuntimeError::Transfer(format!(
                "export {}: no whole block of these tokens with a window tail at its boundary \
                 is cached here, so nothing was pinned: the importer prefills the prompt itself",
                m.id
            )));
        };
        let mut tokens = m.tokens;
        tokens.truncate(p.boundary as usize);
        Ok(ExportedBlocks {
            id: m.id,
            scope: m.scope,
            tokens,
            tokens_per_block: self.sched.target().tokens_per_block() as u32,
            layout: self.layout_fingerprint(),
            pools: self.layout_pools(),
            blocks: p.blocks.into_iter().map(BlockPages::from).collect(),
            tail: WindowTail::of_tables(p.tails),
        })
    }
}

/// The lease of an export or an import.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// When it ends: the export is then released, the import aborted.
    pub expires: Instant,
    /// The last moment an import's bytes may land (a drain margin before `expires`):
    /// the deadline of the transport window the importer opens for it.
    pub write_by: Instant,
}

/// Pin the cached full blocks of a prefix for a transfer.
pub(super) struct ExportBlocks {
    id: RequestId,
    scope: ReuseScope,
    tokens: Vec<TokenId>,
}

impl Message<ExportBlocks> for Coordinator {
    type Reply = Result<ExportedBlocks, RuntimeError>;

    async fn handle(&mut self, m: ExportBlocks, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if self.windowed.is_some() {
            return self.export_prefix(m);
        }
        let blocks = self
            .sched
            .export_blocks(m.id, m.scope, &m.tokens, Instant::now())?;
        let tpb = self.sched.target().tokens_per_block() as usize;
        let mut tokens = m.tokens;
        tokens.truncate(blocks.len() * tpb);
        Ok(ExportedBlocks {
            id: m.id,
            scope: m.scope,
            tokens,
            tokens_per_block: tpb as u32,
            layout: self.layout_fingerprint(),
            pools: self.layout_pools(),
            blocks,
            tail: Vec::new(),
        })
    }
}

/// Reserve pages for incoming blocks, bound to the importer's own request.
pub(super) struct BeginImport {
    id: RequestId,
    scope: ReuseScope,
    tokens: Vec<TokenId>,
    export: RequestId,
    keys: Vec<BlockKey>,
    layout: String,
}

impl Message<BeginImport> for Coordinator {
    type Reply = Result<Option<ImportTicket>, RuntimeError>;

    async fn handle(&mut self, m: BeginImport, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let layout = self.layout_fingerprint();
        if m.layout != layout {
            return Err(RuntimeError::Transfer(format!(
                "the exporter's KV layout {} differs from this engine's {layout}: both must run \
                 the same model, KV dtypes, layout kind, draft cache and tensor-parallel size",
                m.layout
            )));
        }
        // The importer's tokens say what is imported: the exporter's blocks must be the
        // leading full blocks of the request this engine will serve.
        let tpb = self.sched.target().tokens_per_block() as usize;
        let want = m.keys.len() * tpb;
        if m.keys.is_empty() {
            return Err(RuntimeError::Transfer(format!(
                "import {}: the export holds no block, so there is nothing to import (the \
                 exporter had none of the prompt's full blocks cached)",
                m.id
            )));
        }
        if m.tokens.len() < want {
            return Err(RuntimeError::Transfer(format!(
                "import {}: the export has {} blocks ({want} tokens) but the request to serve has \
                 {} tokens: import only blocks of the request's own prompt",
                m.id,
                m.keys.len(),
                m.tokens.len()
            )));
        }
        let now = Instant::now();
        let (skipped, blocks, tail, write_by) = if self.windowed.is_some() {
            let Some((p, write_by)) =
                self.sched
                    .begin_prefix_import(m.id, m.scope, &m.tokens[..want], &m.keys, now)?
            else {
                return Ok(None);
            };
            let blocks = p.blocks.into_iter().map(BlockPages::from).collect();
            (p.skipped, blocks, WindowTail::of_tables(p.tails), write_by)
        } else {
            let Some(r) =
                self.sched
                    .begin_import(m.id, m.scope, &m.tokens[..want], &m.keys, now)?
            else {
                return Ok(None);
            };
            (r.skipped, r.blocks, Vec::new(), r.write_by)
        };
        Ok(Some(ImportTicket {
            id: m.id,
            export: m.export,
            skipped,
            layout,
            pools: self.layout_pools(),
            blocks,
            tail,
            write_within_ms: write_by.saturating_duration_since(now).as_millis() as u64,
            write_by: Some(write_by),
        }))
    }
}

/// Link an import's blocks into the reuse trees.
pub(super) struct CommitImport(RequestId);

impl Message<CommitImport> for Coordinator {
    type Reply = Result<u32, RuntimeError>;

    async fn handle(&mut self, m: CommitImport, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let n = if self.windowed.is_some() {
            self.sched.commit_prefix_import(m.0, Instant::now())
        } else {
            self.sched.commit_import(m.0, Instant::now())
        };
        // The new blocks (or an expiry's freed pages) reach the router stream in order
        // with everything else.
        self.drain_events();
        Ok(n?)
    }
}

/// Release an export or abort an import.
pub(super) struct CloseTransfer(RequestId);

impl Message<CloseTransfer> for Coordinator {
    type Reply = Result<(), RuntimeError>;

    async fn handle(
        &mut self,
        m: CloseTransfer,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let r = self.sched.close_transfer(m.0);
        self.drain_events();
        Ok(r?)
    }
}

/// Start a transfer's lease again.
pub(super) struct RenewTransfer(RequestId);

impl Message<RenewTransfer> for Coordinator {
    type Reply = Result<Lease, RuntimeError>;

    async fn handle(
        &mut self,
        m: RenewTransfer,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let expires = self.sched.renew_transfer(m.0, Instant::now());
        self.drain_events();
        let expires = expires?;
        Ok(Lease {
            expires,
            write_by: expires - TRANSFER_DRAIN.min(self.sched.transfer_lease() / 2),
        })
    }
}

/// Close the transfers whose lease ran out (sent by the lease timer).
pub(super) struct ExpireTransfers;

impl Message<ExpireTransfers> for Coordinator {
    type Reply = ();

    async fn handle(&mut self, _: ExpireTransfers, _: &mut Context<Self, Self::Reply>) {
        if self.sched.num_transfers() == 0 {
            return;
        }
        match self.sched.expire_transfers(Instant::now()) {
            Ok(e) if e.exports.is_empty() && e.imports.is_empty() => {}
            Ok(e) => {
                tracing::warn!(
                    exports = ?e.exports,
                    imports = ?e.imports,
                    "KV transfers expired (their lease ran out): exports released, imports aborted and their pages freed"
                );
                metrics::counter!("dsa_kv_transfers_expired_total")
                    .increment((e.exports.len() + e.imports.len()) as u64);
                self.drain_events();
            }
            Err(e) => tracing::error!(error = %e, "expiring KV transfers failed"),
        }
    }
}

/// Sends [`ExpireTransfers`] to the coordinator a tenth of a lease apart (20 ms to 1 s)
/// until it stops, so that an idle engine expires leases too.
pub(super) fn spawn_lease_timer(me: &ActorRef<Coordinator>, lease: Duration) {
    let weak = me.downgrade();
    let every = (lease / 10).clamp(Duration::from_millis(20), Duration::from_secs(1));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let Some(c) = weak.upgrade() else { break };
            if c.tell(ExpireTransfers).await.is_err() {
                break;
            }
        }
    });
}

/// The handle's transfer methods ([`KvCacheHandle::transfer`]): KV pages between engines
/// (prefill/decode disaggregation). The protocol: [`crate::transfer`].
#[derive(Clone, Copy)]
pub struct Transfers<'a> {
    pub(super) kv: &'a KvCacheHandle,
}

impl Transfers<'_> {
    /// Every pool of every device's target and draft caches, on both tiers, as memory a
    /// [`KvTransport`](dsa_kv_device::transfer::KvTransport) registers (device index in each
    /// region). The addresses never change while the runtime lives.
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn regions(&self) -> Result<Vec<PoolRegion>, RuntimeError> {
        let devices = self.kv.coordinator.ask(Devices).await?;
        let mut out = Vec::new();
        for (i, d) in devices.into_iter().enumerate() {
            let d = d.ok_or_else(|| {
                RuntimeError::Transfer(format!("device {i} is gone: its pools cannot be shared"))
            })?;
            let regions = d
                .ask(PoolRegions)
                .await
                .map_err(|e| RuntimeError::NotRunning(format!("{e:?}")))?;
            if regions.is_empty() {
                return Err(RuntimeError::Transfer(format!(
                    "device {i}'s backend does not expose its pools for transfers"
                )));
            }
            out.extend(regions);
        }
        Ok(out)
    }

    /// Pins the cached full blocks of `tokens` (its longest cached prefix of whole blocks,
    /// on the GPU or the host tier, up to the first block still waiting for a planned
    /// copy between tiers) in the target and draft caches, waits until every
    /// device has finished the work that wrote them, and describes them: chained reuse
    /// keys, tokens, slots. They stay where they are until
    /// [`release_export`](Self::release_export) or until the export's lease
    /// (`transfer.lease_ms`) runs out; [`renew`](Self::renew) before a
    /// push that could outlast it. `id` shares the requests' id space.
    ///
    /// A model with sliding windows (DeepSeek-V4) exports its cached whole blocks up to
    /// the deepest boundary that keeps a window tail, and that tail
    /// ([`ExportedBlocks::tail`]): what a request resuming at the boundary reads. With no
    /// such boundary cached nothing is pinned and the export is
    /// [`RuntimeError::Transfer`] (the importer prefills the prompt itself).
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id, tokens = tokens.len()))]
    pub async fn export(
        &self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<ExportedBlocks, RuntimeError> {
        let e = self
            .kv
            .coordinator
            .ask(ExportBlocks {
                id,
                scope,
                tokens: tokens.to_vec(),
            })
            .await?;
        if let Err(err) = self.kv.synchronize().await {
            let _ = self.release_export(id).await;
            return Err(err);
        }
        Ok(e)
    }

    /// Releases an export's blocks (they may be evicted or moved again).
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id))]
    pub async fn release_export(&self, id: RequestId) -> Result<(), RuntimeError> {
        Ok(self.kv.coordinator.ask(CloseTransfer(id)).await?)
    }

    /// Reserves GPU pages for the exported blocks this engine does not hold (leading
    /// blocks it already caches are skipped; a windowed model's ticket also reserves
    /// the export's window tail, unless a tail is kept here at its boundary), for the
    /// request this engine will serve:
    /// `scope` and `tokens` are **the importer's own** (the request's reuse scope and
    /// prompt, not what the exporter says), and the exporter's block keys must equal
    /// the keys this engine computes from them for the exported blocks, so a peer can
    /// plant blocks only under the scope and tokens of a request this engine was asked
    /// to serve. Checks the layouts agree, and waits until no device work still reads
    /// the reserved slots. `id` is the import's own id here (it shares the requests' id
    /// space). `Ok(None)` when there is no room now, or when making room planned copies
    /// (offloads) that only the next step runs: nothing is reserved; retry after a
    /// step. Then: open a window on the transport for the ticket's pages
    /// ([`ImportTicket::write_ranges`], until [`ImportTicket::write_by`]), send the
    /// ticket to the exporter, wait for its notification, then
    /// [`commit_import`](Self::commit_import), or [`abort_import`](Self::abort_import).
    /// The import's lease (`transfer.lease_ms`) aborts it if neither comes in time.
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id, blocks = export.blocks.len()))]
    pub async fn begin_import(
        &self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
        export: &ExportedBlocks,
    ) -> Result<Option<ImportTicket>, RuntimeError> {
        let ticket = self
            .kv
            .coordinator
            .ask(BeginImport {
                id,
                scope,
                tokens: tokens.to_vec(),
                export: export.id,
                keys: export.blocks.iter().map(|b| b.key).collect(),
                layout: export.layout.clone(),
            })
            .await?;
        if ticket.is_some() {
            if let Err(err) = self.kv.synchronize().await {
                let _ = self.abort_import(id).await;
                return Err(err);
            }
        }
        Ok(ticket)
    }

    /// Links the imported blocks into the reuse trees at once (their bytes have landed);
    /// returns how many blocks it brought. A request submitted afterwards reuses them.
    /// An import whose lease ran out is
    /// [`SchedError::TransferExpired`](dsa_kv_core::core::scheduler::SchedError::TransferExpired):
    /// it was aborted then.
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id))]
    pub async fn commit_import(&self, id: RequestId) -> Result<u32, RuntimeError> {
        Ok(self.kv.coordinator.ask(CommitImport(id)).await?)
    }

    /// Abandons an import: its reserved pages are freed and nothing of it enters the
    /// reuse tree (after a failed or partial transfer). Close the transport window first:
    /// a write still landing would reach pages that are about to be reused.
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id))]
    pub async fn abort_import(&self, id: RequestId) -> Result<(), RuntimeError> {
        Ok(self.kv.coordinator.ask(CloseTransfer(id)).await?)
    }

    /// [`begin_import`](Self::begin_import), then a window on `transport` for the
    /// ticket's pages: `peer` (the exporter) may write exactly those
    /// ([`ImportTicket::write_ranges`] of `regions`, this engine's
    /// [`regions`](Self::regions)) until the ticket's
    /// [`write_by`](ImportTicket::write_by), and nothing else. The window's id is the
    /// import's. If the window cannot be opened, the import is aborted.
    #[allow(clippy::too_many_arguments)]
    pub async fn begin_import_with(
        &self,
        transport: &mut dyn KvTransport,
        peer: &PeerId,
        regions: &[PoolRegion],
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
        export: &ExportedBlocks,
    ) -> Result<Option<ImportTicket>, RuntimeError> {
        let Some(ticket) = self.begin_import(id, scope, tokens, export).await? else {
            return Ok(None);
        };
        let opened = ticket
            .write_ranges(regions)
            .map_err(|e| RuntimeError::Transfer(e.to_string()))
            .and_then(|ranges| {
                let by = ticket
                    .write_by
                    .expect("invariant: a ticket of this process has its deadline");
                // SAFETY: the ranges are the pages this import reserved (from its own
                // ticket and this engine's regions): nothing but the transfer writes
                // them until the import is committed or aborted, which closes the
                // window first.
                unsafe { transport.open_window(peer, id.0, &ranges, by) }
                    .map_err(RuntimeError::from)
            });
        if let Err(e) = opened {
            let _ = self.abort_import(id).await;
            return Err(e);
        }
        Ok(Some(ticket))
    }

    /// Closes import `id`'s window on `transport` (no write into it lands any more),
    /// then [`commit_import`](Self::commit_import)s it: call it after the exporter's
    /// notification, once the bytes have landed.
    pub async fn commit_import_with(
        &self,
        transport: &mut dyn KvTransport,
        id: RequestId,
    ) -> Result<u32, RuntimeError> {
        transport.close_window(id.0)?;
        self.commit_import(id).await
    }

    /// Closes import `id`'s window on `transport`, then aborts the import (its pages
    /// are freed). When the transport cannot establish that no write still lands
    /// ([`TransportError::InFlight`](dsa_kv_device::transfer::TransportError::InFlight)), the
    /// import is left open (its pages reserved) and the error returned; its lease
    /// frees it later.
    pub async fn abort_import_with(
        &self,
        transport: &mut dyn KvTransport,
        id: RequestId,
    ) -> Result<(), RuntimeError> {
        transport.close_window(id.0)?;
        self.abort_import(id).await
    }

    /// Starts the lease of export or import `id` again (a long transfer, a slow peer);
    /// returns the new lease. An expired one is
    /// [`SchedError::TransferExpired`](dsa_kv_core::core::scheduler::SchedError::TransferExpired).
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id))]
    pub async fn renew(&self, id: RequestId) -> Result<Lease, RuntimeError> {
        Ok(self.kv.coordinator.ask(RenewTransfer(id)).await?)
    }
}
