//! loom models of the actor protocols: each actor is a loom thread, each mailbox a
//! channel, `ask` a request plus a reply channel. The state machines inside are the real
//! ones where they exist (`StepMetadata`, `SlotAllocator`, `FenceClock`, and `FenceBoard`
//! as the step's fence value); every model has a broken twin the checker must catch.
//! These models check the protocols, whose replies order the actors' memory; the
//! primitives' own orderings are checked in `loom_sync.rs`.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
//!       cargo test --release --test 'loom_*'`; with `LOOM_LOG=info` and `--nocapture` loom
//! prints each model's interleavings ("Completed in N iterations"), as in `RELIABILITY.md`.
#![cfg(loom)]

use dsa_kv::ids::Fence;
use dsa_kv::layout::IndexerPageLayout;
use dsa_kv::metadata::{
    Bindings, DraftSnapshot, MetadataDims, MetadataError, MetadataLayout, RequestKind,
    StepMetadata, StepRequest,
};
use dsa_kv::sync::FenceBoard;
use loom::cell::UnsafeCell;
use loom::sync::mpsc::{channel, Sender};
use loom::sync::Arc;
use loom::thread;

/// Outcomes observed across interleavings (std, invisible to loom): evidence that the
/// model explored more than one order.
type Seen<T> = std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<T>>>;

struct SlotBytes(UnsafeCell<u64>);

// SAFETY: loom's UnsafeCell checks every access.
unsafe impl Sync for SlotBytes {}

impl SlotBytes {
    fn write(&self, v: u64) {
        self.0.with_mut(|p| unsafe { *p = v });
    }
}

/// How the step handlers in [`step_replies_model`] go wrong (or don't).
#[derive(Clone, Copy, PartialEq, Eq)]
enum StepProtocol {
    /// What the runtime does: a device publishes its fence, then replies
    /// (`DeviceActor`'s `ExecuteStep`); the coordinator waits for every reply
    /// (`join_all`) and completes what the board shows.
    EveryReply,
    /// Broken twin: the coordinator completes the step's fence on the first reply.
    FirstReply,
    /// Broken twin: a device replies before it publishes its fence.
    ReplyBeforeFence,
}

/// One step broadcast to two device actors, as the coordinator's `Step` handler runs it.
/// Each device writes the step's KV into a slot the step releases, publishes the step's
/// fence on the board and replies. The coordinator waits for the replies, completes
/// `done = all_completed().min(target)` and hands the slot to a new owner, who writes it
/// on both devices, only if `done` covers the fence the slot was released behind.
///
/// What orders the devices' writes before the new owner's is the replies: this model
/// passes with a relaxed board too. The board supplies the value (every reply implies the
/// step's fence); its release/acquire is checked where it is the only signal, the
/// released-slot model in `loom_sync.rs`.
fn step_replies_model(protocol: StepProtocol, first_reply: &Seen<usize>) {
    let target = Fence(1);
    let board = Arc::new(FenceBoard::new(2));
    let slot = Arc::new([SlotBytes(UnsafeCell::new(0)), SlotBytes(UnsafeCell::new(0))]);
    let (reply_tx, reply_rx) = channel::<usize>();
    let mut mailboxes = Vec::new();
    let mut devices = Vec::new();
    for d in 0..2 {
        let (tx, rx) = channel::<(Fence, Sender<usize>)>();
        mailboxes.push(tx);
        let (board, slot) = (board.clone(), slot.clone());
        devices.push(thread::spawn(move || {
            let (fence, reply) = rx.recv().unwrap();
            slot[d].write(1); // the step's kernels
            if protocol == StepProtocol::ReplyBeforeFence {
                reply.send(d).unwrap();
                board.complete(d, fence);
            } else {
                board.complete(d, fence);
                reply.send(d).unwrap();
            }
        }));
    }
    for m in &mailboxes {
        m.send((target, reply_tx.clone())).unwrap();
    }
    let first = reply_rx.recv().unwrap();
    first_reply.lock().unwrap().insert(first);
    let done = if protocol == StepProtocol::FirstReply {
        target
    } else {
        reply_rx.recv().unwrap();
        let done = board.all_completed().min(target);
        assert_eq!(done, target, "every reply implies the fence");
        done
    };
    if done >= target {
        // The slot's new owner writes it on both devices.
        slot[0].write(2);
        slot[1].write(2);
    }
    for d in devices {
        d.join().unwrap();
    }
}

#[test]
fn a_step_reuses_its_slots_only_after_every_device_replied() {
    let first = Seen::default();
    let f = first.clone();
    loom::model(move || step_replies_model(StepProtocol::EveryReply, &f));
    assert_eq!(
        first.lock().unwrap().len(),
        2,
        "either device can answer first"
    );
}

#[test]
#[should_panic(expected = "Causality violation")]
fn broken_twin_trusting_the_first_reply_races() {
    loom::model(|| step_replies_model(StepProtocol::FirstReply, &Seen::default()));
}

#[test]
#[should_panic(expected = "every reply implies the fence")]
fn broken_twin_replying_before_the_fence_completes_too_little() {
    loom::model(|| step_replies_model(StepProtocol::ReplyBeforeFence, &Seen::default()));
}

fn layout() -> MetadataLayout {
    MetadataLayout {
        tokens_per_block: 64,
        indexer_page_scale: 1,
        indexer: Some(IndexerPageLayout {
            tokens_per_block: 64,
            data_bytes: 128,
            scale_bytes: 4,
        }),
    }
}

fn dims() -> MetadataDims {
    MetadataDims {
        max_num_sequences: 2,
        max_blocks_per_seq: 4,
        max_num_tokens: 16,
        max_context_kv_tokens: 256,
    }
}

/// The device's mailbox: prepare a step (with the request list), prepare the draft
/// replay, restore.
enum DevMsg {
    Prepare(Vec<(Vec<i32>, u32)>, Sender<Result<(), MetadataError>>),
    DraftPrepare(Sender<Result<DraftSnapshot, MetadataError>>),
    Restore(DraftSnapshot, Sender<Result<(), MetadataError>>),
    Stop(Sender<(Bindings, usize, bool)>),
}

fn reqs(v: &[(Vec<i32>, u32)]) -> Vec<StepRequest<'_>> {
    v.iter()
        .map(|(slots, cached)| StepRequest {
            kind: RequestKind::Generation,
            block_slots: slots,
            row: dsa_kv::core::RowStamp::UNKNOWN,
            num_cached: *cached,
            num_new: 1,
            helix_inactive: false,
        })
        .collect()
}

/// A device actor: its mailbox drives the real `StepMetadata`.
fn device(rx: loom::sync::mpsc::Receiver<DevMsg>) {
    let mut m = StepMetadata::new(layout(), dims(), Some(dims()), true).unwrap();
    let mut last = Vec::new();
    while let Ok(msg) = rx.recv() {
        match msg {
            DevMsg::Prepare(v, reply) => {
                let r = m.prepare(&layout(), &reqs(&v)).map(|_| ());
                if r.is_ok() {
                    last = v;
                }
                reply.send(r).unwrap();
            }
            DevMsg::DraftPrepare(reply) => {
                reply
                    .send(m.prepare_draft(&layout(), &reqs(&last)))
                    .unwrap();
            }
            DevMsg::Restore(snap, reply) => reply.send(m.restore(&snap)).unwrap(),
            DevMsg::Stop(reply) => {
                let n = m.counts().num_requests;
                reply.send((m.bindings(), n, m.in_draft_replay())).unwrap();
                return;
            }
        }
    }
}

/// The target bindings (the same buffers whatever the step holds).
fn target_bindings() -> Bindings {
    let mut m = StepMetadata::new(layout(), dims(), Some(dims()), true).unwrap();
    m.prepare(&layout(), &reqs(&[(vec![3], 10)])).unwrap();
    m.bindings()
}

/// Step 1 runs two requests; the draft-replay actor snapshots, replays and restores,
/// while the coordinator preempts request 2 (frees it) and prepares step 2 with request 1
/// alone. The device refuses a prepare while a replay holds the bindings, so the
/// coordinator must look at the reply and retry (`retry` = false is the broken twin: a
/// fire-and-forget prepare). At the end the device must be out of the replay, bound to
/// the target set, with step 2 (one request) prepared.
fn draft_vs_preemption_model(retry: bool, refused: &Seen<bool>) {
    let target = target_bindings();
    let (tx, rx) = channel::<DevMsg>();
    let dev = thread::spawn(move || device(rx));
    let (r_tx, r_rx) = channel();
    tx.send(DevMsg::Prepare(vec![(vec![3], 10), (vec![7], 20)], r_tx))
        .unwrap();
    r_rx.recv().unwrap().unwrap();

    let dtx = tx.clone();
    let draft = thread::spawn(move || {
        let (s_tx, s_rx) = channel();
        dtx.send(DevMsg::DraftPrepare(s_tx)).unwrap();
        if let Ok(snap) = s_rx.recv().unwrap() {
            let (r_tx, r_rx) = channel();
            dtx.send(DevMsg::Restore(snap, r_tx)).unwrap();
            r_rx.recv().unwrap().unwrap();
        }
    });
    let ctx = tx.clone();
    let coordinator = thread::spawn(move || {
        let mut was_refused = false;
        loop {
            let (r_tx, r_rx) = channel();
            ctx.send(DevMsg::Prepare(vec![(vec![3], 11)], r_tx))
                .unwrap();
            match r_rx.recv().unwrap() {
                Ok(()) => break,
                Err(MetadataError::ReplayActive) if retry => {
                    was_refused = true;
                    thread::yield_now()
                }
                Err(MetadataError::ReplayActive) => break, // broken: assumes it landed
                Err(e) => panic!("unexpected refusal: {e}"),
            }
        }
        was_refused
    });
    draft.join().unwrap();
    refused.lock().unwrap().insert(coordinator.join().unwrap());
    let (s_tx, s_rx) = channel();
    tx.send(DevMsg::Stop(s_tx)).unwrap();
    let (bindings, requests, in_replay) = s_rx.recv().unwrap();
    dev.join().unwrap();
    assert!(!in_replay, "the replay was restored");
    assert_eq!(bindings, target, "bound to the target set");
    assert_eq!(
        requests, 1,
        "step 2 (request 2 preempted) is what is prepared"
    );
}

#[test]
fn draft_replay_racing_a_preemption_restores_exactly() {
    let refused = Seen::default();
    let r = refused.clone();
    loom::model(move || draft_vs_preemption_model(true, &r));
    assert_eq!(
        refused.lock().unwrap().len(),
        2,
        "the prepare landed both during and outside the replay"
    );
}

#[test]
#[should_panic(expected = "step 2 (request 2 preempted) is what is prepared")]
fn broken_twin_fire_and_forget_prepare_is_lost() {
    loom::model(|| draft_vs_preemption_model(false, &Seen::default()));
}

/// How the coordinator treats the draft replay's fence in [`free_during_snapshot_model`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum DraftFence {
    /// The step handler waits for the draft actor's reply (what the runtime does).
    AwaitReply,
    /// Fire-and-forget replay, but a slot granted with `wait_for` waits for the reply
    /// before its new owner writes it (the fence alone is enough).
    FenceOnly,
    /// Broken twin: fire-and-forget, and the fence counted complete when issued.
    CompleteAtIssue,
}

/// The coordinator's mailbox in [`free_during_snapshot_model`].
enum CoordMsg {
    /// Schedule a step with a draft replay; the reply carries the step's fence.
    Step(Sender<Fence>),
    /// Commit the step: every draft rejected, so the draft's block is rolled back.
    Commit,
    /// Free request B (a client cancelled it).
    Free,
}

/// "Free while a snapshot is in flight", and "accept/rollback racing the replay", with
/// the real `SlotAllocator` and `FenceClock`. Requests A (slot 0) and B (slot 1) run; a
/// step gives A's draft a block (slot 2) and sends the draft-replay actor a snapshot of
/// the live slots, which it writes. Meanwhile a client frees B and the engine commits
/// with every draft rejected; each freed slot goes to a new owner at once, who writes
/// it. The replay's late write must never land in a slot that has a new owner.
fn free_during_snapshot_model(mode: DraftFence, order: &Seen<(bool, bool)>) {
    use dsa_kv::core::{FenceClock, SlotAllocator};
    use dsa_kv::ids::SlotId;
    let slots = Arc::new([
        SlotBytes(UnsafeCell::new(0)),
        SlotBytes(UnsafeCell::new(0)),
        SlotBytes(UnsafeCell::new(0)),
    ]);
    let (coord_tx, coord_rx) = channel::<CoordMsg>();
    let (draft_tx, draft_rx) = channel::<Vec<SlotId>>();
    let (draft_reply_tx, draft_reply_rx) = channel::<()>();
    let draft = {
        let slots = slots.clone();
        thread::spawn(move || {
            let snapshot = draft_rx.recv().unwrap();
            for s in snapshot {
                slots[s.index()].write(100 + u64::from(s.get())); // the replay's KV
            }
            draft_reply_tx.send(()).unwrap();
        })
    };
    let engine = {
        let tx = coord_tx.clone();
        thread::spawn(move || {
            let (f_tx, f_rx) = channel();
            tx.send(CoordMsg::Step(f_tx)).unwrap();
            f_rx.recv().unwrap();
            tx.send(CoordMsg::Commit).unwrap();
        })
    };
    let client = thread::spawn(move || coord_tx.send(CoordMsg::Free).unwrap());

    // The coordinator (this thread).
    let mut alloc = SlotAllocator::new(3);
    let mut clock = FenceClock::new();
    let a = alloc.allocate(clock.completed()).unwrap().slot;
    let b = alloc.allocate(clock.completed()).unwrap().slot;
    let mut b_live = true;
    let mut a_draft = None;
    let mut reply_pending = false;
    let mut owners = Vec::new(); // (slot, value) written by new owners
    let (mut freed_before_step, mut stepped) = (false, false);
    for _ in 0..3 {
        match coord_rx.recv().unwrap() {
            CoordMsg::Step(reply) => {
                stepped = true;
                let f = clock.issue();
                let d = alloc.allocate(clock.completed()).unwrap();
                assert_eq!(d.wait_for, None, "a fresh slot for the draft");
                a_draft = Some(d.slot);
                let mut snapshot = vec![a, d.slot];
                if b_live {
                    snapshot.push(b);
                }
                // New owners join from the next step on: the snapshot is A, A's draft
                // block and B while B lives.
                draft_tx.send(snapshot).unwrap();
                match mode {
                    DraftFence::AwaitReply => {
                        draft_reply_rx.recv().unwrap();
                        clock.complete_up_to(f).unwrap();
                    }
                    DraftFence::FenceOnly => reply_pending = true,
                    DraftFence::CompleteAtIssue => clock.complete_up_to(f).unwrap(),
                }
                reply.send(f).unwrap();
            }
            msg @ (CoordMsg::Free | CoordMsg::Commit) => {
                let released = match msg {
                    CoordMsg::Free => {
                        freed_before_step = !stepped;
                        b_live = false;
                        b
                    }
                    _ => a_draft.take().expect("a commit follows its step"),
                };
                // Released with the last fence that may still touch it.
                alloc.release(released, clock.issued()).unwrap();
                let grant = alloc.allocate(clock.completed()).unwrap();
                if let Some(f) = grant.wait_for {
                    if !clock.is_complete(f) {
                        // The new owner's stream waits for the replay's fence.
                        assert!(reply_pending, "only the replay can hold a fence");
                        draft_reply_rx.recv().unwrap();
                        reply_pending = false;
                        clock.complete_up_to(f).unwrap();
                    }
                }
                let value = 200 + owners.len() as u64;
                slots[grant.slot.index()].write(value);
                owners.push((grant.slot, value));
            }
        }
        alloc.check_invariants();
    }
    engine.join().unwrap();
    client.join().unwrap();
    draft.join().unwrap();
    order
        .lock()
        .unwrap()
        .insert((freed_before_step, reply_pending));
    if mode != DraftFence::CompleteAtIssue {
        for (s, v) in owners {
            slots[s.index()]
                .0
                .with(|p| assert_eq!(unsafe { *p }, v, "slot {s}: the new owner's bytes survive"));
        }
    }
}

#[test]
fn a_slot_freed_while_a_snapshot_is_in_flight_is_not_overwritten() {
    for mode in [DraftFence::AwaitReply, DraftFence::FenceOnly] {
        let order = Seen::default();
        let o = order.clone();
        loom::model(move || free_during_snapshot_model(mode, &o));
        let seen = order.lock().unwrap();
        assert!(
            seen.iter().any(|o| o.0) && seen.iter().any(|o| !o.0),
            "the free landed both before and after the step: {seen:?}"
        );
    }
}

#[test]
#[should_panic(expected = "Causality violation")]
fn broken_twin_fence_complete_at_issue_overwrites_a_new_owner() {
    loom::model(|| free_during_snapshot_model(DraftFence::CompleteAtIssue, &Seen::default()));
}
