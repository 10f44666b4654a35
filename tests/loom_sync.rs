//! loom models of the shared-memory primitives in `dsa_kv::sync`, each next to a
//! deliberately broken twin that the checker must catch (`#[should_panic]`).
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
//!       cargo test --release --test 'loom_*'`; with `LOOM_LOG=info` and `--nocapture` loom
//! prints each model's interleavings ("Completed in N iterations"), as in `RELIABILITY.md`.
#![cfg(loom)]

use dsa_kv::ids::Fence;
use dsa_kv::layout::IndexerPageLayout;
use dsa_kv::metadata::{
    Bindings, MetadataDims, MetadataLayout, RequestKind, StepMetadata, StepRequest,
};
use dsa_kv::sync::{FenceBoard, Published, QuotaLedger, SeqCounters};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Outcomes observed across all explored interleavings (std, invisible to loom): each
/// model asserts it saw more than one, evidence that the interleavings were explored.
type Seen<T> = std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<T>>>;

fn seen<T: Ord>() -> Seen<T> {
    Default::default()
}

fn record<T: Ord>(s: &Seen<T>, v: T) {
    s.lock().unwrap().insert(v);
}

fn distinct<T: Ord>(s: &Seen<T>) -> usize {
    s.lock().unwrap().len()
}

/// A slot's bytes on one device: whoever touches it must own it (loom reports a data
/// race on any concurrent access).
struct SlotBytes(UnsafeCell<u64>);

// SAFETY: access is what the models check; loom's UnsafeCell tracks it.
unsafe impl Sync for SlotBytes {}

impl SlotBytes {
    fn new() -> Self {
        SlotBytes(UnsafeCell::new(0))
    }
    fn write(&self, v: u64) {
        self.0.with_mut(|p| unsafe { *p = v });
    }
    fn read(&self) -> u64 {
        self.0.with(|p| unsafe { *p })
    }
}

/// A fence board: the real one or a broken twin.
trait Board: Send + Sync + 'static {
    fn complete(&self, device: usize, f: Fence);
    fn completed(&self, device: usize) -> Fence;
    fn all_completed(&self) -> Fence;
    fn is_complete(&self, f: Fence) -> bool {
        self.all_completed() >= f
    }
}

impl Board for FenceBoard {
    fn complete(&self, device: usize, f: Fence) {
        FenceBoard::complete(self, device, f);
    }
    fn completed(&self, device: usize) -> Fence {
        FenceBoard::completed(self, device)
    }
    fn all_completed(&self) -> Fence {
        FenceBoard::all_completed(self)
    }
    fn is_complete(&self, f: Fence) -> bool {
        FenceBoard::is_complete(self, f)
    }
}

fn zeroed(devices: usize) -> Vec<AtomicU64> {
    (0..devices).map(|_| AtomicU64::new(0)).collect()
}

/// Broken twin: the same board with relaxed orderings (no release/acquire pairing).
struct RelaxedBoard(Vec<AtomicU64>);

impl Board for RelaxedBoard {
    fn complete(&self, device: usize, f: Fence) {
        self.0[device].fetch_max(f.0, Ordering::Relaxed);
    }
    fn completed(&self, device: usize) -> Fence {
        Fence(self.0[device].load(Ordering::Relaxed))
    }
    fn all_completed(&self) -> Fence {
        Fence(
            self.0
                .iter()
                .map(|d| d.load(Ordering::Relaxed))
                .min()
                .unwrap_or(0),
        )
    }
}

/// Broken twin: the same orderings, and each publish checks that it moves the fence
/// forward, but as a load then a store: a completer that loaded before another's store
/// overwrites it with an older fence. (One completer alone never notices.)
struct CheckThenStoreBoard(Vec<AtomicU64>);

impl Board for CheckThenStoreBoard {
    fn complete(&self, device: usize, f: Fence) {
        if f.0 > self.0[device].load(Ordering::Acquire) {
            self.0[device].store(f.0, Ordering::Release);
        }
    }
    fn completed(&self, device: usize) -> Fence {
        Fence(self.0[device].load(Ordering::Acquire))
    }
    fn all_completed(&self) -> Fence {
        Fence(
            self.0
                .iter()
                .map(|d| d.load(Ordering::Acquire))
                .min()
                .unwrap_or(0),
        )
    }
}

/// Two devices finish their last writes to a released slot and publish fence 1; the
/// allocator hands the slot to a new owner (who writes it on both devices) once it
/// observes the fence — or at once when `wait` is false (broken).
fn released_slot_model<B: Board>(board: B, wait: bool, first_check: &Seen<bool>) {
    let board = Arc::new(board);
    let slot = Arc::new([SlotBytes::new(), SlotBytes::new()]);
    let devices: Vec<_> = (0..2)
        .map(|d| {
            let (board, slot) = (board.clone(), slot.clone());
            thread::spawn(move || {
                slot[d].write(10 + d as u64); // the old owner's last kernel
                board.complete(d, Fence(1));
            })
        })
        .collect();
    if wait {
        record(first_check, board.is_complete(Fence(1)));
        while !board.is_complete(Fence(1)) {
            thread::yield_now();
        }
    }
    // The new owner's first write.
    slot[0].write(20);
    slot[1].write(21);
    for d in devices {
        d.join().unwrap();
    }
    assert_eq!((slot[0].read(), slot[1].read()), (20, 21));
}

#[test]
fn a_released_slot_is_not_reused_before_its_fence_completes() {
    let first = seen();
    let f = first.clone();
    loom::model(move || released_slot_model(FenceBoard::new(2), true, &f));
    assert_eq!(
        distinct(&first),
        2,
        "explored both: fence done and not yet done"
    );
}

#[test]
#[should_panic(expected = "Causality violation")]
fn broken_twin_reusing_without_waiting_races() {
    loom::model(|| released_slot_model(FenceBoard::new(2), false, &seen()));
}

#[test]
#[should_panic(expected = "Causality violation")]
fn broken_twin_relaxed_fences_race() {
    loom::model(|| released_slot_model(RelaxedBoard(zeroed(2)), true, &seen()));
}

/// Two completers of one device's fence: device 0's actor publishing the fences of two
/// steps, and the coordinator marking device 0 lost (`Fence(u64::MAX)`: a dead device
/// holds back no fence). In the runtime the lost mark follows the device's last publish
/// through kameo's messages; the model lets them race, so the board does not rely on
/// that: the highest fence stands whoever writes last. Device 1 is at fence 3. A handle
/// reads the minimum lock-free twice meanwhile (`KvCacheHandle::counters`): it never
/// goes backwards.
fn monotonic_model<B: Board>(board: B, observed: &Seen<(Fence, Fence)>) {
    let board = Arc::new(board);
    board.complete(1, Fence(3));
    let b = board.clone();
    let device = thread::spawn(move || {
        b.complete(0, Fence(1));
        b.complete(0, Fence(2));
    });
    let b = board.clone();
    let coordinator = thread::spawn(move || b.complete(0, Fence(u64::MAX)));
    let first = board.all_completed();
    let second = board.all_completed();
    assert!(
        second >= first,
        "the completed fence went backwards: {first:?} then {second:?}"
    );
    record(observed, (first, second));
    device.join().unwrap();
    coordinator.join().unwrap();
    assert_eq!(
        board.completed(0),
        Fence(u64::MAX),
        "the completed fence went backwards: a late publish undid the lost mark"
    );
    assert_eq!(
        board.all_completed(),
        Fence(3),
        "the slowest live device decides"
    );
}

#[test]
fn fences_are_monotonic_and_the_slowest_device_decides() {
    let observed = seen();
    let o = observed.clone();
    loom::model(move || {
        let board = FenceBoard::new(2);
        assert!(!board.complete(5, Fence(1)), "an unknown device is refused");
        monotonic_model(board, &o)
    });
    assert_eq!(
        distinct(&observed),
        10,
        "the handle read every pair first <= second of 0 (nothing yet), 1 and 2 (device 0's \
         steps) and 3 (device 0 lost: device 1 decides)"
    );
}

#[test]
#[should_panic(expected = "the completed fence went backwards")]
fn broken_twin_check_then_store_fences_go_backwards() {
    loom::model(|| monotonic_model(CheckThenStoreBoard(zeroed(2)), &seen()));
}

/// Real target and draft bindings of a step with one context request (std-only code,
/// computed outside the model).
fn target_and_draft_bindings() -> (Bindings, Bindings) {
    let layout = MetadataLayout {
        tokens_per_block: 64,
        indexer_page_scale: 1,
        indexer: Some(IndexerPageLayout {
            tokens_per_block: 64,
            data_bytes: 128,
            scale_bytes: 4,
        }),
    };
    let dims = MetadataDims {
        max_num_sequences: 2,
        max_blocks_per_seq: 4,
        max_num_tokens: 64,
        max_context_kv_tokens: 128,
    };
    let mut m = StepMetadata::new(layout, dims, Some(dims), true).unwrap();
    let slots = [3, 5];
    let req = [StepRequest {
        kind: RequestKind::Context,
        block_slots: &slots,
        row: dsa_kv::core::RowStamp::UNKNOWN,
        num_cached: 60,
        num_new: 10,
        helix_inactive: false,
    }];
    m.prepare(&layout, &req).unwrap();
    let target = m.bindings();
    let snap = m.prepare_draft(&layout, &req).unwrap();
    let draft = m.bindings();
    m.restore(&snap).unwrap();
    assert_eq!(m.bindings(), target);
    assert_ne!(target, draft);
    (target, draft)
}

#[test]
fn a_launcher_sees_the_whole_target_or_the_whole_draft_set() {
    let (target, draft) = target_and_draft_bindings();
    let epochs = seen();
    let e = epochs.clone();
    loom::model(move || {
        let p = Arc::new(Published::new(target));
        let w = p.clone();
        let replay = thread::spawn(move || {
            w.publish(draft); // prepare_draft
            w.publish(target); // restore
        });
        let mut last_epoch = 0;
        for _ in 0..2 {
            let (b, epoch) = p.load_with_epoch();
            assert!(*b == target || *b == draft, "a mixed set: {b:?}");
            assert!(epoch >= last_epoch, "epochs go forward");
            assert_eq!(*b == draft, epoch == 1, "the draft set is exactly epoch 1");
            record(&e, epoch);
            last_epoch = epoch;
        }
        replay.join().unwrap();
        assert_eq!(*p.load(), target, "restore is exact");
        assert_eq!(p.epoch(), 2);
    });
    assert_eq!(
        distinct(&epochs),
        3,
        "a reader saw the start, the replay and the restore"
    );
}

/// Broken twin: the bindings published field by field (two atomics).
struct TornBindings {
    page_table: AtomicU64,
    slot_mapping: AtomicU64,
}

#[test]
#[should_panic(expected = "a launcher saw a mixed set")]
fn broken_twin_field_by_field_bindings_tear() {
    loom::model(|| {
        // 1 = target set, 2 = draft set, for each field.
        let p = Arc::new(TornBindings {
            page_table: AtomicU64::new(1),
            slot_mapping: AtomicU64::new(1),
        });
        let w = p.clone();
        let replay = thread::spawn(move || {
            w.page_table.store(2, Ordering::SeqCst);
            w.slot_mapping.store(2, Ordering::SeqCst);
            w.page_table.store(1, Ordering::SeqCst);
            w.slot_mapping.store(1, Ordering::SeqCst);
        });
        let a = p.page_table.load(Ordering::SeqCst);
        let b = p.slot_mapping.load(Ordering::SeqCst);
        assert_eq!(a, b, "a launcher saw a mixed set");
        replay.join().unwrap();
    });
}

const SUBMITTED: usize = 0;
const FINISHED: usize = 1;
const IN_FLIGHT: usize = 2;

#[test]
fn counter_snapshots_are_consistent() {
    let snaps = seen();
    let sn = snaps.clone();
    loom::model(move || {
        let c = Arc::new(SeqCounters::<3>::new());
        let w = c.clone();
        let coordinator = thread::spawn(move || {
            w.update(|v| {
                v[SUBMITTED] += 1;
                v[IN_FLIGHT] += 1;
            });
            w.update(|v| {
                v[IN_FLIGHT] -= 1;
                v[FINISHED] += 1;
            });
        });
        let s = c.snapshot();
        assert_eq!(
            s[SUBMITTED],
            s[FINISHED] + s[IN_FLIGHT],
            "torn snapshot {s:?}"
        );
        record(&sn, s);
        coordinator.join().unwrap();
        assert_eq!(c.snapshot(), [1, 1, 0]);
    });
    assert_eq!(
        distinct(&snaps),
        3,
        "snapshots before, between and after the updates"
    );
}

#[test]
#[should_panic(expected = "torn snapshot")]
fn broken_twin_counters_read_one_by_one_tear() {
    loom::model(|| {
        let c: Arc<[AtomicU64; 3]> = Arc::new(std::array::from_fn(|_| AtomicU64::new(0)));
        let w = c.clone();
        let coordinator = thread::spawn(move || {
            w[SUBMITTED].fetch_add(1, Ordering::SeqCst);
            w[IN_FLIGHT].fetch_add(1, Ordering::SeqCst);
            w[IN_FLIGHT].fetch_sub(1, Ordering::SeqCst);
            w[FINISHED].fetch_add(1, Ordering::SeqCst);
        });
        let s: Vec<u64> = c.iter().map(|x| x.load(Ordering::SeqCst)).collect();
        assert_eq!(
            s[SUBMITTED],
            s[FINISHED] + s[IN_FLIGHT],
            "torn snapshot {s:?}"
        );
        coordinator.join().unwrap();
    });
}

/// A quota ledger: the real one or a broken twin.
trait Ledger: Send + Sync + 'static {
    fn try_reserve(&self, what: &str, bytes: u64) -> bool;
    fn used(&self) -> u64;
}

impl Ledger for QuotaLedger {
    fn try_reserve(&self, what: &str, bytes: u64) -> bool {
        QuotaLedger::try_reserve(self, what, bytes).is_ok()
    }
    fn used(&self) -> u64 {
        QuotaLedger::used(self)
    }
}

/// Broken twin: reserves optimistically (add, then take a refused reservation back). It
/// settles right, and two racing reservers never both win, but a reader can see the
/// refused bytes counted in between.
struct AddThenRollBack {
    capacity: u64,
    used: AtomicU64,
}

impl Ledger for AddThenRollBack {
    fn try_reserve(&self, _what: &str, bytes: u64) -> bool {
        let before = self.used.fetch_add(bytes, Ordering::AcqRel);
        if before + bytes > self.capacity {
            self.used.fetch_sub(bytes, Ordering::AcqRel);
            return false;
        }
        true
    }
    fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

/// The ledger as the runtime uses it: one writer (`KvCacheBuilder::start`) reserves the
/// target cache, then a separate draft cache that does not fit (start fails with the
/// quota error), while a handle reads `KvCacheHandle::quota` lock-free on another thread.
/// (The runtime hands out the handle only once `start` returns; letting it read during
/// the reservations checks more than the runtime needs.) The reader must see only whole,
/// accepted reservations: never a refused one, never more than the budget.
fn quota_model<L: Ledger>(ledger: L, observed: &Seen<(u64, u64)>) {
    let q = Arc::new(ledger);
    let q2 = q.clone();
    let handle = thread::spawn(move || (q2.used(), q2.used()));
    assert!(q.try_reserve("the target cache", 60));
    assert!(
        !q.try_reserve("the separate draft cache", 50),
        "110 bytes do not fit in 100"
    );
    let (first, second) = handle.join().unwrap();
    for u in [first, second] {
        assert!(
            u == 0 || u == 60,
            "over-committed: a reader saw {u} of 100 bytes reserved"
        );
    }
    assert!(second >= first, "reservations go forward");
    record(observed, (first, second));
    assert_eq!(q.used(), 60, "a refused reservation changes nothing");
}

#[test]
fn a_quota_reader_never_sees_a_refused_reservation() {
    let observed = seen();
    let o = observed.clone();
    loom::model(move || quota_model(QuotaLedger::new(100), &o));
    assert_eq!(
        distinct(&observed),
        3,
        "the reader ran before, during and after the reservations"
    );
}

#[test]
#[should_panic(expected = "over-committed")]
fn broken_twin_add_then_roll_back_ledger_shows_a_refused_reservation() {
    loom::model(|| {
        let ledger = AddThenRollBack {
            capacity: 100,
            used: AtomicU64::new(0),
        };
        quota_model(ledger, &seen())
    });
}
