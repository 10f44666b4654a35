//! The loader's refusals: configurations and checkpoints it cannot take.

use std::path::{Path, PathBuf};

use super::{CheckpointError, HfConfig};
use crate::{CacheFormat, Model, ModelError};
use dsa_kv_core::config::KvDtype;
use dsa_kv_core::ops::quant::ScaleFormat;

/// An edit of a configuration's JSON.
type Edit = fn(&mut serde_json::Value);

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/deepseek_v32")
}

fn config_with(edit: impl FnOnce(&mut serde_json::Value)) -> Result<HfConfig, CheckpointError> {
    let text = std::fs::read_to_string(fixture().join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut v);
    HfConfig::parse(&v.to_string())
}

fn key_of(e: CheckpointError) -> String {
    match e {
        CheckpointError::Config { key, .. } => key,
        other => panic!("not a configuration error: {other}"),
    }
}

/// What the model cannot take is refused with the key that says so.
#[test]
fn configurations_it_cannot_run_name_their_key() {
    config_with(|_| {}).unwrap();
    let cases: [(&str, Edit); 13] = [
        // A value of the wrong type is named by its key (before: "config.json").
        ("num_hidden_layers", |v| {
            v["num_hidden_layers"] = "three".into()
        }),
        ("rope_parameters.factor", |v| {
            v["rope_parameters"]["factor"] = "large".into()
        }),
        // Past the layers the parser admits: refused before any per-layer list.
        ("num_hidden_layers", |v| {
            v["num_hidden_layers"] = (1u64 << 24).into()
        }),
        ("num_attention_heads", |v| {
            v["num_attention_heads"] = (1u64 << 40).into()
        }),
        ("moe_intermediate_size", |v| {
            v["moe_intermediate_size"] = u64::MAX.into()
        }),
        ("kv_lora_rank", |v| v["kv_lora_rank"] = 256.into()),
        ("index_head_dim", |v| v["index_head_dim"] = 64.into()),
        ("model_type", |v| v["model_type"] = "llama".into()),
        ("q_lora_rank", |v| {
            v["q_lora_rank"] = serde_json::Value::Null
        }),
        // Top 1 group of 2 experts cannot hold 3 experts per token.
        ("n_group", |v| v["num_experts_per_tok"] = 3.into()),
        ("n_group", |v| v["n_group"] = 3.into()),
        ("mlp_layer_types", |v| {
            v["mlp_layer_types"] = serde_json::json!(["dense"])
        }),
        ("rope_parameters.rope_type", |v| {
            v["rope_parameters"]["rope_type"] = "linear".into()
        }),
    ];
    for (key, edit) in cases {
        assert_eq!(key_of(config_with(edit).unwrap_err()), key);
    }
    // The routing keys have no defaults here (transformers' differ by model type).
    for key in [
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
    ] {
        let e = config_with(|v| {
            v.as_object_mut().unwrap().remove(key);
        })
        .unwrap_err();
        assert!(e.to_string().contains(key), "{key}: {e}");
    }
    let e = config_with(|v| {
        let o = v.as_object_mut().unwrap();
        o.remove("mlp_layer_types");
        o.remove("first_k_dense_replace");
    })
    .unwrap_err();
    assert_eq!(key_of(e), "mlp_layer_types");
    let glm = |types: serde_json::Value| {
        config_with(|v| {
            v["model_type"] = "glm_moe_dsa".into();
            v["indexer_types"] = types;
        })
    };
    assert_eq!(
        glm(serde_json::json!(["full", "shared"])).unwrap().indexer,
        [true, false]
    );
    assert_eq!(
        key_of(glm(serde_json::json!(["shared", "full"])).unwrap_err()),
        "indexer_types"
    );
    assert!(matches!(
        HfConfig::parse("{").unwrap_err(),
        CheckpointError::Config { .. }
    ));
}

/// A checkpoint whose tensors do not fit its configuration is refused, naming the
/// tensor; so is a cache whose indexer layers are not the checkpoint's.
#[test]
fn checkpoints_that_do_not_fit_are_refused() {
    let dir = std::env::temp_dir().join(format!("dsa-kv-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture().join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let format = CacheFormat {
        kv_dtype: KvDtype::Bf16,
        scale_format: ScaleFormat::Ue8m0,
        indexer: vec![true, true],
    };
    let load = |edit: fn(&mut serde_json::Value)| {
        let text = std::fs::read_to_string(fixture().join("config.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(&mut v);
        std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
        Model::from_checkpoint(&dir, format.clone())
    };
    let m = load(|_| {}).unwrap();
    // A token past the vocabulary is refused before anything is written.
    let vocab = m.config().vocab as u32;
    let mut kv = crate::unpaged::Contiguous::new(m.format());
    let e = m.run(&mut kv, 0, &[1, vocab, 2]).unwrap_err();
    assert!(
        matches!(e, ModelError::TokenOutOfVocab { token, index: 1, .. } if token == vocab),
        "{e}"
    );
    assert!(m.run(&mut kv, 0, &[1, vocab - 1]).is_ok());
    let tensor = |r: Result<Model, ModelError>| match r {
        Err(ModelError::Checkpoint(CheckpointError::Tensor { name, .. })) => name,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("loaded"),
    };
    // Other widths than the stored tensors'.
    assert_eq!(
        tensor(load(|v| v["hidden_size"] = 32.into())),
        "model.embed_tokens.weight"
    );
    assert_eq!(
        tensor(load(|v| v["q_lora_rank"] = 16.into())),
        "model.layers.0.self_attn.q_a_proj.weight"
    );
    // Attention biases the file does not have.
    assert_eq!(
        tensor(load(|v| v["attention_bias"] = true.into())),
        "model.layers.0.self_attn.q_a_proj.bias"
    );
    // A dense layer where the file has experts: its dense MLP is missing.
    assert_eq!(
        tensor(load(
            |v| v["mlp_layer_types"] = serde_json::json!(["dense", "dense"])
        )),
        "model.layers.1.mlp.gate_proj.weight"
    );
    // An MoE layer where the file has a dense MLP: its router is missing.
    assert_eq!(
        tensor(load(
            |v| v["mlp_layer_types"] = serde_json::json!(["sparse", "sparse"])
        )),
        "model.layers.0.mlp.gate.weight"
    );
    // A cache whose second layer has no indexer.
    let e = Model::from_checkpoint(
        &fixture(),
        CacheFormat {
            indexer: vec![true, false],
            ..format.clone()
        },
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("indexer layers"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    let e = Model::from_checkpoint(Path::new("/nonexistent"), format)
        .err()
        .unwrap();
    assert!(
        matches!(e, ModelError::Checkpoint(CheckpointError::Io { .. })),
        "{e}"
    );
}
