//! DeepSeek-V4's caches (the plan in ARCHITECTURE.md): the bytes one 256-token block and
//! one decoding request's windows cost, worked out independently of the planner
//! ([`V4BlockBytes`], [`V4WindowBytes`]), and the pool plan itself ([`V4Plan`]): up to five
//! life cycles (the compressed caches kept like MLA blocks; the raw window, the two
//! compressor states and the published MTP layer's target input kept only for a window),
//! each with its own page size, pools and
//! page-index converters.

mod bytes;
mod plan;

pub(crate) use bytes::pages_touched;
pub use bytes::{V4BlockBytes, V4WindowBytes};
pub use plan::{Retention, V4Buffer, V4LifeCycle, V4LifeCycleKind, V4PageFormat, V4Plan, V4Pool};
