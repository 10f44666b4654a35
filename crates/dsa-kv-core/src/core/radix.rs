//! Radix tree of committed blocks. One root per reuse scope (keyed by the scope's root
//! key); each node is one block (full, or a partial last block, which is always a
//! leaf) holding one page per life cycle. Nodes are addressed by generation-checked
//! [`NodeRef`]s, so a sequence that remembers a node that has since been evicted sees
//! `None` instead of someone else's block.
//!
//! The tree knows nothing of page states; the manager decides what to drop and is told
//! which pages a removal unlinked.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use super::reuse_key::{BlockKey, KeyHasher};
use super::router_events::Medium;
use crate::ids::{PageId, TokenId};

impl Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The key is already a uniform digest: 8 of its bytes are a perfect hash.
        state.write_u64(u64::from_le_bytes(
            self.0[..8].try_into().expect("invariant: 8 bytes"),
        ));
    }
}

/// Passes a digest's 8 bytes through unchanged.
#[derive(Default)]
pub(crate) struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub(crate) type KeyMap<V> = HashMap<BlockKey, V, BuildHasherDefault<DigestHasher>>;

/// A generation-checked reference to a tree node.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct NodeRef {
    idx: u32,
    gen: u32,
}

#[derive(Debug)]
pub(crate) struct Node {
    gen: u32,
    live: bool,
    /// This block's chained key (roots: the scope's root key).
    pub key: BlockKey,
    pub parent: Option<u32>,
    /// Block tokens (empty for roots).
    pub tokens: Vec<TokenId>,
    pub children: KeyMap<u32>,
    /// One page per life cycle (empty for roots).
    pub pages: Vec<PageId>,
    /// LoRA adapter of the node's reuse scope (router events name it).
    pub lora_id: Option<u64>,
    /// The medium this full block was last announced on to routers (`None`: not
    /// announced — a partial block, or router events off).
    pub router_medium: Option<Medium>,
}

/// The result of walking the tree with a token sequence.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct TreeMatch {
    /// Matched full blocks, in order.
    pub full: Vec<NodeRef>,
    /// A block whose first `n` tokens match the tokens after the full blocks.
    pub partial: Option<(NodeRef, u32)>,
}

/// Outcome of inserting a block.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Insert {
    /// A new node holds the given pages.
    New(NodeRef),
    /// A full block with the same key exists.
    Duplicate(NodeRef),
    /// A partial block whose tokens are a prefix of an existing sibling: nothing stored.
    Useless,
}

/// A node removed from the tree: its key and the pages it unlinked.
#[derive(Debug)]
pub(crate) struct Removed {
    pub key: BlockKey,
    pub pages: Vec<PageId>,
    /// The medium the block was announced on to routers, if it was.
    pub router_medium: Option<Medium>,
}

#[derive(Default, Debug)]
pub(crate) struct RadixTree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    roots: KeyMap<u32>,
    num_blocks: usize,
}

impl RadixTree {
    fn r(&self, idx: u32) -> NodeRef {
        NodeRef {
            idx,
            gen: self.nodes[idx as usize].gen,
        }
    }

    /// The node, if `r` still names a live node.
    pub(super) fn get(&self, r: NodeRef) -> Option<&Node> {
        self.nodes
            .get(r.idx as usize)
            .filter(|n| n.live && n.gen == r.gen)
    }

    /// The node; `r` must be live.
    pub(super) fn node(&self, r: NodeRef) -> &Node {
        self.get(r).expect("invariant: node reference is live")
    }

    /// Number of blocks (non-root nodes).
    pub(super) fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Number of scope roots.
    #[cfg(test)]
    pub(super) fn num_roots(&self) -> usize {
        self.roots.len()
    }

    pub(super) fn root(&self, key: &BlockKey) -> Option<NodeRef> {
        self.roots.get(key).map(|&i| self.r(i))
    }

    fn alloc(&mut self, node: Node) -> u32 {
        match self.free.pop() {
            Some(i) => {
                let gen = self.nodes[i as usize].gen.wrapping_add(1);
                self.nodes[i as usize] = Node { gen, ..node };
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn new_node(
        key: BlockKey,
        parent: Option<u32>,
        tokens: Vec<TokenId>,
        pages: Vec<PageId>,
        lora_id: Option<u64>,
    ) -> Node {
        Node {
            gen: 0,
            live: true,
            key,
            parent,
            tokens,
            children: KeyMap::default(),
            pages,
            lora_id,
            router_medium: None,
        }
    }

    /// The root of a scope (`key` is its root key, `lora_id` its LoRA adapter).
    pub(super) fn root_or_insert(&mut self, key: BlockKey, lora_id: Option<u64>) -> NodeRef {
        if let Some(r) = self.root(&key) {
            return r;
        }
        let idx = self.alloc(Self::new_node(key, None, Vec::new(), Vec::new(), lora_id));
        self.roots.insert(key, idx);
        self.r(idx)
    }

    pub(super) fn child(&self, parent: NodeRef, key: &BlockKey) -> Option<NodeRef> {
        self.node(parent).children.get(key).map(|&i| self.r(i))
    }

    /// Walks full blocks of `tokens`, then (if `partial`) picks the child with the longest
    /// common token prefix with the rest. Ties go to the smallest key, so every rank
    /// picks the same block.
    pub(super) fn match_prefix(
        &self,
        hasher: &mut KeyHasher,
        root_key: &BlockKey,
        tokens: &[TokenId],
        tokens_per_block: usize,
        partial: bool,
    ) -> TreeMatch {
        let mut out = TreeMatch::default();
        let Some(mut cur) = self.root(root_key) else {
            return out;
        };
        let mut key = *root_key;
        for chunk in tokens.chunks_exact(tokens_per_block) {
            let k = hasher.block_key(&key, chunk);
            match self.child(cur, &k) {
                Some(c) => {
                    out.full.push(c);
                    cur = c;
                    key = k;
                }
                None => break,
            }
        }
        let rest = &tokens[out.full.len() * tokens_per_block..];
        if partial && !rest.is_empty() {
            let mut best: Option<(u32, BlockKey, u32)> = None;
            for &c in self.node(cur).children.values() {
                let n = &self.nodes[c as usize];
                let lcp = n
                    .tokens
                    .iter()
                    .zip(rest)
                    .take_while(|(a, b)| a == b)
                    .count() as u32;
                let better = match best {
                    None => lcp > 0,
                    Some((l, k, _)) => lcp > l || (lcp == l && n.key < k),
                };
                if better {
                    best = Some((lcp, n.key, c));
                }
            }
            out.partial = best.map(|(lcp, _, c)| (self.r(c), lcp));
        }
        out
    }

    /// Inserts a block under `parent`. A full block whose key exists is a duplicate; a
    /// partial block that is a prefix of a sibling is useless. A new block replaces
    /// shorter partial siblings whose tokens it extends (their removal is reported in
    /// `removed`).
    pub(super) fn insert(
        &mut self,
        parent: NodeRef,
        key: BlockKey,
        tokens: &[TokenId],
        pages: &[PageId],
        tokens_per_block: usize,
        removed: &mut Vec<Removed>,
    ) -> Insert {
        if let Some(existing) = self.child(parent, &key) {
            return Insert::Duplicate(existing);
        }
        let siblings: Vec<u32> = self.node(parent).children.values().copied().collect();
        if tokens.len() < tokens_per_block
            && siblings
                .iter()
                .any(|&s| self.nodes[s as usize].tokens.starts_with(tokens))
        {
            return Insert::Useless;
        }
        // Insert first so that removing the replaced siblings never leaves the root
        // childless (which would prune it under our feet).
        let pidx = parent.idx;
        let lora_id = self.nodes[pidx as usize].lora_id;
        let idx = self.alloc(Self::new_node(
            key,
            Some(pidx),
            tokens.to_vec(),
            pages.to_vec(),
            lora_id,
        ));
        self.nodes[pidx as usize].children.insert(key, idx);
        self.num_blocks += 1;
        for s in siblings {
            let n = &self.nodes[s as usize];
            if n.tokens.len() < tokens_per_block && tokens.starts_with(&n.tokens) {
                let r = self.r(s);
                self.remove_subtree(r, removed);
            }
        }
        Insert::New(self.r(idx))
    }

    /// The parent block's key; `None` under a scope root.
    pub(super) fn parent_block_key(&self, r: NodeRef) -> Option<BlockKey> {
        let i = self
            .node(r)
            .parent
            .expect("invariant: a block has a parent");
        let parent = &self.nodes[i as usize];
        parent.parent.map(|_| parent.key)
    }

    /// Replaces the page of life cycle `lc` of a block (a donation on rebase).
    pub(super) fn set_page(&mut self, r: NodeRef, lc: usize, page: PageId) -> PageId {
        let n = &mut self.nodes[r.idx as usize];
        assert!(
            n.live && n.gen == r.gen,
            "invariant: node reference is live"
        );
        std::mem::replace(&mut n.pages[lc], page)
    }

    /// Removes `r` and its descendants (pre-order: a block before its descendants,
    /// siblings in ascending key order; no recursion); prunes the scope root when it
    /// loses its last child. The order is specified, not the hash map's, because the
    /// manager re-queues the surviving pages in this order (their LRU order).
    pub(super) fn remove_subtree(&mut self, r: NodeRef, removed: &mut Vec<Removed>) {
        let Some(top) = self.get(r) else { return };
        let parent = top.parent;
        assert!(
            parent.is_some(),
            "invariant: only blocks are removed, never a scope root"
        );
        let top_key = top.key;
        let mut stack = vec![r.idx];
        while let Some(i) = stack.pop() {
            let first_child = stack.len();
            stack.extend(self.nodes[i as usize].children.values().copied());
            // Largest key deepest in the stack: the smallest is popped first.
            let nodes = &self.nodes;
            stack[first_child..]
                .sort_unstable_by(|&a, &b| nodes[b as usize].key.cmp(&nodes[a as usize].key));
            let n = &mut self.nodes[i as usize];
            n.children.clear();
            n.live = false;
            removed.push(Removed {
                key: n.key,
                pages: std::mem::take(&mut n.pages),
                router_medium: n.router_medium.take(),
            });
            n.tokens = Vec::new();
            self.free.push(i);
            self.num_blocks -= 1;
        }
        if let Some(p) = parent {
            let pn = &mut self.nodes[p as usize];
            pn.children.remove(&top_key);
            if pn.parent.is_none() && pn.children.is_empty() {
                let root_key = pn.key;
                pn.live = false;
                self.roots.remove(&root_key);
                self.free.push(p);
            }
        }
    }

    /// Removes every block and every scope root. The blocks are reported in node order
    /// (deterministic, so every rank frees the same slots in the same order). Freed nodes
    /// keep their generations: a stale [`NodeRef`] stays stale.
    pub(super) fn clear(&mut self, removed: &mut Vec<Removed>) {
        for (i, n) in self.nodes.iter_mut().enumerate().filter(|(_, n)| n.live) {
            n.live = false;
            n.children.clear();
            if n.parent.is_some() {
                removed.push(Removed {
                    key: n.key,
                    pages: std::mem::take(&mut n.pages),
                    router_medium: n.router_medium.take(),
                });
            }
            n.tokens = Vec::new();
            self.free.push(i as u32);
        }
        self.roots.clear();
        self.num_blocks = 0;
    }

    /// Records the medium a block was announced on to routers.
    pub(super) fn set_router_medium(&mut self, r: NodeRef, medium: Option<Medium>) {
        let n = &mut self.nodes[r.idx as usize];
        assert!(
            n.live && n.gen == r.gen,
            "invariant: node reference is live"
        );
        n.router_medium = medium;
    }

    /// The parent of a block when the parent is a block (`None` under a scope root).
    pub(super) fn parent_block(&self, r: NodeRef) -> Option<NodeRef> {
        let p = self.node(r).parent?;
        self.nodes[p as usize].parent.map(|_| self.r(p))
    }

    /// The child blocks of a node, in ascending key order.
    pub(super) fn child_blocks(&self, r: NodeRef) -> Vec<NodeRef> {
        let mut c: Vec<u32> = self.node(r).children.values().copied().collect();
        c.sort_unstable_by(|&a, &b| self.nodes[a as usize].key.cmp(&self.nodes[b as usize].key));
        c.into_iter().map(|i| self.r(i)).collect()
    }

    /// Every live block, each after its parent (scope roots by key, then depth first,
    /// siblings by key).
    pub(super) fn blocks_top_down(&self) -> Vec<NodeRef> {
        let mut roots: Vec<u32> = self.roots.values().copied().collect();
        roots
            .sort_unstable_by(|&a, &b| self.nodes[b as usize].key.cmp(&self.nodes[a as usize].key));
        let mut out = Vec::with_capacity(self.num_blocks);
        let mut stack = roots;
        while let Some(i) = stack.pop() {
            if self.nodes[i as usize].parent.is_some() {
                out.push(self.r(i));
            }
            let first = stack.len();
            stack.extend(self.nodes[i as usize].children.values().copied());
            let nodes = &self.nodes;
            stack[first..]
                .sort_unstable_by(|&a, &b| nodes[b as usize].key.cmp(&nodes[a as usize].key));
        }
        out
    }

    /// Every live block with its parent, for invariant checks.
    pub(super) fn blocks(&self) -> impl Iterator<Item = (NodeRef, &Node)> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.live && n.parent.is_some())
            .map(|(i, n)| {
                (
                    NodeRef {
                        idx: i as u32,
                        gen: n.gen,
                    },
                    n,
                )
            })
    }

    /// Panics when parent/child links or counts are inconsistent.
    pub(super) fn check_invariants(&self, tokens_per_block: usize) {
        let mut blocks = 0;
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.live) {
            match n.parent {
                None => {
                    assert_eq!(self.roots.get(&n.key), Some(&(i as u32)), "root registered");
                    assert!(!n.children.is_empty(), "childless root {} kept", n.key);
                }
                Some(p) => {
                    blocks += 1;
                    let pn = &self.nodes[p as usize];
                    assert!(pn.live, "parent of {} is dead", n.key);
                    assert_eq!(pn.children.get(&n.key), Some(&(i as u32)), "child link");
                    assert_eq!(
                        n.lora_id, pn.lora_id,
                        "block {} left its parent's scope",
                        n.key
                    );
                    assert!(!n.pages.is_empty(), "block {} has no page", n.key);
                    assert!(!n.tokens.is_empty() && n.tokens.len() <= tokens_per_block);
                    if n.tokens.len() < tokens_per_block {
                        assert!(
                            n.children.is_empty(),
                            "partial block {} has children",
                            n.key
                        );
                    }
                }
            }
            for &c in n.children.values() {
                assert_eq!(self.nodes[c as usize].parent, Some(i as u32), "parent link");
                assert!(self.nodes[c as usize].live, "dead child");
            }
        }
        assert_eq!(blocks, self.num_blocks, "block count");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::reuse_key::ReuseScope;

    const T: usize = 4;

    fn toks(v: &[u32]) -> Vec<TokenId> {
        v.iter().copied().map(TokenId).collect()
    }

    /// Inserts `tokens` block by block under the scope root; returns the node refs.
    fn insert_seq(
        tree: &mut RadixTree,
        h: &mut KeyHasher,
        root: &BlockKey,
        tokens: &[TokenId],
        page0: u32,
    ) -> Vec<NodeRef> {
        let mut parent = tree.root_or_insert(*root, None);
        let mut key = *root;
        let mut out = vec![];
        let mut removed = vec![];
        for (i, chunk) in tokens.chunks(T).enumerate() {
            let k = h.block_key(&key, chunk);
            match tree.insert(
                parent,
                k,
                chunk,
                &[PageId(page0 + i as u32)],
                T,
                &mut removed,
            ) {
                Insert::New(r) | Insert::Duplicate(r) => {
                    out.push(r);
                    parent = r;
                    key = k;
                }
                Insert::Useless => break,
            }
        }
        out
    }

    #[test]
    fn full_and_partial_matches() {
        let mut tree = RadixTree::default();
        let mut h = KeyHasher::default();
        let root = ReuseScope::SHARED.root_key();
        let seq = toks(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        let nodes = insert_seq(&mut tree, &mut h, &root, &seq, 0);
        assert_eq!(nodes.len(), 3);
        assert_eq!(tree.num_blocks(), 3);
        tree.check_invariants(T);

        let m = tree.match_prefix(&mut h, &root, &seq, T, true);
        assert_eq!(m.full, nodes[..2].to_vec());
        assert_eq!(m.partial, Some((nodes[2], 2)));
        // Divergence inside block 1: one full block, 2 tokens of block 1.
        let m = tree.match_prefix(&mut h, &root, &toks(&[1, 2, 3, 4, 5, 6, 0, 0, 9]), T, true);
        assert_eq!((m.full.len(), m.partial), (1, Some((nodes[1], 2))));
        // Partial reuse off.
        let m = tree.match_prefix(&mut h, &root, &toks(&[1, 2, 3, 4, 5, 6, 0]), T, false);
        assert_eq!((m.full.len(), m.partial), (1, None));
        // Another scope sees nothing.
        let other = ReuseScope {
            lora_id: None,
            salt: Some(1),
        }
        .root_key();
        assert_eq!(
            tree.match_prefix(&mut h, &other, &seq, T, true),
            TreeMatch::default()
        );
        // No common token: no partial.
        let m = tree.match_prefix(&mut h, &root, &toks(&[9, 9]), T, true);
        assert_eq!(m, TreeMatch::default());
    }

    #[test]
    fn duplicates_useless_and_replacement() {
        let mut tree = RadixTree::default();
        let mut h = KeyHasher::default();
        let root = ReuseScope::SHARED.root_key();
        let r = tree.root_or_insert(root, None);
        let mut removed = vec![];
        let full = toks(&[1, 2, 3, 4]);
        let kf = h.block_key(&root, &full);
        let n1 = match tree.insert(r, kf, &full, &[PageId(1)], T, &mut removed) {
            Insert::New(n) => n,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            tree.insert(r, kf, &full, &[PageId(2)], T, &mut removed),
            Insert::Duplicate(n1)
        );
        // A partial block that is a prefix of the full sibling is useless.
        let p = toks(&[1, 2]);
        assert_eq!(
            tree.insert(r, h.block_key(&root, &p), &p, &[PageId(3)], T, &mut removed),
            Insert::Useless
        );
        // A partial block [5] then a longer one [5, 6] replaces it.
        let a = toks(&[5]);
        let na = match tree.insert(r, h.block_key(&root, &a), &a, &[PageId(4)], T, &mut removed) {
            Insert::New(n) => n,
            other => panic!("{other:?}"),
        };
        let b = toks(&[5, 6]);
        assert!(matches!(
            tree.insert(r, h.block_key(&root, &b), &b, &[PageId(5)], T, &mut removed),
            Insert::New(_)
        ));
        assert_eq!(removed.len(), 1);
        assert_eq!(removed[0].pages, vec![PageId(4)]);
        assert!(tree.get(na).is_none(), "replaced node is gone");
        assert_eq!(tree.num_blocks(), 2);
        tree.check_invariants(T);
    }

    #[test]
    fn subtree_removal_prunes_root_and_invalidates_refs() {
        let mut tree = RadixTree::default();
        let mut h = KeyHasher::default();
        let root = ReuseScope::SHARED.root_key();
        let a = insert_seq(
            &mut tree,
            &mut h,
            &root,
            &toks(&[1, 2, 3, 4, 5, 6, 7, 8]),
            10,
        );
        let b = insert_seq(
            &mut tree,
            &mut h,
            &root,
            &toks(&[1, 2, 3, 4, 9, 9, 9, 9, 1]),
            20,
        );
        assert_eq!(a[0], b[0]);
        assert_eq!(tree.num_blocks(), 4);
        let mut removed = vec![];
        tree.remove_subtree(a[1], &mut removed);
        assert_eq!(
            removed
                .iter()
                .flat_map(|r| r.pages.clone())
                .collect::<Vec<_>>(),
            vec![PageId(11)]
        );
        assert_eq!(tree.num_blocks(), 3);
        removed.clear();
        tree.remove_subtree(a[0], &mut removed);
        let pages: Vec<_> = removed.iter().flat_map(|r| r.pages.clone()).collect();
        assert_eq!(pages, vec![PageId(10), PageId(21), PageId(22)], "pre-order");
        assert_eq!((tree.num_blocks(), tree.num_roots()), (0, 0));
        assert!(tree.get(b[2]).is_none());
        // Slots are recycled with a new generation: old refs stay dead.
        let c = insert_seq(&mut tree, &mut h, &root, &toks(&[4, 4, 4, 4]), 30);
        assert!(tree.get(c[0]).is_some());
        assert!(tree.get(a[0]).is_none() && tree.get(b[1]).is_none());
        tree.check_invariants(T);
    }

    #[test]
    fn subtree_removal_order_is_pre_order_by_key() {
        let mut tree = RadixTree::default();
        let mut h = KeyHasher::default();
        let root = ReuseScope::SHARED.root_key();
        // Block X with four child branches, one of them two blocks deep.
        let x = insert_seq(&mut tree, &mut h, &root, &toks(&[1, 2, 3, 4]), 0)[0];
        for (i, t) in [5u32, 6, 7, 8].into_iter().enumerate() {
            let mut seq = toks(&[1, 2, 3, 4, t, t, t, t]);
            if t == 6 {
                seq.extend(toks(&[9, 9, 9, 9]));
            }
            insert_seq(&mut tree, &mut h, &root, &seq, 10 * (i as u32 + 1));
        }
        let kx = tree.node(x).key;
        let mut key = |tokens: &[u32]| h.block_key(&kx, &toks(tokens));
        let mut branches: Vec<(BlockKey, Vec<PageId>)> = [5u32, 6, 7, 8]
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                let first = PageId(10 * (i as u32 + 1) + 1);
                let pages = if t == 6 {
                    vec![first, PageId(first.0 + 1)]
                } else {
                    vec![first]
                };
                (key(&[t, t, t, t]), pages)
            })
            .collect();
        branches.sort();
        let mut removed = vec![];
        tree.remove_subtree(x, &mut removed);
        let got: Vec<PageId> = removed.iter().flat_map(|r| r.pages.clone()).collect();
        let mut want = vec![PageId(0)];
        want.extend(branches.into_iter().flat_map(|b| b.1));
        assert_eq!(got, want);
        assert_eq!(tree.num_blocks(), 0);
    }

    #[test]
    fn partial_tie_breaks_by_key() {
        let mut tree = RadixTree::default();
        let mut h = KeyHasher::default();
        let root = ReuseScope::SHARED.root_key();
        insert_seq(&mut tree, &mut h, &root, &toks(&[1, 2, 3, 4]), 0);
        insert_seq(&mut tree, &mut h, &root, &toks(&[1, 2, 9, 9]), 1);
        let k1 = h.block_key(&root, &toks(&[1, 2, 3, 4]));
        let k2 = h.block_key(&root, &toks(&[1, 2, 9, 9]));
        let m = tree.match_prefix(&mut h, &root, &toks(&[1, 2, 7]), T, true);
        let (node, n) = m.partial.unwrap();
        assert_eq!(n, 2);
        assert_eq!(tree.node(node).key, k1.min(k2));
    }
}
