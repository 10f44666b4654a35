//! Strongly typed identifiers. Every index that crosses a module boundary has its own
//! newtype so that a slot id can never be passed where a page index or a layer id is
//! expected (TensorRT-LLM's C++ port adopted the same rule after bugs from mixing them).

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl $name {
            /// The raw value.
            #[inline]
            pub const fn get(self) -> $inner {
                self.0
            }

            /// The raw value as a `usize` index.
            #[inline]
            pub const fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

id_type!(
    /// A model layer (global layer number; MTP layers follow the target layers).
    LayerId(u32)
);
id_type!(
    /// A slot inside the pools of one pool group on one tier. One slot id addresses every
    /// pool of the group (mirrored allocation).
    SlotId(u32)
);
id_type!(
    /// A page index as a kernel sees it for one (layer, role) buffer:
    /// `slot × scale + layer_offset`.
    PageIndex(u32)
);
id_type!(
    /// A request (sequence) id chosen by the serving framework.
    RequestId(u64)
);
id_type!(
    /// A pool group: pools that share one slot-id space.
    PoolGroupId(u16)
);
id_type!(
    /// A pool inside a pool group (pools are ordered by slot size, descending).
    PoolId(u16)
);
id_type!(
    /// A life cycle: layers whose pages are always allocated and freed together.
    LifeCycleId(u16)
);
id_type!(
    /// A block's position inside its sequence (block `b` holds tokens `[b·T, (b+1)·T)`).
    BlockOrdinal(u32)
);
id_type!(
    /// A page record inside the cache manager (a slot plus its state). Internal bookkeeping;
    /// kernels never see it.
    PageId(u32)
);
id_type!(
    /// A token id. Reuse keys encode it as 4 little-endian bytes; ids must be below 2^31.
    TokenId(u32)
);

impl TokenId {
    /// Largest token id the reuse-key encoding accepts (the high bit is reserved for
    /// digest tokens, as in TensorRT-LLM's C++ key encoding).
    pub const MAX: u32 = (1 << 31) - 1;
}

/// A point in the sequence of device work (steps and copy plans), from one counter that
/// only grows. Devices report completion as a watermark: everything up to a fence is
/// done. `Fence::NONE` is always complete.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct Fence(pub u64);

impl Fence {
    /// A fence that is complete from the start.
    pub const NONE: Fence = Fence(0);
}

/// A memory tier, warmest first.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Device memory (the only tier kernels read).
    Gpu,
    /// Host memory (offload tier).
    Host,
}

impl Tier {
    /// Both tiers, warmest first.
    pub const ALL: [Tier; 2] = [Tier::Gpu, Tier::Host];

    /// Position in [`Tier::ALL`].
    #[inline]
    pub const fn index(self) -> usize {
        match self {
            Tier::Gpu => 0,
            Tier::Host => 1,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Gpu => "gpu",
            Tier::Host => "host",
        })
    }
}
