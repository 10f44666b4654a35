//! Engines for the transfer tests: DeepSeek-V3.2 page sizes cut to a few layers, an MTP
//! draft cache, synthetic KV (so the runtime's verifier can read imported pages back),
//! and the prefill that fills their cache.

use dsa_kv::actors::{KvCacheBuilder, KvCacheHandle};
use dsa_kv::config::{EngineConfig, SpecMode};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};

use super::engine::run_to_end;

/// The reuse scope of the tests' requests.
pub(crate) const SCOPE: ReuseScope = ReuseScope::SHARED;

/// `layers` layers of DeepSeek-V3.2 with an MTP draft cache, room for sequences of
/// `blocks + 4` blocks, twice over; a host tier of `host_bytes` (`None`: the default).
pub(crate) fn config(layers: u32, blocks: u32, host_bytes: Option<u64>) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(layers);
    c.spec_decode.mode = SpecMode::Mtp;
    c.spec_decode.draft_tokens = 1;
    c.kv_cache.max_tokens = Some(u64::from(blocks + 4) * 64 * 2);
    c.scheduler.max_seq_len = (blocks + 4) * 64;
    c.scheduler.max_num_tokens = 4096;
    c.kv_cache.host_cache_size = host_bytes;
    c
}

/// A synthetic-writer engine of configuration `c` on `devices` host devices.
pub(crate) async fn engine(c: EngineConfig, devices: usize) -> KvCacheHandle {
    KvCacheBuilder::new()
        .config(c)
        .host_devices(devices)
        .start()
        .await
        .expect("the engine starts")
}

/// Runs request `id` (`prompt` under `scope`, two new tokens) to its end on `kv`, which
/// then caches the prompt's full blocks.
pub(crate) async fn prefill(kv: &KvCacheHandle, id: RequestId, scope: ReuseScope, p: &[TokenId]) {
    let mut r = SubmitRequest::new(id, p.to_vec(), 2);
    r.scope = scope;
    kv.submit(r).await.expect("submitted");
    run_to_end(kv, || {}).await;
}
