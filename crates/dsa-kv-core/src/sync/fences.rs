//! Per-device completion fences.

use super::{AtomicU64, Ordering};
use crate::ids::Fence;

/// The highest fence each device has completed. A device publishes a fence after the
/// work ordered before it (kernels, copies) is done, with release ordering; a reader
/// that observes the fence (acquire) also observes that work. A slot released behind
/// fence `f` may be handed to a new owner once [`FenceBoard::is_complete`]`(f)`.
#[derive(Debug)]
pub struct FenceBoard {
    done: Vec<AtomicU64>,
}

impl FenceBoard {
    /// A board for `devices` devices, nothing completed.
    pub fn new(devices: usize) -> Self {
        FenceBoard {
            done: (0..devices).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Number of devices.
    pub fn devices(&self) -> usize {
        self.done.len()
    }

    /// Device `device` completed everything up to `fence` (monotonic: an older fence
    /// changes nothing). Returns `false` for a device index outside the board.
    pub fn complete(&self, device: usize, fence: Fence) -> bool {
        let Some(slot) = self.done.get(device) else {
            return false;
        };
        // One read-modify-write (no separate load): monotonic, and release-ordered after
        // the device's work.
        slot.fetch_max(fence.0, Ordering::Release);
        true
    }

    /// The highest fence device `device` completed (`Fence(0)` for an unknown device).
    pub fn completed(&self, device: usize) -> Fence {
        Fence(
            self.done
                .get(device)
                .map_or(0, |d| d.load(Ordering::Acquire)),
        )
    }

    /// The highest fence every device completed.
    pub fn all_completed(&self) -> Fence {
        Fence(
            self.done
                .iter()
                .map(|d| d.load(Ordering::Acquire))
                .min()
                .unwrap_or(0),
        )
    }

    /// Whether every device completed `fence`.
    pub fn is_complete(&self, fence: Fence) -> bool {
        self.all_completed() >= fence
    }
}
