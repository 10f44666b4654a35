use super::*;
use dsa_kv_core::ops::model1::MODEL1_NOPE;

fn prompt(n: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 37 + 11) % 256).collect()
}

fn model(cfg: V4ModelConfig) -> V4Model {
    V4Model::new(cfg).unwrap()
}

/// Chunking a prompt (splits inside 4-groups, across a 128-group and a 256-token
/// block) gives the bits of one pass: batch invariance.
#[test]
fn chunks_give_the_bits_of_one_pass() {
    let m = model(V4ModelConfig::tiny(3));
    let p = prompt(400);
    let whole = m.run(&mut V4Contiguous::new(), 0, &p).unwrap();
    for split in [[1, 130], [127, 258], [255, 399]] {
        let mut kv = V4Contiguous::new();
        let mut outs = m.run(&mut kv, 0, &p[..split[0]]).unwrap();
        outs.extend(
            m.run(&mut kv, split[0] as u32, &p[split[0]..split[1]])
                .unwrap(),
        );
        outs.extend(m.run(&mut kv, split[1] as u32, &p[split[1]..]).unwrap());
        assert_eq!(outs, whole, "split at {split:?}");
    }
}

/// Each part of the cache reaches the logits: past 4·64 tokens the indexer selects
/// (a top-k wider than every visible entry changes the output), the window bounds what
/// is read (a wider window changes the output), and the compressed entries are read
/// (a corrupted state row changes every later output through its entry).
#[test]
fn the_indexer_the_window_and_the_entries_are_exercised() {
    let p = prompt(400);
    let base = model(V4ModelConfig::tiny(3))
        .run(&mut V4Contiguous::new(), 0, &p)
        .unwrap();
    let dense = model(V4ModelConfig {
        topk: 128,
        ..V4ModelConfig::tiny(3)
    })
    .run(&mut V4Contiguous::new(), 0, &p)
    .unwrap();
    // Up to 4·64 − 1 every entry is selected either way.
    assert_eq!(dense[..259], base[..259]);
    assert_ne!(dense[399], base[399], "the top-k selection is exercised");
    let wide = model(V4ModelConfig {
        window: 256,
        ..V4ModelConfig::tiny(3)
    })
    .run(&mut V4Contiguous::new(), 0, &p)
    .unwrap();
    assert_eq!(
        wide[..128],
        base[..128],
        "short contexts see all of either window"
    );
    assert_ne!(wide[399], base[399]);
    // A state row of the ratio-128 layer's first group, altered before the group
    // closes: the entry changes, and with it the output at the group's last token.
    let m = model(V4ModelConfig::tiny(3));
    let mut kv = V4Contiguous::new();
    let mut outs = m.run(&mut kv, 0, &p[..100]).unwrap();
    let mut row = kv.state(2, StateKind::Kv, 5).unwrap();
    row[0] += 1.0;
    row[LATENT_SCORES] += 3.0;
    kv.write_state(2, StateKind::Kv, 5, &row).unwrap();
    outs.extend(m.run(&mut kv, 100, &p[100..]).unwrap());
    assert_eq!(outs[..127], base[..127]);
    assert_ne!(outs[127], base[127], "entry 0 is read at position 127");
}

/// The score half of a ratio-128 state row starts after its 512 kv values.
const LATENT_SCORES: usize = crate::LATENT;

/// The MTP layer's proposals do not depend on how its window was written (one pass
/// or token by token), and a model without one refuses to draft.
#[test]
fn proposals_are_deterministic_and_need_the_mtp_layer() {
    let m = model(V4ModelConfig::tiny(5));
    let p = prompt(200);
    let mut a = V4Contiguous::new();
    let (_, hidden) = m.run_hidden(&mut a, 0, &p).unwrap();
    m.draft_write(&mut a, 0, &p, &hidden).unwrap();
    let mut b = V4Contiguous::new();
    m.run(&mut b, 0, &p).unwrap();
    for (i, &t) in p.iter().enumerate() {
        m.draft_write(&mut b, i as u32, &[t], &[]).unwrap();
    }
    let pa = m.propose(&a, 150, &hidden[150], p[151], 3).unwrap();
    assert_eq!(pa, m.propose(&b, 150, &hidden[150], p[151], 3).unwrap());
    assert_eq!(pa.len(), 3);
    let no_mtp = model(V4ModelConfig {
        mtp: false,
        ..V4ModelConfig::tiny(5)
    });
    let e = no_mtp
        .propose(&a, 150, &hidden[150], p[151], 3)
        .unwrap_err();
    assert!(e.to_string().contains("no MTP layer"), "{e}");
}

/// Configurations the cache cannot hold are typed errors.
#[test]
fn bad_configs_are_refused() {
    let e = |cfg| V4Model::new(cfg).err().unwrap().to_string();
    let t = V4ModelConfig::tiny(1);
    assert!(e(V4ModelConfig {
        ratios: vec![0, 3],
        ..t.clone()
    })
    .contains("ratio 0, 4 or 128"));
    assert!(e(V4ModelConfig {
        topk: 100,
        ..t.clone()
    })
    .contains("multiple of 64"));
    assert!(e(V4ModelConfig { heads: 0, ..t }).contains("at least 1"));
    // The RoPE part of a row is its last 64 values.
    assert_eq!(MODEL1_NOPE + crate::ROPE, crate::LATENT);
}

/// A traced run gives the untraced bits; a trace holds what the sparse decode is handed
/// (128 window rows, the selected or visible entries) and one query and output per head.
#[test]
fn traces_change_nothing_and_hold_the_kernel_inputs() {
    let m = model(V4ModelConfig::tiny(3));
    let p = prompt(400);
    let plain = m.run(&mut V4Contiguous::new(), 0, &p).unwrap();
    let points = [(1, 399), (2, 399), (0, 5), (2, 1000)];
    let (outs, traces) = m
        .run_traced(&mut V4Contiguous::new(), 0, &p, &points)
        .unwrap();
    assert_eq!(outs, plain);
    assert_eq!(traces.len(), 3, "a point past the run is ignored");
    let (t0, t1, t2) = (&traces[0], &traces[1], &traces[2]);
    assert_eq!((t0.layer, t0.pos, t0.window.len()), (0, 5, 6));
    assert!(t0.entries.is_empty());
    assert_eq!((t1.layer, t1.window.len(), t1.entries.len()), (1, 128, 64));
    assert_eq!(t2.entries, vec![0, 1, 2]);
    assert_eq!((t2.q.len(), t2.out.len(), t2.sink.len()), (2, 2, 2));
    assert!(t2.q[0]
        .iter()
        .all(|&v| half::bf16::from_f32(v).to_f32() == v));
    assert_eq!(t2.softmax_scale, 1.0 / 512f32.sqrt());
}
