//! Router events on the wire (feature `zmq`): the vLLM / NVIDIA Dynamo ZMQ KV-event
//! format that KV-aware routers already decode.
//!
//! ```no_run
//! # async fn f(kv: dsa_kv::actors::KvCacheHandle) -> Result<(), Box<dyn std::error::Error>> {
//! use dsa_kv::publish::{ZmqPublisher, ZmqPublisherConfig};
//! // Loopback by default; bind an address other hosts reach (a cluster network) only
//! // where the routers run elsewhere: the publisher has no authentication.
//! let publisher = ZmqPublisher::start(
//!     kv.events().subscribe().await?,
//!     ZmqPublisherConfig { endpoint: "tcp://127.0.0.1:5557".into(), ..Default::default() },
//! )
//! .await?;
//! // ... serve requests; a router subscribes to publisher.endpoint() ...
//! let report = publisher.shutdown().await;
//! # Ok(()) }
//! ```

mod wire;
mod zmq;
mod zmtp;

pub use wire::{encode_batch, WireEncoding};
pub use zmq::{
    EventSource, PublishError, PublisherReport, ZmqLimits, ZmqPublisher, ZmqPublisherConfig,
    END_OF_REPLAY,
};
