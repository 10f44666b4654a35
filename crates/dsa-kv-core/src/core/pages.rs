//! Page records. A page is a slot on one tier plus its state. Its status is derived from
//! who refers to it, never stored:
//!
//! * **locked**: an active sequence uses it; it must stay on the GPU;
//! * **held**: only suspended sequences (or pending copies) refer to it; it may move down
//!   a tier but not be dropped; a **pinned** held page (an exported block being read by a
//!   transfer) does not move at all;
//! * **droppable**: nobody refers to it; only committed pages linked into the reuse tree
//!   live in this state (anything else is freed at once).

use super::fence::Fence;
use super::radix::NodeRef;
use crate::ids::{LifeCycleId, PageId, PoolGroupId, SlotId, Tier};

/// Derived page status.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PageStatus {
    /// In use by an active sequence; pinned to the GPU.
    Locked,
    /// Referred to by suspended sequences only; may move down, never dropped.
    Held,
    /// Referred to by nobody; kept for reuse until evicted.
    Droppable,
}

#[derive(Clone, Debug)]
pub(crate) struct Page {
    pub live: bool,
    pub life_cycle: LifeCycleId,
    pub group: PoolGroupId,
    pub tier: Tier,
    pub slot: SlotId,
    pub locks: u32,
    pub holders: u32,
    /// Holds of exported blocks (a subset of `holders`): the page must stay in its slot,
    /// on whatever tier it is, until the export is released.
    pub pins: u32,
    /// The tree block whose page this is (committed and shared).
    pub node: Option<NodeRef>,
    /// Immutable: committed into the tree at some point (it may have been unlinked since).
    pub committed: bool,
    pub priority: u8,
    /// Eviction-queue key `(priority, LRU stamp)` when the page is in its (tier, group)
    /// queue (the key is kept so a priority change cannot orphan a queue entry).
    pub queued: Option<(u8, u64)>,
    /// The fence after which the page's bytes are valid (a copy into it).
    pub ready: Fence,
}

impl Page {
    pub(super) fn status(&self) -> PageStatus {
        if self.locks > 0 {
            PageStatus::Locked
        } else if self.holders > 0 {
            PageStatus::Held
        } else {
            PageStatus::Droppable
        }
    }
}

#[derive(Default, Debug)]
pub(crate) struct PageArena {
    pages: Vec<Page>,
    free: Vec<PageId>,
    live: usize,
}

impl PageArena {
    pub(super) fn alloc(&mut self, page: Page) -> PageId {
        self.live += 1;
        match self.free.pop() {
            Some(id) => {
                self.pages[id.index()] = page;
                id
            }
            None => {
                self.pages.push(page);
                PageId((self.pages.len() - 1) as u32)
            }
        }
    }

    pub(super) fn release(&mut self, id: PageId) {
        let p = &mut self.pages[id.index()];
        assert!(p.live, "invariant: page {id} released twice");
        p.live = false;
        p.node = None;
        self.free.push(id);
        self.live -= 1;
    }

    pub(super) fn num_live(&self) -> usize {
        self.live
    }

    pub(super) fn iter_live(&self) -> impl Iterator<Item = (PageId, &Page)> + '_ {
        self.pages
            .iter()
            .enumerate()
            .filter(|(_, p)| p.live)
            .map(|(i, p)| (PageId(i as u32), p))
    }
}

impl std::ops::Index<PageId> for PageArena {
    type Output = Page;
    fn index(&self, id: PageId) -> &Page {
        &self.pages[id.index()]
    }
}

impl std::ops::IndexMut<PageId> for PageArena {
    fn index_mut(&mut self, id: PageId) -> &mut Page {
        &mut self.pages[id.index()]
    }
}
