//! The reference cache of the model test: a second, deliberately plain implementation of
//! the core semantics (the `//!` docs under `crates/dsa-kv-core/src/core` and the rules below) that decides on its own whether each `resize` and
//! `resume` fits and how many tokens each `create` reuses, so the test can demand
//! equality with the manager.
//!
//! It shares no code with the manager, only the specification:
//! * reuse keys are `SHA-256(parent key ∥ 4-byte LE token ids)` under the scope's root
//!   key; a lookup walks full blocks, then takes the child with the longest common token
//!   prefix (ties: smallest key); the last prompt token is never looked up;
//! * a page is locked (an active sequence uses it), held (only suspended sequences do) or
//!   droppable (nobody does; kept only while it is a block's page). Evictable: droppable
//!   and cached, or held and not on the last tier;
//! * eviction per (tier, pool group): lowest priority, then least recently touched
//!   (a page is touched whenever its references change, it is committed or it moves);
//!   GPU victims move to the host while it has room (its own cached pages count as room,
//!   the coldest dropped first), held victims must move, the coldest droppable victims
//!   are dropped when the host is short; dropping a block drops its subtree (pre-order,
//!   siblings by key);
//! * a full block equal to a cached one is rebased onto the cached page, unless only our
//!   page is on the GPU (then ours replaces it).
//!
//! Only what decides an answer is modelled: page counts per (tier, pool group), not slot
//! numbers or fences (a slot in flight is still handed out, with a fence to wait for).

use std::collections::{BTreeMap, HashMap};

use dsa_kv::core::{BlockKey, SeqStatus};
use dsa_kv::ids::{LifeCycleId, RequestId, Tier, TokenId};
use dsa_kv::rng::SplitMix64;
use sha2::{Digest, Sha256};

type PageRef = u64;
type NodeRef = u64;

struct Page {
    life_cycle: usize,
    group: usize,
    tier: Tier,
    locks: u32,
    holds: u32,
    node: Option<NodeRef>,
    priority: u8,
    /// When the page last entered its eviction order (only meaningful while evictable).
    touched: u64,
}

struct Node {
    key: BlockKey,
    /// `None`: a first block, under the scope's root.
    parent: Option<NodeRef>,
    scope: BlockKey,
    tokens: Vec<TokenId>,
    pages: Vec<PageRef>,
    children: BTreeMap<BlockKey, NodeRef>,
}

/// A sequence as the reference sees it.
pub(crate) struct Seq {
    pub scope: BlockKey,
    pub priority: u8,
    pub status: SeqStatus,
    /// Committed tokens.
    pub tokens: Vec<TokenId>,
    pub history: u64,
    pub capacity: u64,
    pub reused: u64,
    pub stopped: bool,
    /// Block-major: block `b`, life cycle `lc` at `b × n_lc + lc`.
    pages: Vec<PageRef>,
    /// The tree blocks of the leading committed blocks.
    nodes: Vec<NodeRef>,
    /// A reused partial block still shared with the tree (copied on resume).
    pending_copy: Option<usize>,
    /// The chain into the tree broke: no more blocks are added.
    tree_stopped: bool,
}

impl Seq {
    pub(crate) fn committed(&self) -> u64 {
        self.tokens.len() as u64
    }
    pub(crate) fn pending_copy(&self) -> bool {
        self.pending_copy.is_some()
    }
}

/// `resize` asked for more blocks than a pool group has.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TooLong;

/// The shape and options the reference needs.
pub(crate) struct Shape {
    pub tokens_per_block: usize,
    /// Pool group of each life cycle.
    pub life_cycle_group: Vec<usize>,
    pub gpu_slots: Vec<u32>,
    /// Empty: no host tier.
    pub host_slots: Vec<u32>,
    pub reuse: bool,
    pub partial_reuse: bool,
    pub max_util_for_resume: f64,
}

pub(crate) struct RefCache {
    shape: Shape,
    pages: HashMap<PageRef, Page>,
    next_page: PageRef,
    nodes: HashMap<NodeRef, Node>,
    next_node: NodeRef,
    /// First blocks of each scope, by key.
    roots: HashMap<BlockKey, BTreeMap<BlockKey, NodeRef>>,
    seqs: HashMap<RequestId, Seq>,
    clock: u64,
    /// The injected storage refusals: the drill's seeded schedule, one draw per request
    /// for GPU room.
    faults: Option<(SplitMix64, u64)>,
    pub injected: u64,
    /// Duplicate full-block pages committed: rebased onto a GPU page, rebased while both
    /// were off the GPU, donated (ours on the GPU replaced the tree's).
    pub rebased_on_gpu: u64,
    pub rebased_off_gpu: u64,
    pub donated: u64,
}

/// `SHA-256(parent ∥ tokens as 4-byte little-endian)`.
pub(crate) fn block_key(parent: &BlockKey, tokens: &[TokenId]) -> BlockKey {
    let mut h = Sha256::new();
    h.update(parent.0);
    for t in tokens {
        h.update(t.get().to_le_bytes());
    }
    BlockKey(h.finalize().into())
}

impl RefCache {
    pub(crate) fn new(shape: Shape, faults: Option<(u64, u8)>) -> Self {
        RefCache {
            shape,
            pages: HashMap::new(),
            next_page: 0,
            nodes: HashMap::new(),
            next_node: 0,
            roots: HashMap::new(),
            seqs: HashMap::new(),
            clock: 0,
            faults: faults.map(|(seed, pct)| (SplitMix64(seed), u64::from(pct))),
            injected: 0,
            rebased_on_gpu: 0,
            rebased_off_gpu: 0,
            donated: 0,
        }
    }

    fn t(&self) -> usize {
        self.shape.tokens_per_block
    }

    fn n_lc(&self) -> usize {
        self.shape.life_cycle_group.len()
    }

    fn groups(&self) -> usize {
        self.shape.gpu_slots.len()
    }

    fn has_host(&self) -> bool {
        !self.shape.host_slots.is_empty()
    }

    fn slots(&self, tier: Tier) -> &[u32] {
        match tier {
            Tier::Gpu => &self.shape.gpu_slots,
            Tier::Host => &self.shape.host_slots,
        }
    }

    pub(crate) fn seq(&self, id: RequestId) -> &Seq {
        &self.seqs[&id]
    }

    fn seq_mut(&mut self, id: RequestId) -> &mut Seq {
        self.seqs.get_mut(&id).expect("reference: live sequence")
    }

    // ---- pages ------------------------------------------------------------------

    fn last_tier(&self) -> Tier {
        if self.has_host() {
            Tier::Host
        } else {
            Tier::Gpu
        }
    }

    fn evictable(&self, p: &Page) -> bool {
        if p.locks > 0 {
            false
        } else if p.holds > 0 {
            p.tier != self.last_tier()
        } else {
            p.node.is_some()
        }
    }

    fn touch(&mut self, pid: PageRef) {
        if self.evictable(&self.pages[&pid]) {
            self.clock += 1;
            self.pages.get_mut(&pid).expect("live page").touched = self.clock;
        }
    }

    fn new_locked_page(&mut self, life_cycle: usize) -> PageRef {
        let id = self.next_page;
        self.next_page += 1;
        self.pages.insert(
            id,
            Page {
                life_cycle,
                group: self.shape.life_cycle_group[life_cycle],
                tier: Tier::Gpu,
                locks: 1,
                holds: 0,
                node: None,
                priority: 0,
                touched: 0,
            },
        );
        id
    }

    /// After a reference went away: a page nobody refers to and no block owns is freed.
    fn settle(&mut self, pid: PageRef) {
        let p = &self.pages[&pid];
        if p.locks == 0 && p.holds == 0 && p.node.is_none() {
            self.pages.remove(&pid);
        } else {
            self.touch(pid);
        }
    }

    fn add_ref(&mut self, pid: PageRef, lock: bool) {
        let p = self.pages.get_mut(&pid).expect("live page");
        if lock {
            p.locks += 1;
        } else {
            p.holds += 1;
        }
        self.touch(pid);
    }

    fn unref(&mut self, pid: PageRef, lock: bool) {
        let p = self.pages.get_mut(&pid).expect("live page");
        if lock {
            p.locks -= 1;
        } else {
            p.holds -= 1;
        }
        self.settle(pid);
    }

    fn count(&self, tier: Tier, group: usize, what: impl Fn(&Page) -> bool) -> u32 {
        self.pages
            .values()
            .filter(|p| p.tier == tier && p.group == group && what(p))
            .count() as u32
    }

    fn free(&self, tier: Tier, group: usize) -> u32 {
        self.slots(tier)[group] - self.count(tier, group, |_| true)
    }

    /// Evictable pages of (tier, group) in eviction order, `exclude` left out.
    fn eviction_order(&self, tier: Tier, group: usize, exclude: &[PageRef]) -> Vec<PageRef> {
        let mut q: Vec<(u8, u64, PageRef)> = self
            .pages
            .iter()
            .filter(|(id, p)| {
                p.tier == tier && p.group == group && self.evictable(p) && !exclude.contains(id)
            })
            .map(|(&id, p)| (p.priority, p.touched, id))
            .collect();
        q.sort_unstable();
        q.into_iter().map(|e| e.2).collect()
    }

    // ---- the tree ---------------------------------------------------------------

    fn children(
        &self,
        scope: &BlockKey,
        parent: Option<NodeRef>,
    ) -> Option<&BTreeMap<BlockKey, NodeRef>> {
        match parent {
            None => self.roots.get(scope),
            Some(n) => Some(&self.nodes[&n].children),
        }
    }

    /// Full blocks of `tokens` found in the tree, then the best partial candidate.
    fn lookup(
        &self,
        scope: &BlockKey,
        tokens: &[TokenId],
    ) -> (Vec<NodeRef>, Option<(NodeRef, u64)>) {
        let t = self.t();
        let mut full = Vec::new();
        let mut parent_key = *scope;
        let mut cur: Option<NodeRef> = None;
        for chunk in tokens.chunks_exact(t) {
            let key = block_key(&parent_key, chunk);
            match self.children(scope, cur).and_then(|c| c.get(&key)) {
                Some(&n) => {
                    full.push(n);
                    cur = Some(n);
                    parent_key = key;
                }
                None => break,
            }
        }
        let rest = &tokens[full.len() * t..];
        let mut partial = None;
        if self.shape.partial_reuse && !rest.is_empty() {
            // Ascending keys: the first of the longest matches has the smallest key.
            let mut best: Option<(u64, NodeRef)> = None;
            for &c in self
                .children(scope, cur)
                .into_iter()
                .flat_map(|c| c.values())
            {
                let lcp = self.nodes[&c]
                    .tokens
                    .iter()
                    .zip(rest)
                    .take_while(|(a, b)| a == b)
                    .count() as u64;
                if lcp > 0 && best.is_none_or(|(l, _)| lcp > l) {
                    best = Some((lcp, c));
                }
            }
            partial = best.map(|(lcp, c)| (c, lcp));
        }
        (full, partial)
    }

    /// Tokens of `prompt` the cache serves: never its last token.
    pub(crate) fn reusable(&self, scope: &BlockKey, prompt: &[TokenId]) -> u64 {
        if !self.shape.reuse || prompt.len() < 2 {
            return 0;
        }
        let (full, partial) = self.lookup(scope, &prompt[..prompt.len() - 1]);
        full.len() as u64 * self.t() as u64 + partial.map_or(0, |p| p.1)
    }

    /// Removes `top` and its descendants, a block before its descendants, siblings by key.
    fn remove_subtree(&mut self, top: NodeRef) -> Vec<Node> {
        let (parent, scope, key) = {
            let n = &self.nodes[&top];
            (n.parent, n.scope, n.key)
        };
        match parent {
            None => {
                self.roots.get_mut(&scope).expect("scope root").remove(&key);
            }
            Some(p) => {
                self.nodes
                    .get_mut(&p)
                    .expect("parent")
                    .children
                    .remove(&key);
            }
        }
        let mut out = Vec::new();
        let mut stack = vec![top];
        while let Some(i) = stack.pop() {
            let n = self.nodes.remove(&i).expect("live block");
            stack.extend(n.children.values().rev());
            out.push(n);
        }
        out
    }

    /// Pages of removed blocks lose their block; nobody else's are freed.
    fn unlink(&mut self, removed: Vec<Node>) {
        for n in removed {
            for pid in n.pages {
                self.pages.get_mut(&pid).expect("live page").node = None;
                self.settle(pid);
            }
        }
    }

    fn drop_page(&mut self, pid: PageRef) {
        let node = self.pages[&pid]
            .node
            .expect("reference: a dropped page is cached");
        let removed = self.remove_subtree(node);
        self.unlink(removed);
    }

    fn migrate(&mut self, pid: PageRef, to: Tier) {
        self.pages.get_mut(&pid).expect("live page").tier = to;
        self.touch(pid);
    }

    // ---- room -------------------------------------------------------------------

    fn gpu_victims(&self, group: usize, need: u32, exclude: &[PageRef]) -> Option<Vec<PageRef>> {
        let k = need.saturating_sub(self.free(Tier::Gpu, group)) as usize;
        let mut order = self.eviction_order(Tier::Gpu, group, exclude);
        if k > order.len() {
            return None;
        }
        order.truncate(k);
        Some(order)
    }

    fn host_room(&self, group: usize, exclude: &[PageRef]) -> usize {
        self.free(Tier::Host, group) as usize
            + self.eviction_order(Tier::Host, group, exclude).len()
    }

    fn held(&self, victims: &[PageRef]) -> usize {
        victims.iter().filter(|v| self.pages[v].holds > 0).count()
    }

    fn room_feasible(&self, group: usize, need: u32, exclude: &[PageRef]) -> bool {
        match self.gpu_victims(group, need, exclude) {
            None => false,
            Some(v) => {
                let held = self.held(&v);
                held == 0 || (self.has_host() && held <= self.host_room(group, exclude))
            }
        }
    }

    fn evict_gpu(&mut self, group: usize, need: u32, exclude: &[PageRef]) {
        let victims = self
            .gpu_victims(group, need, exclude)
            .expect("reference: feasibility was checked");
        if victims.is_empty() {
            return;
        }
        if !self.has_host() {
            for v in victims {
                if self.pages.contains_key(&v) {
                    self.drop_page(v);
                }
            }
            return;
        }
        let room = self.host_room(group, exclude);
        let held = self.held(&victims);
        let droppable: Vec<PageRef> = victims
            .iter()
            .copied()
            .filter(|v| self.pages[v].holds == 0)
            .collect();
        let n_drop = droppable.len() - droppable.len().min(room - held);
        for &v in &droppable[..n_drop] {
            if self.pages.contains_key(&v) {
                self.drop_page(v);
            }
        }
        let to_move: Vec<PageRef> = victims
            .into_iter()
            .filter(|v| self.pages.get(v).is_some_and(|p| p.tier == Tier::Gpu))
            .collect();
        while (self.free(Tier::Host, group) as usize) < to_move.len() {
            let v = self.eviction_order(Tier::Host, group, exclude)[0];
            self.drop_page(v);
        }
        for v in to_move {
            if self.pages.contains_key(&v) {
                self.migrate(v, Tier::Host);
            }
        }
    }

    /// Whether `needs[g]` free GPU slots per group can be had (an injected refusal
    /// first); if so, makes them. `exclude`: pages that must not be victims.
    fn make_room(&mut self, needs: &[u32], exclude: &[PageRef]) -> bool {
        if let Some((rng, pct)) = &mut self.faults {
            if rng.below(100) < *pct {
                self.injected += 1;
                return false;
            }
        }
        if !(0..self.groups()).all(|g| self.room_feasible(g, needs[g], exclude)) {
            return false;
        }
        for (g, &need) in needs.iter().enumerate() {
            self.evict_gpu(g, need, exclude);
        }
        true
    }

    // ---- sequences --------------------------------------------------------------

    /// Creates a suspended sequence holding its reused prefix; returns the reused tokens.
    pub(crate) fn create(
        &mut self,
        id: RequestId,
        scope: BlockKey,
        prompt: &[TokenId],
        priority: u8,
    ) -> u64 {
        let mut s = Seq {
            scope,
            priority,
            status: SeqStatus::Suspended,
            tokens: Vec::new(),
            history: 0,
            capacity: 0,
            reused: 0,
            stopped: false,
            pages: Vec::new(),
            nodes: Vec::new(),
            pending_copy: None,
            tree_stopped: false,
        };
        if self.shape.reuse && prompt.len() >= 2 {
            let (full, partial) = self.lookup(&scope, &prompt[..prompt.len() - 1]);
            let mut reused = full.len() as u64 * self.t() as u64;
            for n in &full {
                s.pages.extend_from_slice(&self.nodes[n].pages);
            }
            s.nodes = full;
            if let Some((n, lcp)) = partial {
                s.pages.extend_from_slice(&self.nodes[&n].pages);
                s.pending_copy = Some(s.nodes.len());
                reused += lcp;
            }
            for &pid in &s.pages {
                self.add_ref(pid, false);
            }
            s.tokens = prompt[..reused as usize].to_vec();
            (s.history, s.capacity, s.reused) = (reused, reused, reused);
        }
        let reused = s.reused;
        self.seqs.insert(id, s);
        reused
    }

    /// Sets capacity and history of an active sequence: `Ok(false)` when the GPU cannot
    /// make room.
    pub(crate) fn resize(
        &mut self,
        id: RequestId,
        capacity: u64,
        history: u64,
    ) -> Result<bool, TooLong> {
        let n = self.n_lc();
        let s = &self.seqs[&id];
        assert_eq!(
            s.status,
            SeqStatus::Active,
            "reference: resize of a suspended sequence"
        );
        let old_blocks = s.pages.len() / n;
        let new_blocks = capacity.div_ceil(self.t() as u64) as usize;
        if new_blocks > old_blocks {
            let mut per_block = vec![0u32; self.groups()];
            for &g in &self.shape.life_cycle_group {
                per_block[g] += 1;
            }
            if (0..self.groups()).any(|g| {
                new_blocks as u64 * u64::from(per_block[g]) > u64::from(self.shape.gpu_slots[g])
            }) {
                return Err(TooLong);
            }
            let needs: Vec<u32> = per_block
                .iter()
                .map(|&b| b * (new_blocks - old_blocks) as u32)
                .collect();
            if !self.make_room(&needs, &[]) {
                return Ok(false);
            }
            for _ in old_blocks..new_blocks {
                for lc in 0..n {
                    let pid = self.new_locked_page(lc);
                    self.seq_mut(id).pages.push(pid);
                }
            }
        } else if new_blocks < old_blocks {
            let tail = self.seq_mut(id).pages.split_off(new_blocks * n);
            for pid in tail.into_iter().rev() {
                self.unref(pid, true);
            }
        }
        let s = self.seq_mut(id);
        (s.capacity, s.history) = (capacity, history);
        Ok(true)
    }

    /// Finalizes tokens; every block that becomes full enters the tree.
    pub(crate) fn commit(&mut self, id: RequestId, tokens: &[TokenId]) {
        let t = self.t() as u64;
        let s = self.seq_mut(id);
        assert!(!s.stopped, "reference: commit after stop");
        let first_block = s.committed() / t;
        s.tokens.extend_from_slice(tokens);
        let total = s.committed();
        assert!(total <= s.capacity, "reference: commit beyond capacity");
        s.history = s.history.max(total);
        for b in first_block..total / t {
            self.commit_block(id, b as usize, t as usize);
        }
    }

    fn commit_block(&mut self, id: RequestId, b: usize, len: usize) {
        let (n, t) = (self.n_lc(), self.t());
        let s = &self.seqs[&id];
        let parent = s.nodes.last().copied();
        let chained = s.nodes.len() == b && parent.is_none_or(|p| self.nodes.contains_key(&p));
        if !self.shape.reuse || s.tree_stopped || !chained {
            self.seq_mut(id).tree_stopped = true;
            return;
        }
        let scope = s.scope;
        let parent_key = parent.map_or(scope, |p| self.nodes[&p].key);
        let tokens = s.tokens[b * t..b * t + len].to_vec();
        let key = block_key(&parent_key, &tokens);
        let ours: Vec<PageRef> = s.pages[b * n..(b + 1) * n].to_vec();
        let (lock, priority) = (s.status == SeqStatus::Active, s.priority);
        let siblings: Vec<NodeRef> = self
            .children(&scope, parent)
            .map(|c| c.values().copied().collect())
            .unwrap_or_default();
        if let Some(&existing) = self.children(&scope, parent).and_then(|c| c.get(&key)) {
            if len < t {
                self.seq_mut(id).tree_stopped = true;
                return;
            }
            for (lc, &our) in ours.iter().enumerate() {
                let theirs = self.nodes[&existing].pages[lc];
                if self.pages[&theirs].tier == Tier::Gpu || self.pages[&our].tier != Tier::Gpu {
                    if self.pages[&theirs].tier == Tier::Gpu {
                        self.rebased_on_gpu += 1;
                    } else {
                        self.rebased_off_gpu += 1;
                    }
                    self.add_ref(theirs, lock);
                    self.seq_mut(id).pages[b * n + lc] = theirs;
                    self.unref(our, lock);
                } else {
                    self.donated += 1;
                    self.nodes.get_mut(&existing).expect("block").pages[lc] = our;
                    let p = self.pages.get_mut(&our).expect("live page");
                    (p.node, p.priority) = (Some(existing), priority);
                    self.touch(our);
                    self.pages.get_mut(&theirs).expect("live page").node = None;
                    self.settle(theirs);
                }
            }
            self.seq_mut(id).nodes.push(existing);
            return;
        }
        if len < t
            && siblings
                .iter()
                .any(|c| self.nodes[c].tokens.starts_with(&tokens))
        {
            self.seq_mut(id).tree_stopped = true;
            return;
        }
        let node = self.next_node;
        self.next_node += 1;
        self.nodes.insert(
            node,
            Node {
                key,
                parent,
                scope,
                tokens: tokens.clone(),
                pages: ours.clone(),
                children: BTreeMap::new(),
            },
        );
        match parent {
            None => self.roots.entry(scope).or_default().insert(key, node),
            Some(p) => self
                .nodes
                .get_mut(&p)
                .expect("parent")
                .children
                .insert(key, node),
        };
        // A longer block replaces a shorter partial sibling it extends.
        let mut removed = Vec::new();
        for c in siblings {
            let sib = &self.nodes[&c].tokens;
            if sib.len() < t && tokens.starts_with(sib) {
                removed.extend(self.remove_subtree(c));
            }
        }
        for &pid in &ours {
            let p = self.pages.get_mut(&pid).expect("live page");
            (p.node, p.priority) = (Some(node), priority);
            self.touch(pid);
        }
        self.seq_mut(id).nodes.push(node);
        self.unlink(removed);
    }

    /// No more blocks: a partial trailing block is committed as the last one.
    pub(crate) fn stop(&mut self, id: RequestId) {
        let t = self.t() as u64;
        let s = &self.seqs[&id];
        if s.stopped {
            return;
        }
        let (rem, b) = (s.committed() % t, s.committed() / t);
        if rem > 0 && s.pending_copy.is_none() {
            self.commit_block(id, b as usize, rem as usize);
        }
        self.seq_mut(id).stopped = true;
    }

    pub(crate) fn suspend(&mut self, id: RequestId) {
        if self.seqs[&id].status == SeqStatus::Suspended {
            return;
        }
        self.seq_mut(id).status = SeqStatus::Suspended;
        for pid in self.seqs[&id].pages.clone() {
            let p = self.pages.get_mut(&pid).expect("live page");
            p.locks -= 1;
            p.holds += 1;
            self.touch(pid);
        }
    }

    /// Brings a suspended sequence back to the GPU; `false` when a pool group is above
    /// `max_util_for_resume` or its pages do not fit.
    pub(crate) fn resume(&mut self, id: RequestId) -> bool {
        if self.seqs[&id].status == SeqStatus::Active {
            return true;
        }
        for g in 0..self.groups() {
            let total = self.shape.gpu_slots[g];
            let busy =
                total - self.free(Tier::Gpu, g) - self.count(Tier::Gpu, g, |p| self.evictable(p));
            if f64::from(busy) / f64::from(total) > self.shape.max_util_for_resume {
                return false;
            }
        }
        let n = self.n_lc();
        let own = self.seqs[&id].pages.clone();
        let pending = self.seqs[&id].pending_copy;
        let mut needs = vec![0u32; self.groups()];
        for (i, pid) in own.iter().enumerate() {
            let p = &self.pages[pid];
            if pending == Some(i / n) || p.tier != Tier::Gpu {
                needs[p.group] += 1;
            }
        }
        if !self.make_room(&needs, &own) {
            return false;
        }
        for (i, &pid) in own.iter().enumerate() {
            if pending == Some(i / n) {
                let copy = self.new_locked_page(self.pages[&pid].life_cycle);
                self.seq_mut(id).pages[i] = copy;
                self.unref(pid, false);
            } else {
                if self.pages[&pid].tier != Tier::Gpu {
                    self.migrate(pid, Tier::Gpu);
                }
                let p = self.pages.get_mut(&pid).expect("live page");
                p.holds -= 1;
                p.locks += 1;
                self.touch(pid);
            }
        }
        let s = self.seq_mut(id);
        s.pending_copy = None;
        s.status = SeqStatus::Active;
        true
    }

    pub(crate) fn close(&mut self, id: RequestId) {
        self.stop(id);
        let s = self.seqs.remove(&id).expect("reference: live sequence");
        let lock = s.status == SeqStatus::Active;
        for &pid in s.pages.iter().rev() {
            self.unref(pid, lock);
        }
    }

    /// `reset_prefix_cache`: refused with the number of sequences holding pages, or
    /// every block dropped, returning (blocks, GPU pages, host pages) freed.
    pub(crate) fn reset_prefix_cache(&mut self) -> Result<(u64, u64, u64), usize> {
        let holding = self.seqs.values().filter(|s| !s.pages.is_empty()).count();
        if holding > 0 {
            return Err(holding);
        }
        // No sequence holds a page, so every live page is a tree page.
        let on = |tier| self.pages.values().filter(|p| p.tier == tier).count() as u64;
        let freed = (self.nodes.len() as u64, on(Tier::Gpu), on(Tier::Host));
        self.pages.clear();
        self.nodes.clear();
        self.roots.clear();
        Ok(freed)
    }

    // ---- what the test compares ---------------------------------------------------

    /// Pages per pool group on `tier`.
    pub(crate) fn occupied(&self, tier: Tier) -> Vec<u32> {
        (0..self.slots(tier).len())
            .map(|g| self.count(tier, g, |_| true))
            .collect()
    }

    /// Evictable pages per pool group on `tier`.
    pub(crate) fn evictable_pages(&self, tier: Tier) -> Vec<u32> {
        (0..self.slots(tier).len())
            .map(|g| self.count(tier, g, |p| self.evictable(p)))
            .collect()
    }

    pub(crate) fn num_pages(&self) -> usize {
        self.pages.len()
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.nodes.len()
    }

    /// Blocks of a sequence.
    pub(crate) fn num_seq_blocks(&self, id: RequestId) -> u64 {
        (self.seqs[&id].pages.len() / self.n_lc()) as u64
    }

    /// Every full cached block's 64-bit hash and whether a router sees it on the GPU:
    /// its pages and the pages of every block before it in its prefix are on the GPU.
    pub(crate) fn router_media(&self) -> Vec<(u64, bool)> {
        let on_gpu = |n: &Node| n.pages.iter().all(|pid| self.pages[pid].tier == Tier::Gpu);
        let mut out: Vec<(u64, bool)> = self
            .nodes
            .values()
            .filter(|n| n.tokens.len() == self.shape.tokens_per_block)
            .map(|n| {
                let mut gpu = on_gpu(n);
                let mut up = n.parent;
                while let Some(p) = up {
                    gpu &= on_gpu(&self.nodes[&p]);
                    up = self.nodes[&p].parent;
                }
                // The first 8 bytes of the key, little-endian (the crate's 64-bit hash).
                let hash = u64::from_le_bytes(n.key.0[..8].try_into().expect("8 bytes"));
                (hash, gpu)
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Every cached block's page: (key, life cycle, tier), sorted.
    pub(crate) fn cached(&self) -> Vec<(BlockKey, LifeCycleId, Tier)> {
        let mut out: Vec<_> = self
            .nodes
            .values()
            .flat_map(|n| {
                n.pages
                    .iter()
                    .enumerate()
                    .map(|(lc, pid)| (n.key, LifeCycleId(lc as u16), self.pages[pid].tier))
            })
            .collect();
        out.sort_unstable();
        out
    }
}
