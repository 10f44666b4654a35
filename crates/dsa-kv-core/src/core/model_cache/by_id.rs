//! [`CacheById`]: a [`ModelCache`] driven by request id, for tools and tests that drive
//! the cache by hand (a dump, an exactness test); the scheduler keeps its handles
//! itself.

use std::collections::HashMap;

use super::ModelCache;
use crate::core::error::KvError;
use crate::core::manager::{SeqHandle, SeqOptions};
use crate::core::reuse_key::ReuseScope;
use crate::core::window::WindowError;
use crate::ids::{LifeCycleId, RequestId, SlotId, TokenId};

/// A [`ModelCache`] and the handle of every sequence it created. See the module docs.
pub struct CacheById {
    cache: ModelCache,
    handles: HashMap<RequestId, SeqHandle>,
}

impl CacheById {
    /// Drives `cache` by request id.
    pub fn new(cache: ModelCache) -> Self {
        CacheById {
            cache,
            handles: HashMap::new(),
        }
    }

    /// The cache.
    pub fn cache(&self) -> &ModelCache {
        &self.cache
    }

    /// The cache, writable (transfers, copies, fences: what takes no handle).
    pub fn cache_mut(&mut self) -> &mut ModelCache {
        &mut self.cache
    }

    /// Request `id`'s handle.
    pub fn handle(&self, id: RequestId) -> Result<&SeqHandle, KvError> {
        self.handles.get(&id).ok_or(KvError::UnknownRequest { id })
    }

    /// Creates `id` for `prompt` (see [`ModelCache::create`]); returns the prompt tokens
    /// served from the cache.
    pub fn create(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        prompt: &[TokenId],
        opts: SeqOptions,
    ) -> Result<u64, KvError> {
        if self.handles.contains_key(&id) {
            return Err(KvError::DuplicateRequest { id });
        }
        let c = self.cache.create(id, scope, prompt, opts)?;
        self.handles.insert(id, c.handle);
        Ok(c.reused_tokens)
    }

    /// See [`ModelCache::resume`].
    pub fn resume(&mut self, id: RequestId) -> Result<bool, KvError> {
        let h = self
            .handles
            .get(&id)
            .ok_or(KvError::UnknownRequest { id })?;
        self.cache.resume(h)
    }

    /// See [`ModelCache::suspend`].
    pub fn suspend(&mut self, id: RequestId) -> Result<(), KvError> {
        let h = self
            .handles
            .get(&id)
            .ok_or(KvError::UnknownRequest { id })?;
        self.cache.suspend(h)
    }

    /// See [`ModelCache::resize`].
    pub fn resize(&mut self, id: RequestId, capacity: u64, history: u64) -> Result<bool, KvError> {
        let h = self
            .handles
            .get(&id)
            .ok_or(KvError::UnknownRequest { id })?;
        self.cache.resize(h, capacity, history)
    }

    /// See [`ModelCache::commit`].
    pub fn commit(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), KvError> {
        let h = self
            .handles
            .get(&id)
            .ok_or(KvError::UnknownRequest { id })?;
        self.cache.commit(h, tokens)
    }

    /// See [`ModelCache::close`]; the handle goes.
    pub fn close(&mut self, id: RequestId) -> Result<(), KvError> {
        let mut h = self
            .handles
            .remove(&id)
            .ok_or(KvError::UnknownRequest { id })?;
        self.cache.close(&mut h)
    }

    /// Committed tokens of `id`.
    pub fn committed(&self, id: RequestId) -> Result<u64, KvError> {
        Ok(self.cache.info_of(self.handle(id)?)?.committed)
    }

    /// The GPU slots of `id`'s blocks.
    pub fn block_slots(&self, id: RequestId) -> Result<Vec<SlotId>, KvError> {
        self.cache.block_slots(self.handle(id)?, LifeCycleId(0))
    }

    /// `id`'s page table of window life cycle `lc` (an index among the window life
    /// cycles): the first position held and the slots.
    pub fn window_table(&self, id: RequestId, lc: usize) -> Result<(u64, Vec<SlotId>), KvError> {
        self.handle(id)?;
        let w = self
            .cache
            .windows()
            .ok_or(KvError::Window(WindowError::NoLifeCycle { lc, count: 0 }))?;
        Ok(w.page_table(id, lc)?)
    }

    /// Sequences with a handle here.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether no sequence has a handle here.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }
}
