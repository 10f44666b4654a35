//! dsa-kv as an NVIDIA Dynamo backend: a Dynamo worker (`dsa-kv-dynamo`) that serves the
//! reference DSA model from the dsa-kv runtime behind Dynamo's OpenAI frontend and KV
//! router.
//!
//! * [`engine`]: Dynamo's `LLMEngine` over the runtime.
//! * [`serving`]: the engine loop (admit, step, commit, stream, cancel).
//! * [`stop`]: when a request ends, from Dynamo's stop conditions.
//! * [`verify`]: every request checked against the unpaged model.
//! * [`fixture`]: the model directory the frontend reads (tokenizer, config, chat
//!   template), written by code.
//!
//! This crate is its own Cargo workspace (see its `Cargo.toml`); build it from this
//! directory, where `.cargo/config.toml` sets the `--cfg tokio_unstable` Dynamo needs.

pub mod engine;
pub mod fixture;
pub mod serving;
pub mod stop;
pub mod verify;
