//! `plan --model deepseek-v4-flash|deepseek-v4-pro`: the DeepSeek-V4 pool plan (four
//! life cycles, their pools and page sizes), the bytes a block and a decoding request
//! cost, and the budget split into window slots and blocks (`WindowedCapacityPlan`, the
//! computation the runtime sizes its pools with).

use dsa_kv::config::{V4Preset, V4Spec};
use dsa_kv::core::quota::{v4_window_slots, WindowedCapacityPlan};
use dsa_kv::layout::{Retention, V4LifeCycle, V4PageFormat, V4Plan};
use serde_json::json;

use super::{group_digits, GIB};

/// The configuration's V4 plan, as `plan` prints it.
pub(super) struct V4Args {
    pub preset: V4Preset,
    pub spec: V4Spec,
    pub capacity: WindowedCapacityPlan,
    pub budget_source: String,
    pub json: bool,
}

fn retention(r: Retention) -> String {
    match r {
        Retention::Full => "every block".into(),
        Retention::Window { tokens } => format!("last {tokens} positions"),
    }
}

fn format_of(f: &V4PageFormat) -> String {
    match f {
        V4PageFormat::Model1 {
            page,
            tokens_per_entry,
        } if *tokens_per_entry == 1 => {
            format!("MODEL1 page of {} rows, one per token", page.entries)
        }
        V4PageFormat::Model1 {
            page,
            tokens_per_entry,
        } => format!(
            "MODEL1 page of {} rows, one per {} tokens",
            page.entries, tokens_per_entry
        ),
        V4PageFormat::IndexKeys {
            page,
            tokens_per_entry,
        } => format!(
            "indexer page of {} keys ({} + {} B), one per {} tokens",
            page.tokens_per_block, page.data_bytes, page.scale_bytes, tokens_per_entry
        ),
        V4PageFormat::State { row_bytes, tokens } => {
            format!("{tokens} fp32 state rows of {row_bytes} B")
        }
    }
}

/// The pools of one life cycle: (pool id, slot bytes, buffers, role, page bytes, format).
fn pools_of(plan: &V4Plan, lc: &V4LifeCycle) -> Vec<serde_json::Value> {
    lc.pools
        .iter()
        .map(|p| {
            let bufs: Vec<_> = plan
                .buffers()
                .iter()
                .filter(|b| b.life_cycle == lc.id && b.pool == p.id)
                .collect();
            let roles: std::collections::BTreeSet<String> =
                bufs.iter().map(|b| b.role.to_string()).collect();
            json!({
                "id": p.id.get(),
                "slot_bytes": p.slot_bytes(),
                "page_bytes": p.page_bytes,
                "pages_per_slot": p.pages_per_slot,
                "roles": roles,
                "format": bufs.first().map(|b| format_of(&b.format)),
            })
        })
        .collect()
}

pub(super) fn run(a: V4Args) -> Result<(), String> {
    let spec = &a.spec;
    let plan = &a.capacity.plan;
    let capacity = &a.capacity.capacity;
    let budget = a.capacity.gpu.bytes;
    let (window_only, c4, c128) = spec.layer_counts();
    let block = plan.bytes_per_block();
    let drafts = a.capacity.demand.drafts;
    let per_request = plan.window_bytes_per_request(drafts, 1);
    let life_cycles: Vec<_> = plan
        .life_cycles()
        .iter()
        .map(|lc| {
            json!({
                "id": lc.id.get(),
                "kind": lc.kind.name(),
                "retention": lc.retention,
                "tokens_per_page": lc.tokens_per_page,
                "slot_bytes": lc.slot_bytes(),
                "tail_pages": lc.tail_pages(),
                "pages_per_decoding_request": lc.window_pages(drafts, 1),
                "slots": capacity.slots[lc.id.index()],
                "allocated_bytes": capacity.bytes[lc.id.index()],
                "pools": pools_of(plan, lc),
            })
        })
        .collect();
    let report = json!({
        "model": spec.name,
        "preset": a.preset.name(),
        "num_layers": spec.compress_ratios.len(),
        "window_only_layers": window_only,
        "ratio4_layers": c4,
        "ratio128_layers": c128,
        "mtp_layers": spec.num_mtp_layers,
        "window": spec.window,
        "indexer_dtype": spec.indexer_dtype.name(),
        "tokens_per_block": plan.tokens_per_block(),
        "bytes_per_block": block,
        "bytes_per_token": block as f64 / f64::from(plan.tokens_per_block()),
        "drafts": drafts,
        "window_bytes_per_request": per_request,
        "tail_bytes_per_boundary": plan.tail_bytes(),
        "life_cycles": life_cycles,
        "demand": a.capacity.demand,
        "budget_bytes": budget,
        "budget_source": a.budget_source,
        "allocated_bytes": capacity.allocated_bytes,
        "blocks": capacity.blocks,
        "tokens_that_fit": capacity.tokens,
    });
    if a.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "{} ({} target layers: {} window-only, {} ratio-4, {} ratio-128; {} MTP) | window {} | \
         indexer {} | MODEL1 rows (584 B) | {}-token blocks",
        spec.name,
        spec.compress_ratios.len(),
        window_only,
        c4,
        c128,
        spec.num_mtp_layers,
        spec.window,
        spec.indexer_dtype,
        plan.tokens_per_block()
    );
    println!();
    println!("life cycles (each its own slot space):");
    for lc in plan.life_cycles() {
        println!(
            "  {} {:<11} keeps {:<19} {:>4} tokens/slot {:>12} B/slot, tail {} page(s)",
            lc.id,
            lc.kind.name(),
            retention(lc.retention),
            lc.tokens_per_page,
            group_digits(lc.slot_bytes()),
            lc.tail_pages()
        );
        for p in pools_of(plan, lc) {
            println!(
                "      pool {}: {} B per slot = {} × {} B ({}; {})",
                p["id"],
                group_digits(p["slot_bytes"].as_u64().unwrap_or(0)),
                p["pages_per_slot"],
                group_digits(p["page_bytes"].as_u64().unwrap_or(0)),
                p["roles"]
                    .as_array()
                    .map(|r| r
                        .iter()
                        .filter_map(|x| x.as_str())
                        .collect::<Vec<_>>()
                        .join(", "))
                    .unwrap_or_default(),
                p["format"].as_str().unwrap_or("")
            );
        }
    }
    println!();
    println!(
        "kept per 256-token block: {} B ({} B/token)",
        group_digits(block),
        block as f64 / f64::from(plan.tokens_per_block())
    );
    println!(
        "held by a decoding request ({drafts} draft(s), 1 token/step): {} B of windows and \
         compressor state",
        group_digits(per_request)
    );
    for lc in plan.life_cycles() {
        if let Some(pages) = lc.window_pages(drafts, 1) {
            println!(
                "  {:<11} {pages} slot(s) × {} B = {} B",
                lc.kind.name(),
                group_digits(lc.slot_bytes()),
                group_digits(pages * lc.slot_bytes())
            );
        }
    }
    println!(
        "kept per retained block boundary (its tails): {} B",
        group_digits(plan.tail_bytes())
    );
    println!();
    let d = &a.capacity.demand;
    println!(
        "capacity: {} = {:.2} GiB budget; windows sized for {} sequences, {} positions/step, \
         {} retained boundaries:",
        a.budget_source,
        budget as f64 / GIB,
        d.max_sequences,
        d.max_batched_tokens,
        d.tail_boundaries
    );
    for lc in plan.life_cycles() {
        let how = match v4_window_slots(lc, d) {
            Some(_) => "window",
            None => "the rest",
        };
        println!(
            "  {:<11} {:>12} slots {:>8.2} GiB ({how})",
            lc.kind.name(),
            group_digits(capacity.slots[lc.id.index()]),
            capacity.bytes[lc.id.index()] as f64 / GIB
        );
    }
    println!(
        "  → {} blocks = {} tokens ({:.2} GiB allocated in 2 MiB chunks)",
        group_digits(capacity.blocks),
        group_digits(capacity.tokens),
        capacity.allocated_bytes as f64 / GIB
    );
    Ok(())
}
