//! [`KvCacheManager`]: the synchronous, single-owner state machine the coordinator actor
//! owns. It allocates slots per pool group and tier, keeps the reuse tree, the eviction
//! queues and the sequences, and expresses every byte that must move as a
//! [`CopyPlan`] for storage to execute.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam::queue::SegQueue;
use serde::Serialize;

use super::error::{KvError, SeqStatus};
use super::events::KvEvent;
use super::eviction::{EvictionQueues, DEFAULT_PRIORITY, MAX_PRIORITY};
use super::fence::FenceClock;
use super::pages::PageArena;
use super::radix::{NodeRef, RadixTree};
use super::reuse_key::{BlockKey, KeyHasher, ReuseScope};
use super::router_events::{Medium, RouterEvent};
use super::slot_allocator::SlotAllocator;
use crate::ids::{Fence, LifeCycleId, PageId, PoolGroupId, RequestId, SlotId, Tier, TokenId};
use crate::layout::{PoolPlan, Role};
use crate::ops::CopyPlan;
use crate::rng::SplitMix64;

static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

/// Behaviour switches of a manager.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ManagerOptions {
    /// Keep committed blocks in a radix tree and serve prefixes from it.
    pub enable_block_reuse: bool,
    /// Also reuse a leading part of a block (copied into a private page on resume).
    pub enable_partial_reuse: bool,
    /// `resume` refuses when any pool group's GPU utilization is above this (0, 1].
    pub max_util_for_resume: f64,
    /// Record [`KvEvent`]s for [`KvCacheManager::take_events`].
    pub record_events: bool,
}

impl Default for ManagerOptions {
    fn default() -> Self {
        ManagerOptions {
            enable_block_reuse: true,
            enable_partial_reuse: true,
            max_util_for_resume: 0.97,
            record_events: true,
        }
    }
}

/// Slots per pool group on each tier (`host` empty: no host tier).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierSlots {
    /// GPU slots per pool group.
    pub gpu: Vec<u32>,
    /// Host slots per pool group; empty when there is no host tier.
    pub host: Vec<u32>,
}

/// Per-sequence options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqOptions {
    /// Eviction priority of the blocks this sequence commits (0–100, default 35; lower is
    /// evicted first).
    pub priority: u8,
}

impl Default for SeqOptions {
    fn default() -> Self {
        SeqOptions {
            priority: DEFAULT_PRIORITY,
        }
    }
}

/// The right to drive one sequence. It cannot be cloned: only its owner can resize,
/// commit, suspend, resume or close the sequence.
///
/// **Dropping a handle closes its sequence.** A handle dropped without
/// [`close`](KvCacheManager::close) (an early return, a `?`, a panic unwinding the
/// engine loop) reports its sequence to its manager, which closes it exactly as `close`
/// would (same events, same pages freed, committed blocks stay cached) at the start of
/// its next `&mut self` call, or when [`close_dropped`](KvCacheManager::close_dropped)
/// is called. Until then read-only queries (`usage`, `num_sequences`,
/// `check_invariants`, …) still count the sequence. A handle whose manager is gone
/// reports to nobody, harmlessly. The one way to leak a sequence is to never drop its
/// handle (`std::mem::forget`, a reference cycle): its pages then stay in use, as the
/// invariants allow, until the manager is dropped.
#[derive(Debug)]
pub struct SeqHandle {
    pub(super) id: RequestId,
    pub(super) slot: u32,
    pub(super) gen: u64,
    pub(super) manager: u64,
    pub(super) closed: bool,
    /// Where `drop` reports the sequence when it was not closed.
    pub(super) dropped: DroppedSeqs,
}

impl Drop for SeqHandle {
    fn drop(&mut self) {
        if !self.closed {
            self.dropped.push((self.slot, self.gen));
        }
    }
}

/// Sequences whose handles were dropped without `close`, as `(slab index, generation)`:
/// pushed by [`SeqHandle`]'s `drop`, drained by the manager that created them.
pub(super) type DroppedSeqs = Arc<SegQueue<(u32, u64)>>;

impl SeqHandle {
    /// The request id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Whether `close` was called through this handle.
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

/// What `create` did.
#[derive(Debug)]
pub struct Created {
    /// The handle that drives the new sequence.
    pub handle: SeqHandle,
    /// Prompt tokens served from the cache (never the last prompt token).
    pub reused_tokens: u64,
}

/// A read-only view of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SequenceInfo {
    /// The id.
    pub id: RequestId,
    /// Active or suspended.
    pub status: SeqStatus,
    /// Finalized tokens (immutable; reusable once their block is full).
    pub committed: u64,
    /// Tokens that need no query in the next step.
    pub history: u64,
    /// History plus the next step's inputs.
    pub capacity: u64,
    /// `ceil(capacity / T)`.
    pub num_blocks: u64,
    /// Tokens served from the cache at creation.
    pub reused_tokens: u64,
    /// A reused partial block still waits for its private copy (done on resume).
    pub pending_copy: bool,
    /// Device work that must complete before the sequence's new pages are written.
    pub ready_after: Fence,
}

/// Counters since creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ManagerStats {
    /// Sequences created with reuse enabled.
    pub reuse_lookups: u64,
    /// Prompt tokens looked up (prompt minus its last token).
    pub lookup_tokens: u64,
    /// Tokens served from the cache.
    pub reused_tokens: u64,
    /// Pages moved GPU → host.
    pub offloaded_pages: u64,
    /// Bytes moved GPU → host.
    pub offloaded_bytes: u64,
    /// Pages moved host → GPU.
    pub onboarded_pages: u64,
    /// Bytes moved host → GPU.
    pub onboarded_bytes: u64,
    /// Pages copied for copy-on-resume of reused partial blocks.
    pub partial_copies: u64,
    /// Committed pages dropped from the last tier.
    pub dropped_pages: u64,
    /// Full blocks committed that duplicated a tree block (rebased or donated).
    pub rebased_blocks: u64,
    /// `resize` calls that returned `false`.
    pub resize_failures: u64,
    /// `resume` calls that returned `false`.
    pub resume_refusals: u64,
}

/// Occupancy of one pool group on one tier.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct GroupUsage {
    /// The group.
    pub pool_group: PoolGroupId,
    /// Slots in total.
    pub total: u32,
    /// Slots free (ready or not).
    pub free: u32,
    /// Slots whose pages could be evicted.
    pub evictable: u32,
    /// `(total − free − evictable) / total`.
    pub utilization: f64,
}

#[derive(Debug)]
pub(super) struct Sequence {
    pub id: RequestId,
    pub gen: u64,
    pub status: SeqStatus,
    pub scope_key: BlockKey,
    /// LoRA adapter of the scope.
    pub lora_id: Option<u64>,
    /// Committed tokens (the reused prefix included).
    pub tokens: Vec<TokenId>,
    pub history: u64,
    pub capacity: u64,
    /// Pages, block-major: block `b`, life cycle `lc` at `b × n_lc + lc`.
    pub pages: Vec<PageId>,
    /// Tree nodes of the leading committed full blocks (`nodes[b]` is block `b`).
    pub nodes: Vec<NodeRef>,
    /// The chain into the tree broke (a block could not be linked): add no more blocks.
    pub tree_stopped: bool,
    /// Reused partial block whose pages are tree pages, copied on resume.
    pub pending_copy: Option<u32>,
    pub stopped: bool,
    pub priority: u8,
    pub reused: u64,
    pub ready_after: Fence,
    /// An export lease: suspended, its pages pinned (see `transfer.rs`).
    pub pinned: bool,
    /// An open import: active, its fresh pages written by a transfer (`transfer.rs`).
    pub importing: bool,
    /// An open import's last block key (its tokens, chained): `commit_import` must be
    /// given the same tokens.
    pub import_key: Option<BlockKey>,
    /// The first block whose physical slot may have changed since the last
    /// [`KvCacheManager::sync_block_table`] (every block after it too): lowered by a
    /// truncation, a rebase and an import's reordering, reset to 0 by a resume (pages
    /// may have moved while suspended); appends need no mark (the kept row is shorter).
    pub table_mark: usize,
}

impl Sequence {
    pub(super) fn committed(&self) -> u64 {
        self.tokens.len() as u64
    }
}

/// The core cache manager. See the module docs.
pub struct KvCacheManager {
    pub(super) id: u64,
    pub(super) plan: PoolPlan,
    pub(super) opts: ManagerOptions,
    pub(super) tpb: u64,
    pub(super) n_lc: usize,
    /// Pool group of each life cycle.
    pub(super) lc_group: Vec<PoolGroupId>,
    /// Bytes of one slot of each group (all pools).
    pub(super) group_slot_bytes: Vec<u64>,
    /// `[tier][group]`; the host row is empty without a host tier.
    pub(super) allocators: [Vec<SlotAllocator>; 2],
    pub(super) pages: PageArena,
    pub(super) queues: EvictionQueues,
    pub(super) tree: RadixTree,
    pub(super) hasher: KeyHasher,
    pub(super) seqs: Vec<Option<Sequence>>,
    pub(super) free_seq_slots: Vec<u32>,
    pub(super) by_id: HashMap<RequestId, u32>,
    pub(super) next_gen: u64,
    pub(super) clock: FenceClock,
    pub(super) current_plan: Option<CopyPlan>,
    pub(super) copy_plans: Vec<CopyPlan>,
    pub(super) events: Vec<KvEvent>,
    /// Router events since the last take (recorded while `record_router_events`).
    pub(super) router_events: Vec<RouterEvent>,
    pub(super) record_router_events: bool,
    pub(super) stats: ManagerStats,
    /// Injected refusals of GPU room (fault drills), see [`KvCacheManager::inject_room_failures`].
    pub(super) faults: Option<RoomFaults>,
    /// Sequences whose handles were dropped without `close` (every handle shares it).
    pub(super) dropped: DroppedSeqs,
}

/// A seeded schedule of refused GPU-room requests.
#[derive(Clone, Debug)]
pub(super) struct RoomFaults {
    rng: SplitMix64,
    percent: u8,
    pub(super) injected: u64,
}

impl RoomFaults {
    /// Whether this request is refused.
    pub(super) fn fire(&mut self) -> bool {
        let hit = self.rng.below(100) < u64::from(self.percent);
        self.injected += u64::from(hit);
        hit
    }
}

impl KvCacheManager {
    /// A manager for `plan` with `slots` per pool group and tier.
    pub fn new(plan: PoolPlan, slots: TierSlots, opts: ManagerOptions) -> Result<Self, KvError> {
        let groups = plan.pool_groups().len();
        let bad = |field, value: String, why| Err(KvError::InvalidOption { field, value, why });
        if !(opts.max_util_for_resume > 0.0 && opts.max_util_for_resume <= 1.0) {
            return bad(
                "max_util_for_resume",
                opts.max_util_for_resume.to_string(),
                "must be in (0, 1]; the default 0.97 keeps headroom for growth",
            );
        }
        if slots.gpu.len() != groups || slots.gpu.contains(&0) {
            return bad(
                "gpu_slots",
                format!("{:?}", slots.gpu),
                "give one non-zero slot count per pool group",
            );
        }
        if !slots.host.is_empty() && (slots.host.len() != groups || slots.host.contains(&0)) {
            return bad(
                "host_slots",
                format!("{:?}", slots.host),
                "give one non-zero slot count per pool group, or none for no host tier",
            );
        }
        for &n in &slots.gpu {
            plan.check_page_index_range(u64::from(n))?;
        }
        if let Some(&n) = slots.host.iter().max() {
            if plan.check_page_index_range(u64::from(n)).is_err() {
                return bad(
                    "host_slots",
                    format!("{:?}", slots.host),
                    "the host tier's pages are numbered like the GPU's, in the kernels' int32 \
                     page indices: lower host_cache_size (the host tier's budget)",
                );
            }
        }
        let n_lc = plan.num_life_cycles();
        let lc_group = (0..n_lc)
            .map(|lc| plan.pool_group_of(LifeCycleId(lc as u16)))
            .collect();
        let group_slot_bytes = plan.pool_groups().iter().map(|g| g.slot_bytes()).collect();
        Ok(KvCacheManager {
            id: NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed),
            tpb: u64::from(plan.tokens_per_block()),
            n_lc,
            lc_group,
            group_slot_bytes,
            allocators: [
                slots.gpu.iter().map(|&n| SlotAllocator::new(n)).collect(),
                slots.host.iter().map(|&n| SlotAllocator::new(n)).collect(),
            ],
            pages: PageArena::default(),
            queues: EvictionQueues::new(groups),
            tree: RadixTree::default(),
            hasher: KeyHasher::default(),
            seqs: Vec::new(),
            free_seq_slots: Vec::new(),
            by_id: HashMap::new(),
            next_gen: 1,
            clock: FenceClock::new(),
            current_plan: None,
            copy_plans: Vec::new(),
            events: Vec::new(),
            router_events: Vec::new(),
            record_router_events: false,
            stats: ManagerStats::default(),
            faults: None,
            dropped: DroppedSeqs::default(),
            plan,
            opts,
        })
    }

    /// The pool plan.
    pub fn plan(&self) -> &PoolPlan {
        &self.plan
    }

    /// The options.
    pub fn options(&self) -> &ManagerOptions {
        &self.opts
    }

    /// Tokens per block.
    pub fn tokens_per_block(&self) -> u64 {
        self.tpb
    }

    /// Whether a host tier exists.
    pub fn has_host_tier(&self) -> bool {
        !self.allocators[Tier::Host.index()].is_empty()
    }

    /// Counters since creation.
    pub fn stats(&self) -> ManagerStats {
        self.stats
    }

    /// Live sequences.
    pub fn num_sequences(&self) -> usize {
        self.by_id.len()
    }

    /// Blocks in the reuse tree.
    pub fn num_cached_blocks(&self) -> usize {
        self.tree.num_blocks()
    }

    /// Pages alive (in use or kept for reuse).
    pub fn num_pages(&self) -> usize {
        self.pages.num_live()
    }

    // ---- fences -------------------------------------------------------------------

    /// Issues the fence of a step the caller is about to run on the devices.
    pub fn issue_fence(&mut self) -> Fence {
        self.reap_dropped();
        self.clock.issue()
    }

    /// The last fence issued.
    pub fn issued_fence(&self) -> Fence {
        self.clock.issued()
    }

    /// Fault drills: from now on each request for GPU room (a growing `resize`, a
    /// `resume`) is refused with probability `percent` (seeded), exactly as if the
    /// storage could not supply the memory: the call returns `Ok(false)` and must leave
    /// every structure as it was. `percent = 0` turns injection off.
    pub fn inject_room_failures(&mut self, seed: u64, percent: u8) {
        self.reap_dropped();
        self.faults = (percent > 0).then_some(RoomFaults {
            rng: SplitMix64(seed),
            percent: percent.min(100),
            injected: 0,
        });
    }

    /// Room requests refused by injection so far.
    pub fn injected_room_failures(&self) -> u64 {
        self.faults.as_ref().map_or(0, |f| f.injected)
    }

    /// The completion watermark.
    pub fn completed_fence(&self) -> Fence {
        self.clock.completed()
    }

    /// Records that all device work up to `f` has completed (minimum over devices).
    pub fn complete_fences(&mut self, f: Fence) -> Result<(), KvError> {
        self.reap_dropped();
        self.clock
            .complete_up_to(f)
            .map_err(|issued| KvError::FenceNotIssued { fence: f, issued })
    }

    /// Copy plans decided since the last call, in the order they must run.
    pub fn take_copy_plans(&mut self) -> Vec<CopyPlan> {
        self.reap_dropped();
        debug_assert!(self.current_plan.is_none());
        std::mem::take(&mut self.copy_plans)
    }

    /// KV events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.reap_dropped();
        std::mem::take(&mut self.events)
    }

    /// Starts or stops recording [`RouterEvent`]s (off by default, so a manager whose
    /// owner never takes them does not accumulate them; the runtime turns it on for the
    /// target cache). Turn it on while the reuse tree is empty, or resynchronize
    /// consumers from [`router_blocks`](Self::router_blocks).
    pub fn set_record_router_events(&mut self, on: bool) {
        if on && !self.record_router_events {
            // Blocks cached before: announced on the media `router_blocks` reports.
            for node in self.tree.blocks_top_down() {
                let medium = (self.tree.node(node).tokens.len() == self.tpb as usize)
                    .then(|| self.chain_medium(node));
                self.tree.set_router_medium(node, medium);
            }
        }
        self.record_router_events = on;
        if !on {
            self.router_events = Vec::new();
        }
    }

    /// Router events since the last call (full blocks only, one event per block,
    /// parents before children; a tier move is a removal plus a store), while
    /// [`set_record_router_events`](Self::set_record_router_events) is on, independently
    /// of [`take_events`](Self::take_events). Replayed in order from an empty view (or
    /// from a [`router_blocks`](Self::router_blocks) snapshot) they give exactly
    /// `router_blocks`.
    pub fn take_router_events(&mut self) -> Vec<RouterEvent> {
        self.reap_dropped();
        std::mem::take(&mut self.router_events)
    }

    /// Whether every page of a tree block is on the GPU.
    pub(super) fn pages_on_gpu(&self, node: NodeRef) -> bool {
        self.tree
            .node(node)
            .pages
            .iter()
            .all(|&pid| self.pages[pid].tier == Tier::Gpu)
    }

    /// Where a full tree block is for a router: on the GPU when its pages and those of
    /// every block before it in its prefix are (reusable without a copy), else on the
    /// host (reusable after onboarding). So along any prefix the GPU blocks come first,
    /// as tiered routers (Dynamo: a device tree, then lower tiers continuing it) expect.
    /// Reads the parent's announced medium: the parent must be announced.
    pub(super) fn chain_medium(&self, node: NodeRef) -> Medium {
        let parent_on_gpu = self
            .tree
            .parent_block(node)
            .is_none_or(|p| self.tree.node(p).router_medium == Some(Medium::Gpu));
        if parent_on_gpu && self.pages_on_gpu(node) {
            Medium::Gpu
        } else {
            Medium::CpuPinned
        }
    }

    /// The router's `BlockStored` for a full tree block on `medium` (tokens copied from
    /// the tree node).
    pub(super) fn router_stored(&self, node: NodeRef, medium: Medium) -> RouterEvent {
        let n = self.tree.node(node);
        RouterEvent::BlockStored {
            block_hashes: vec![n.key.hash64()],
            parent_block_hash: self.tree.parent_block_key(node).map(|k| k.hash64()),
            token_ids: n.tokens.iter().map(|t| t.get()).collect(),
            block_size: self.tpb as u32,
            medium,
            lora_id: n.lora_id,
            lora_name: None,
        }
    }

    /// Announces a new full tree block (its parent is announced already).
    pub(super) fn router_announce(&mut self, node: NodeRef) {
        let medium = self.chain_medium(node);
        self.tree.set_router_medium(node, Some(medium));
        let e = self.router_stored(node, medium);
        self.router_events.push(e);
    }

    /// After pages of an announced block changed tier: re-announces it when its medium
    /// changed, and each descendant whose medium follows from it. The removals come
    /// children first, then the stores parents first, so a router never holds a block
    /// on a medium whose parent it has not got on any, and a tree router that drops
    /// descendants with their parent never meets a removal of a block it dropped.
    pub(super) fn router_refresh(&mut self, node: NodeRef) {
        // Pre-order over the blocks whose medium changes (a block keeping its medium
        // keeps its descendants' too); each new medium is recorded before its children
        // read it.
        let mut changed: Vec<(NodeRef, Medium, Medium)> = Vec::new();
        let mut stack = vec![node];
        while let Some(n) = stack.pop() {
            let Some(from) = self.tree.node(n).router_medium else {
                continue;
            };
            let to = self.chain_medium(n);
            if from == to {
                continue;
            }
            self.tree.set_router_medium(n, Some(to));
            changed.push((n, from, to));
            let mut children = self.tree.child_blocks(n);
            children.reverse();
            stack.extend(children);
        }
        for &(n, from, _) in changed.iter().rev() {
            self.router_events.push(RouterEvent::BlockRemoved {
                block_hashes: vec![self.tree.node(n).key.hash64()],
                medium: from,
            });
        }
        for &(n, _, to) in &changed {
            let e = self.router_stored(n, to);
            self.router_events.push(e);
        }
    }

    // ---- sequences ------------------------------------------------------------------

    pub(super) fn validate_tokens(tokens: &[TokenId]) -> Result<(), KvError> {
        match tokens.iter().position(|t| t.get() > TokenId::MAX) {
            Some(index) => Err(KvError::TokenOutOfRange {
                index,
                value: tokens[index].get(),
                max: TokenId::MAX,
            }),
            None => Ok(()),
        }
    }

    /// The slab index of a live sequence driven by `h`.
    pub(super) fn seq_index(&self, h: &SeqHandle) -> Result<usize, KvError> {
        if h.manager != self.id {
            return Err(KvError::WrongManager { id: h.id });
        }
        if h.closed {
            return Err(KvError::SequenceClosed { id: h.id });
        }
        match self.seqs.get(h.slot as usize).and_then(Option::as_ref) {
            Some(s) if s.gen == h.gen => Ok(h.slot as usize),
            _ => Err(KvError::SequenceClosed { id: h.id }),
        }
    }

    pub(super) fn seq(&self, idx: usize) -> &Sequence {
        self.seqs[idx].as_ref().expect("invariant: live sequence")
    }

    pub(super) fn seq_mut(&mut self, idx: usize) -> &mut Sequence {
        self.seqs[idx].as_mut().expect("invariant: live sequence")
    }

    /// Tokens of `prompt` that would be served from the cache, without holding anything.
    /// The last prompt token is never served (its logits are needed).
    pub fn probe_reuse(&mut self, scope: ReuseScope, prompt: &[TokenId]) -> Result<u64, KvError> {
        self.reap_dropped();
        Self::validate_tokens(prompt)?;
        if !self.opts.enable_block_reuse || prompt.len() < 2 {
            return Ok(0);
        }
        let m = self.tree.match_prefix(
            &mut self.hasher,
            &scope.root_key(),
            &prompt[..prompt.len() - 1],
            self.tpb as usize,
            self.opts.enable_partial_reuse,
        );
        Ok(m.full.len() as u64 * self.tpb + m.partial.map_or(0, |(_, n)| u64::from(n)))
    }

    /// Creates a sequence for `prompt`, serving its longest cached prefix (never the last
    /// token). The sequence starts **suspended** and holds the reused pages (they may still
    /// be on the host); [`resume`](Self::resume) brings them to the GPU. Creation never
    /// fails for lack of space.
    pub fn create(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        prompt: &[TokenId],
        opts: SeqOptions,
    ) -> Result<Created, KvError> {
        self.reap_dropped();
        if self.by_id.contains_key(&id) {
            return Err(KvError::DuplicateRequest { id });
        }
        Self::validate_tokens(prompt)?;
        let lookup = if self.opts.enable_block_reuse && prompt.len() >= 2 {
            &prompt[..prompt.len() - 1]
        } else {
            &[]
        };
        let partial = self.opts.enable_partial_reuse;
        self.open(id, scope, lookup, partial, true, opts)
    }

    /// Opens a suspended sequence holding the cached prefix of `lookup` (full blocks, then
    /// with `partial` a leading part of the next block); `count` books it as a reuse
    /// lookup in the statistics.
    pub(super) fn open(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        lookup: &[TokenId],
        partial: bool,
        count: bool,
        opts: SeqOptions,
    ) -> Result<Created, KvError> {
        if self.by_id.contains_key(&id) {
            return Err(KvError::DuplicateRequest { id });
        }
        if opts.priority > MAX_PRIORITY {
            return Err(KvError::InvalidOption {
                field: "priority",
                value: opts.priority.to_string(),
                why: "eviction priorities are 0..=100",
            });
        }
        let scope_key = scope.root_key();
        let n = self.n_lc;
        let mut seq = Sequence {
            id,
            gen: self.next_gen,
            status: SeqStatus::Suspended,
            scope_key,
            lora_id: scope.lora_id,
            tokens: Vec::new(),
            history: 0,
            capacity: 0,
            pages: Vec::new(),
            nodes: Vec::new(),
            tree_stopped: false,
            pending_copy: None,
            stopped: false,
            priority: opts.priority,
            reused: 0,
            ready_after: Fence::NONE,
            pinned: false,
            importing: false,
            import_key: None,
            table_mark: 0,
        };
        if !lookup.is_empty() {
            let m = self.tree.match_prefix(
                &mut self.hasher,
                &scope_key,
                lookup,
                self.tpb as usize,
                partial,
            );
            let mut reused = m.full.len() as u64 * self.tpb;
            for &node in &m.full {
                seq.pages.extend_from_slice(&self.tree.node(node).pages);
            }
            seq.nodes = m.full;
            if let Some((node, len)) = m.partial {
                seq.pages.extend_from_slice(&self.tree.node(node).pages);
                seq.pending_copy = Some(seq.nodes.len() as u32);
                reused += u64::from(len);
            }
            debug_assert_eq!(seq.pages.len() as u64, reused.div_ceil(self.tpb) * n as u64);
            for i in 0..seq.pages.len() {
                let pid = seq.pages[i];
                self.pages[pid].holders += 1;
                self.refresh_queue(pid);
            }
            seq.tokens = lookup[..reused as usize].to_vec();
            seq.history = reused;
            seq.capacity = reused;
            seq.reused = reused;
            if count {
                self.stats.reuse_lookups += 1;
                self.stats.lookup_tokens += lookup.len() as u64;
                self.stats.reused_tokens += reused;
            }
        }
        self.next_gen += 1;
        let reused_tokens = seq.reused;
        let gen = seq.gen;
        let slot = match self.free_seq_slots.pop() {
            Some(s) => {
                self.seqs[s as usize] = Some(seq);
                s
            }
            None => {
                self.seqs.push(Some(seq));
                (self.seqs.len() - 1) as u32
            }
        };
        self.by_id.insert(id, slot);
        self.debug_check();
        Ok(Created {
            handle: SeqHandle {
                id,
                slot,
                gen,
                manager: self.id,
                closed: false,
                dropped: self.dropped.clone(),
            },
            reused_tokens,
        })
    }

    fn info(&self, s: &Sequence) -> SequenceInfo {
        SequenceInfo {
            id: s.id,
            status: s.status,
            committed: s.committed(),
            history: s.history,
            capacity: s.capacity,
            num_blocks: (s.pages.len() / self.n_lc) as u64,
            reused_tokens: s.reused,
            pending_copy: s.pending_copy.is_some(),
            ready_after: s.ready_after,
        }
    }

    /// A view of the live sequence with this id.
    pub fn sequence(&self, id: RequestId) -> Result<SequenceInfo, KvError> {
        let idx = *self.by_id.get(&id).ok_or(KvError::UnknownRequest { id })?;
        Ok(self.info(self.seq(idx as usize)))
    }

    /// A view of the sequence driven by `h`.
    pub fn info_of(&self, h: &SeqHandle) -> Result<SequenceInfo, KvError> {
        Ok(self.info(self.seq(self.seq_index(h)?)))
    }

    /// How many leading blocks of the sequence driven by `h` it has linked into (or
    /// reused from) the prefix tree.
    pub fn tree_blocks(&self, h: &SeqHandle) -> Result<u64, KvError> {
        Ok(self.seq(self.seq_index(h)?).nodes.len() as u64)
    }

    /// The committed tokens of the sequence driven by `h`.
    pub fn committed_tokens(&self, h: &SeqHandle) -> Result<&[TokenId], KvError> {
        Ok(&self.seq(self.seq_index(h)?).tokens)
    }

    /// Writes the GPU slot of every block of life cycle `lc` of an **active** sequence
    /// into `out` and fills the rest with −1 (the physical block table). Returns the
    /// number of blocks.
    pub fn write_block_table(
        &self,
        h: &SeqHandle,
        lc: LifeCycleId,
        out: &mut [i32],
    ) -> Result<usize, KvError> {
        let idx = self.seq_index(h)?;
        self.require_active(idx, "reading its block table")?;
        let s = self.seq(idx);
        let blocks = s.pages.len() / self.n_lc;
        if out.len() < blocks {
            return Err(KvError::InvalidOption {
                field: "block table row",
                value: out.len().to_string(),
                why: "the row is shorter than the sequence's block count; size rows for max_blocks_per_seq",
            });
        }
        for (b, dst) in out.iter_mut().enumerate() {
            *dst = if b < blocks {
                self.pages[s.pages[b * self.n_lc + lc.index()]].slot.get() as i32
            } else {
                -1
            };
        }
        Ok(blocks)
    }

    /// Brings `row`, a copy of the sequence's block table for life cycle `lc` that the
    /// caller keeps between calls, up to date: rewrites only the blocks from the first
    /// one that may have changed since the last call for this sequence (appended,
    /// truncated, rebased onto a cached page, moved while suspended) and truncates `row`
    /// to the block count. Returns the first block written (`row.len()` when nothing
    /// changed), so a consumer of `row` can update its own copy from there.
    ///
    /// The change mark is per sequence, not per reader or life cycle: one caller (the
    /// scheduler) reads each sequence this way, always for the same `lc` and with the
    /// same `row`; a second reader or life cycle would see changes as already read. The first call after a
    /// (re)activation rewrites the whole row. Work is proportional to the blocks
    /// rewritten, not to the table.
    pub fn sync_block_table(
        &mut self,
        h: &SeqHandle,
        lc: LifeCycleId,
        row: &mut Vec<i32>,
    ) -> Result<usize, KvError> {
        let idx = self.seq_index(h)?;
        self.require_active(idx, "reading its block table")?;
        let s = self.seq(idx);
        if lc.index() >= self.n_lc {
            return Err(KvError::InvalidOption {
                field: "life cycle",
                value: lc.index().to_string(),
                why: "the plan has fewer life cycles",
            });
        }
        let blocks = s.pages.len() / self.n_lc;
        let from = s.table_mark.min(blocks).min(row.len());
        row.truncate(from);
        row.extend(
            (from..blocks)
                .map(|b| self.pages[s.pages[b * self.n_lc + lc.index()]].slot.get() as i32),
        );
        self.seq_mut(idx).table_mark = blocks;
        Ok(from)
    }

    /// The sequence's change mark and block count: blocks from the mark on may have
    /// changed since the last [`sync_block_table`](Self::sync_block_table) (nothing
    /// changed when the mark is at or past the count and the kept row has that many
    /// blocks).
    /// Refused for a sequence that is not active (its pages may move).
    pub fn block_table_mark(&self, h: &SeqHandle) -> Result<(usize, usize), KvError> {
        let idx = self.seq_index(h)?;
        self.require_active(idx, "reading its block table")?;
        let s = self.seq(idx);
        Ok((s.table_mark, s.pages.len() / self.n_lc))
    }

    /// The GPU slots of the blocks of life cycle `lc` of an active sequence.
    pub fn block_slots(&self, h: &SeqHandle, lc: LifeCycleId) -> Result<Vec<SlotId>, KvError> {
        let mut row = vec![0i32; self.seq(self.seq_index(h)?).pages.len() / self.n_lc];
        let n = self.write_block_table(h, lc, &mut row)?;
        Ok(row[..n].iter().map(|&s| SlotId(s as u32)).collect())
    }

    /// Page indices of (layer, role) for every block of an active sequence:
    /// `slot × scale + layer_offset` through the layer's converter.
    pub fn page_indices(
        &self,
        h: &SeqHandle,
        layer: crate::ids::LayerId,
        role: Role,
    ) -> Result<Vec<u32>, KvError> {
        let p = self.plan.placement(layer, role)?;
        Ok(self
            .block_slots(h, p.life_cycle)?
            .into_iter()
            .map(|s| p.converter.page_index(s).get())
            .collect())
    }

    /// Occupancy per pool group on `tier` (empty for a missing host tier).
    pub fn usage(&self, tier: Tier) -> Vec<GroupUsage> {
        self.allocators[tier.index()]
            .iter()
            .enumerate()
            .map(|(g, a)| {
                let group = PoolGroupId(g as u16);
                let evictable = self.queues.len(tier, group) as u32;
                let total = a.capacity();
                let free = a.available();
                GroupUsage {
                    pool_group: group,
                    total,
                    free,
                    evictable,
                    utilization: f64::from(total - free - evictable) / f64::from(total),
                }
            })
            .collect()
    }

    /// Slots in use per pool group on `tier`.
    pub fn occupied_slots(&self, tier: Tier) -> Vec<u32> {
        self.allocators[tier.index()]
            .iter()
            .map(SlotAllocator::num_occupied)
            .collect()
    }

    /// GPU slots of each pool group.
    pub fn gpu_slots(&self) -> Vec<u32> {
        self.allocators[0]
            .iter()
            .map(SlotAllocator::capacity)
            .collect()
    }

    /// Host slots of each pool group (empty without a host tier).
    pub fn host_slots(&self) -> Vec<u32> {
        self.allocators[1]
            .iter()
            .map(SlotAllocator::capacity)
            .collect()
    }

    #[inline]
    pub(super) fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if self.debug_checks_enabled() {
            self.check_invariants();
        }
    }

    #[cfg(debug_assertions)]
    fn debug_checks_enabled(&self) -> bool {
        // Full checks are O(state); keep them for small states (tests), where they run
        // after every mutation.
        self.pages.num_live() <= 4096
    }
}

#[cfg(test)]
impl KvCacheManager {
    /// Every structure a failed `resize`/`resume` must leave unchanged.
    pub(super) fn fingerprint(&self) -> String {
        let pages: Vec<_> = self.pages.iter_live().collect();
        let mut blocks: Vec<String> = self
            .tree
            .blocks()
            .map(|(r, n)| format!("{r:?} {} {:?} {:?}", n.key, n.tokens, n.pages))
            .collect();
        blocks.sort();
        format!(
            "{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}",
            self.allocators, pages, self.queues, blocks, self.seqs, self.clock, self.copy_plans
        )
    }
}
