//! KV transfer between engines on the runtime: the coordinator's export / import
//! messages (thin: the scheduler does the work) and the handle's methods. See
//! [`crate::transfer`] for the protocol.

use kameo::message::{Context, Message};
use sha2::{Digest, Sha256};

use super::coordinator::{Coordinator, Devices};
use super::device::PoolRegions;
use super::error::RuntimeError;
use super::handle::KvCacheHandle;
use crate::core::{BlockKey, ReuseScope};
use crate::ids::{RequestId, TokenId};
use crate::transfer::{CacheKind, ExportedBlocks, ImportTicket, PoolRef, PoolRegion};

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
        h.update((self.num_devices() as u64).to_le_bytes());
        h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Every pool of both caches (what each transfer must cover).
    fn layout_pools(&self) -> Vec<PoolRef> {
        let caches = std::iter::once((CacheKind::Target, self.sched.target()))
            .chain(self.sched.draft().map(|d| (CacheKind::Draft, d)));
        caches
            .flat_map(|(cache, m)| {
                m.plan().pool_groups().iter().flat_map(move |g| {
                    g.pools.iter().map(move |p| PoolRef {
                        cache,
                        group: g.id,
                        pool: p.id.get(),
                    })
                })
            })
            .collect()
    }
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
        let blocks = self.sched.export_blocks(m.id, m.scope, &m.tokens)?;
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
        })
    }
}

/// Reserve pages for incoming blocks.
pub(super) struct BeginImport {
    id: RequestId,
    scope: ReuseScope,
    tokens: Vec<TokenId>,
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
        let Some(r) = self.sched.begin_import(m.id, m.scope, &m.tokens, &m.keys)? else {
            return Ok(None);
        };
        Ok(Some(ImportTicket {
            id: m.id,
            skipped: r.skipped,
            layout,
            pools: self.layout_pools(),
            blocks: r.blocks,
        }))
    }
}

/// Link an import's blocks into the reuse trees.
pub(super) struct CommitImport(RequestId);

impl Message<CommitImport> for Coordinator {
    type Reply = Result<u32, RuntimeError>;

    async fn handle(&mut self, m: CommitImport, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let n = self.sched.commit_import(m.0)?;
        // The new blocks reach the router stream in order with everything else.
        self.drain_events();
        Ok(n)
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
        self.sched.close_transfer(m.0)?;
        self.drain_events();
        Ok(())
    }
}

impl KvCacheHandle {
    /// Every pool of every device's target and draft caches, on both tiers, as memory a
    /// [`KvTransport`](crate::transfer::KvTransport) registers (device index in each
    /// region). The addresses never change while the runtime lives.
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn transfer_regions(&self) -> Result<Vec<PoolRegion>, RuntimeError> {
        let devices = self.coordinator.ask(Devices).await?;
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
    /// [`release_export`](Self::release_export); `id` shares the requests' id space.
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id, tokens = tokens.len()))]
    pub async fn export_blocks(
        &self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<ExportedBlocks, RuntimeError> {
        let e = self
            .coordinator
            .ask(ExportBlocks {
                id,
                scope,
                tokens: tokens.to_vec(),
            })
            .await?;
        if let Err(err) = self.synchronize().await {
            let _ = self.release_export(id).await;
            return Err(err);
        }
        Ok(e)
    }

    /// Releases an export's blocks (they may be evicted or moved again).
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id))]
    pub async fn release_export(&self, id: RequestId) -> Result<(), RuntimeError> {
        Ok(self.coordinator.ask(CloseTransfer(id)).await?)
    }

    /// Reserves GPU pages for the exported blocks this engine does not hold (leading
    /// blocks it already caches are skipped), after checking the layouts agree and the
    /// keys are what this engine computes for the tokens; waits until no device work
    /// still reads the reserved slots. `Ok(None)` when there is no room now, or when
    /// making room planned copies (offloads) that only the next step runs: nothing is
    /// reserved; retry after a step. Write the bytes, then
    /// [`commit_import`](Self::commit_import), or [`abort_import`](Self::abort_import).
    #[tracing::instrument(level = "debug", skip_all, fields(id = %export.id, blocks = export.blocks.len()))]
    pub async fn begin_import(
        &self,
        export: &ExportedBlocks,
    ) -> Result<Option<ImportTicket>, RuntimeError> {
        let ticket = self
            .coordinator
            .ask(BeginImport {
                id: export.id,
                scope: export.scope,
                tokens: export.tokens.clone(),
                keys: export.blocks.iter().map(|b| b.key).collect(),
                layout: export.layout.clone(),
            })
            .await?;
        if ticket.is_some() {
            if let Err(err) = self.synchronize().await {
                let _ = self.abort_import(export.id).await;
                return Err(err);
            }
        }
        Ok(ticket)
    }

    /// Links the imported blocks into the reuse trees at once (their bytes have landed);
    /// returns how many blocks it brought. A request submitted afterwards reuses them.
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id))]
    pub async fn commit_import(&self, id: RequestId) -> Result<u32, RuntimeError> {
        Ok(self.coordinator.ask(CommitImport(id)).await?)
    }

    /// Abandons an import: its reserved pages are freed and nothing of it enters the
    /// reuse tree (after a failed or partial transfer).
    #[tracing::instrument(level = "debug", skip_all, fields(id = %id))]
    pub async fn abort_import(&self, id: RequestId) -> Result<(), RuntimeError> {
        Ok(self.coordinator.ask(CloseTransfer(id)).await?)
    }
}
