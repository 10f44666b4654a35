//! Router events on the wire (feature `zmq`): the vLLM / NVIDIA Dynamo ZMQ KV-event
//! format that KV-aware routers already decode.
//!
//! ```no_run
//! # async fn f(kv: dsa_kv::actors::KvCacheHandle) -> Result<(), Box<dyn std::error::Error>> {
//! use dsa_kv::publish::{ZmqPublisher, ZmqPublisherConfig};
//! let publisher = ZmqPublisher::start(
//!     kv.subscribe_events().await?,
//!     ZmqPublisherConfig { endpoint: "tcp://0.0.0.0:5557".into(), ..Default::default() },
//! )
//! .await?;
//! // ... serve requests; a router subscribes to publisher.endpoint() ...
//! let report = publisher.shutdown().await;
//! # Ok(()) }
//! ```

mod wire;
mod zmq;

pub use wire::{encode_batch, WireEncoding};
pub use zmq::{PublishError, PublisherReport, ZmqPublisher, ZmqPublisherConfig, END_OF_REPLAY};
