//! Completion fences. Every piece of device work the manager hands out (a step, a copy
//! plan) carries a [`Fence`]: a number from one monotonically increasing sequence. The
//! devices report completion as a watermark ("everything up to fence `f` is done"); with
//! several devices (tensor parallelism) the watermark is the minimum over devices.
//!
//! A released slot keeps the fence of its last user and is not handed out as *ready*
//! before the watermark passes it, so a new user never writes a slot that device work
//! still reads or writes.

pub(super) use crate::ids::Fence;

/// Issued and completed watermarks.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct FenceClock {
    issued: u64,
    completed: u64,
}

impl FenceClock {
    /// A clock with nothing issued.
    pub fn new() -> Self {
        Self::default()
    }

    /// Issues the next fence.
    pub fn issue(&mut self) -> Fence {
        self.issued += 1;
        Fence(self.issued)
    }

    /// The last fence issued (`Fence::NONE` if none).
    pub fn issued(&self) -> Fence {
        Fence(self.issued)
    }

    /// The completion watermark.
    pub fn completed(&self) -> Fence {
        Fence(self.completed)
    }

    /// Records that every fence up to `f` has completed. Watermarks never go back, and
    /// a fence that was never issued cannot complete.
    pub fn complete_up_to(&mut self, f: Fence) -> Result<(), Fence> {
        if f.0 > self.issued {
            return Err(self.issued());
        }
        self.completed = self.completed.max(f.0);
        Ok(())
    }

    /// Whether `f` has completed.
    pub fn is_complete(&self, f: Fence) -> bool {
        f.0 <= self.completed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_watermarks() {
        let mut c = FenceClock::new();
        assert!(c.is_complete(Fence::NONE));
        let a = c.issue();
        let b = c.issue();
        assert_eq!((a, b), (Fence(1), Fence(2)));
        assert!(!c.is_complete(a));
        assert_eq!(c.complete_up_to(Fence(3)), Err(Fence(2)));
        c.complete_up_to(a).unwrap();
        assert!(c.is_complete(a) && !c.is_complete(b));
        c.complete_up_to(Fence::NONE).unwrap();
        assert_eq!(c.completed(), a, "watermarks never go back");
    }
}
