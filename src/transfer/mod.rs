//! KV pages between engines (prefill / decode disaggregation): the transport trait and
//! what it moves, the plan of a push, the local transport, NIXL (feature `nixl`) and the
//! NCCL transport of the CUDA backend (feature `nccl`), all from `dsa-kv-device` and
//! `dsa-kv-cuda`; and [`session`], the protocol two engines speak to move a request's
//! prefix over a transport (handshake, offer, ticket, write, commit), on a bounded wire.

pub mod session;

#[cfg(feature = "nccl")]
pub use dsa_kv_cuda::nccl;
#[cfg(feature = "nixl")]
pub use dsa_kv_device::transfer::nixl;
#[cfg(feature = "testing")]
pub use dsa_kv_device::transfer::*;
pub use dsa_kv_device::transfer::{
    plan_writes, push, push_plan, BlockPages, CacheKind, ExportedBlocks, ImportTicket, KvTransport,
    LocalTransport, MemKind, MemRegion, PageLoc, PeerId, PlanError, PoolRef, PoolRegion, PushError,
    Segment, TransferReport, TransportError, WriteBatch, WritePlan, WriteReport, MAX_NOTIFICATION,
    MAX_PENDING_NOTIFICATIONS,
};
