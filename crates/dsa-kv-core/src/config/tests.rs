//! Selection and validation of engine configurations: every rule listed in the `config`
//! module docs (layout selection, incompatibilities) and every config error, with the
//! exact error each gets.

use super::*;
use crate::config::LayoutKind;

fn resolve_toml(text: &str) -> Result<ResolvedConfig, ConfigError> {
    EngineConfig::from_toml_str(text)?.resolve()
}

#[test]
fn defaults_resolve_to_v2_for_dsa_presets() {
    let r = EngineConfig::default().resolve().unwrap();
    assert_eq!(r.layout, LayoutKind::V2);
    assert_eq!(r.model.spec().name, "DeepSeek-V3.2");
    assert_eq!(
        (r.target_layers, r.draft_layers, r.draft_tokens),
        (LayerSet::Target, None, 0)
    );
    assert!(r.warnings.is_empty());
    for preset in ModelPreset::ALL {
        let c = EngineConfig {
            model: ModelConfig {
                preset,
                num_layers: Some(61),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(c.resolve().unwrap().layout, LayoutKind::V2, "{preset}");
    }
}

#[test]
fn explicit_choice_wins_and_auto_without_default_is_v1() {
    let v1 = resolve_toml("[kv_cache]\nuse_kv_cache_manager_v2 = false\n").unwrap();
    assert_eq!(v1.layout, LayoutKind::V1);
    let v2 = resolve_toml("[kv_cache]\nuse_kv_cache_manager_v2 = true\n").unwrap();
    assert_eq!(v2.layout, LayoutKind::V2);
    let auto = resolve_toml("[kv_cache]\nuse_kv_cache_manager_v2 = \"auto\"\n").unwrap();
    assert_eq!(auto.layout, LayoutKind::V2);
    // A model without a V2 default: auto means V1.
    let mut c = EngineConfig::default();
    c.kv_cache.use_kv_cache_manager_v2 = V2Choice::Auto;
    let mut spec = c.model.build().unwrap().spec().clone();
    spec.default_kv_manager_v2 = None;
    let model = DsaModel::new(spec).unwrap();
    assert_eq!(c.resolve_with(model).unwrap().layout, LayoutKind::V1);
    let bad = EngineConfig::from_toml_str("[kv_cache]\nuse_kv_cache_manager_v2 = \"maybe\"\n")
        .unwrap_err();
    assert!(
        bad.to_string().contains("expected auto, true or false"),
        "{bad}"
    );
}

#[test]
fn v2_sparse_incompatibilities_are_one_error_listing_all() {
    let text = "[kv_cache]\nuse_kv_cache_manager_v2 = true\n[scheduler]\nmax_beam_width = 2\nkv_connector = \"lmcache\"\n\
                [parallel]\ncp_mode = \"star\"\ncp_size = 2\ncp_rank = 1\n";
    let err = resolve_toml(text).unwrap_err();
    let ConfigError::Unsupported { incompatible, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(
        incompatible,
        &vec![
            "max_beam_width > 1",
            "kv_connector",
            "STAR context parallelism"
        ]
    );
    let msg = err.to_string();
    assert!(msg.contains("use_kv_cache_manager_v2 = false"), "{msg}");
    assert!(
        msg.contains("cp_mode none or helix instead of star"),
        "{msg}"
    );
    // Each alone, under auto (the DSA default is V2).
    for (extra, item) in [
        ("[scheduler]\nmax_beam_width = 4\n", "max_beam_width > 1"),
        ("[scheduler]\nkv_connector = \"x\"\n", "kv_connector"),
        (
            "[parallel]\ncp_mode = \"star\"\ncp_size = 2\n",
            "STAR context parallelism",
        ),
    ] {
        match resolve_toml(extra) {
            Err(ConfigError::Unsupported { incompatible, .. }) => {
                assert_eq!(incompatible, vec![item])
            }
            other => panic!("{extra}: {other:?}"),
        }
    }
}

#[test]
fn v1_with_star_works_with_the_star_allocation_rule() {
    let r = resolve_toml("[kv_cache]\nuse_kv_cache_manager_v2 = false\n[parallel]\ncp_mode = \"star\"\ncp_size = 4\ncp_rank = 3\n").unwrap();
    assert_eq!(r.layout, LayoutKind::V1);
    // Context on every rank, queries only on the last.
    assert_eq!(star_cached_tokens(1000, 24, 0, 4), 1000);
    assert_eq!(star_cached_tokens(1000, 24, 2, 4), 1000);
    assert_eq!(star_cached_tokens(1000, 24, 3, 4), 1024);
}

#[test]
fn helix_requires_reuse_off() {
    let err = resolve_toml("[parallel]\ncp_mode = \"helix\"\ncp_size = 2\n").unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::Invalid {
                field: "kv_cache.enable_block_reuse",
                ..
            }
        ),
        "{err}"
    );
    let r = resolve_toml("[parallel]\ncp_mode = \"helix\"\ncp_size = 2\ncp_rank = 1\n[kv_cache]\nenable_block_reuse = false\n").unwrap();
    assert_eq!(r.layout, LayoutKind::V2);
    assert!(!r.enable_block_reuse);
}

#[test]
fn dense_model_falls_back_to_v1_with_a_warning() {
    let c = EngineConfig {
        scheduler: SchedulerConfig {
            max_beam_width: 2,
            ..Default::default()
        },
        kv_cache: KvCacheConfig {
            use_kv_cache_manager_v2: V2Choice::Explicit(true),
            ..Default::default()
        },
        ..Default::default()
    };
    // Make the model dense: no layer owns an indexer.
    let mut dense = c.clone();
    dense.model.num_mtp_layers = Some(0);
    let r = resolve_dense(&dense);
    assert_eq!(r.layout, LayoutKind::V1);
    assert_eq!(r.warnings.len(), 1);
    assert!(
        r.warnings[0].contains("falling back to the V1 layout"),
        "{}",
        r.warnings[0]
    );
}

/// Resolves `c` with a model whose indexer mask is all-false (a dense MLA model).
fn resolve_dense(c: &EngineConfig) -> ResolvedConfig {
    // The file schema has no mask field; build the resolution through the public pieces.
    let model = c.model.build().unwrap();
    let mut spec = model.spec().clone();
    spec.indexer_layers = IndexerLayers::Mask(vec![false; spec.num_layers as usize]);
    spec.mtp_has_indexer = false;
    let dense = DsaModel::new(spec).unwrap();
    assert_eq!(dense.num_indexer_layers(), 0);
    c.resolve_with(dense).unwrap()
}

#[test]
fn spec_decode_layer_sets() {
    let r = resolve_toml("[spec_decode]\nmode = \"mtp\"\ndraft_tokens = 3\n").unwrap();
    assert_eq!(
        (r.target_layers, r.draft_layers, r.draft_tokens),
        (LayerSet::Target, Some(LayerSet::MtpOnly), 3)
    );
    let r = resolve_toml(
        "[spec_decode]\nmode = \"mtp\"\ndraft_tokens = 2\nseparate_draft_cache = false\n",
    )
    .unwrap();
    assert_eq!(
        (r.target_layers, r.draft_layers),
        (LayerSet::TargetAndMtp, None)
    );
    let r = resolve_toml(
        "[spec_decode]\nmode = \"eagle3\"\ndraft_tokens = 4\nseparate_draft_cache = false\n",
    )
    .unwrap();
    assert_eq!(
        (r.target_layers, r.draft_layers, r.draft_tokens),
        (LayerSet::Target, None, 4)
    );
}

#[test]
fn every_config_error_names_its_field() {
    let cases: &[(&str, &str)] = &[
        ("[kv_cache]\ntokens_per_block = 32\n", "kv_cache.tokens_per_block"),
        ("[kv_cache]\nfree_gpu_memory_fraction = 1.5\n", "kv_cache.free_gpu_memory_fraction"),
        ("[kv_cache]\nmax_util_for_resume = 0.0\n", "kv_cache.max_util_for_resume"),
        ("[kv_cache]\nmax_tokens = 0\n", "kv_cache.max_tokens"),
        ("[kv_cache]\nmax_gpu_total_bytes = 0\n", "kv_cache.max_gpu_total_bytes"),
        ("[parallel]\ntp_size = 0\n", "parallel.tp_size"),
        ("[parallel]\ncp_size = 0\n", "parallel.cp_size"),
        ("[parallel]\ncp_mode = \"helix\"\ncp_size = 2\ncp_rank = 2\n", "parallel.cp_rank"),
        ("[parallel]\ncp_size = 2\n", "parallel.cp_size"),
        ("[scheduler]\nmax_beam_width = 0\n", "scheduler.max_beam_width"),
        ("[scheduler]\nmax_num_tokens = 0\n", "scheduler.max_num_tokens"),
        ("[scheduler]\nmax_num_sequences = 0\n", "scheduler.max_num_sequences"),
        ("[spec_decode]\ndraft_tokens = 2\n", "spec_decode.draft_tokens"),
        ("[spec_decode]\nmode = \"mtp\"\n", "spec_decode.draft_tokens"),
        ("[spec_decode]\nmode = \"mtp\"\ndraft_tokens = 17\n", "spec_decode.draft_tokens"),
        ("[spec_decode]\nmode = \"eagle3\"\ndraft_tokens = 2\n", "spec_decode.separate_draft_cache"),
        ("[model]\npreset = \"deepseek-v3.2\"\nnum_mtp_layers = 0\n[spec_decode]\nmode = \"mtp\"\ndraft_tokens = 1\n", "spec_decode.mode"),
    ];
    for (text, field) in cases {
        match resolve_toml(text) {
            Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, *field, "{text}"),
            other => panic!("{text}: expected an error on {field}, got {other:?}"),
        }
    }
    // Parse errors: unknown fields and bad types name the field.
    for (text, needle) in [
        ("[kv_cache]\ntokens_per_blok = 64\n", "tokens_per_blok"),
        ("[kv_cache]\nmax_tokens = \"many\"\n", "max_tokens"),
        ("[model]\npreset = \"llama\"\n", "llama"),
        (
            "[model]\npreset = \"deepseek-v3.2\"\nkv_dtype = \"int4\"\n",
            "int4",
        ),
        ("[parallel]\ncp_mode = \"ring\"\n", "ring"),
        ("[nonsense]\n", "nonsense"),
        ("[kv_cache\n", "kv_cache"),
    ] {
        let err = EngineConfig::from_toml_str(text).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }));
        assert!(err.to_string().contains(needle), "{text}: {err}");
    }
    let err = resolve_toml("[model]\npreset = \"mistral-large-3\"\n").unwrap_err();
    assert_eq!(err, ConfigError::Model(ModelError::MissingLayerCount));
    let err =
        EngineConfig::from_json_str("{\"kv_cache\": {\"enable_block_reuse\": 3}}").unwrap_err();
    assert!(err.to_string().contains("invalid type"), "{err}");
}

#[test]
fn files_round_trip() {
    let dir = std::env::temp_dir().join(format!("dsa-kv-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let c = EngineConfig {
        kv_cache: KvCacheConfig {
            max_tokens: Some(100_000),
            host_cache_size: Some(1 << 30),
            use_kv_cache_manager_v2: V2Choice::Explicit(false),
            ..Default::default()
        },
        spec_decode: SpecDecodeConfig {
            mode: SpecMode::Mtp,
            draft_tokens: 3,
            separate_draft_cache: true,
        },
        ..Default::default()
    };
    let toml_path = dir.join("engine.toml");
    std::fs::write(&toml_path, toml::to_string(&c).unwrap()).unwrap();
    assert_eq!(EngineConfig::from_file(&toml_path).unwrap(), c);
    let json_path = dir.join("engine.json");
    std::fs::write(&json_path, serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(EngineConfig::from_file(&json_path).unwrap(), c);
    for ext in ["yaml", "yml"] {
        let yaml_path = dir.join(format!("engine.{ext}"));
        std::fs::write(&yaml_path, serde_yaml_ng::to_string(&c).unwrap()).unwrap();
        assert_eq!(EngineConfig::from_file(&yaml_path).unwrap(), c);
    }
    let yaml = dir.join("bad.yaml");
    std::fs::write(&yaml, "x: 1").unwrap();
    assert_eq!(
        EngineConfig::from_file(&yaml).unwrap_err().to_string(),
        format!(
            "invalid config {}: unknown field `x`, expected one of `model`, `kv_cache`, \
             `parallel`, `spec_decode`, `scheduler`, `transfer`",
            yaml.display()
        )
    );
    let ini = dir.join("engine.ini");
    std::fs::write(&ini, "").unwrap();
    assert_eq!(
        EngineConfig::from_file(&ini).unwrap_err().to_string(),
        format!(
            "invalid config {}: unknown extension \"ini\": use .toml, .json, .yaml or .yml",
            ini.display()
        )
    );
    assert!(matches!(
        EngineConfig::from_file(dir.join("missing.toml")),
        Err(ConfigError::Io { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README's TOML and YAML examples parse to the same configuration.
#[test]
fn readme_config_examples_agree() {
    let readme = include_str!("../../../../README.md");
    // The first block of the language that configures the engine (the README also has
    // a Cargo.toml snippet).
    let block = |lang: &str| {
        let fence = format!("```{lang}\n");
        readme
            .match_indices(&fence)
            .map(|(i, _)| {
                let start = i + fence.len();
                &readme[start..start + readme[start..].find("```").unwrap()]
            })
            .find(|b| b.contains("kv_cache"))
            .unwrap_or_else(|| panic!("a {lang} engine configuration block in the README"))
    };
    let toml = EngineConfig::from_toml_str(block("toml")).unwrap();
    let yaml = EngineConfig::from_yaml_str(block("yaml")).unwrap();
    assert_eq!(toml, yaml);
    assert_eq!(toml.kv_cache.max_tokens, Some(200_000));
}

#[test]
fn the_transfer_lease_is_read_and_bounded() {
    let r = resolve_toml("[transfer]\nlease_ms = 5000\n").unwrap();
    assert_eq!(r.config.transfer.lease_ms, 5000);
    assert_eq!(
        resolve_toml("").unwrap().config.transfer,
        TransferConfig { lease_ms: 30_000 }
    );
    for bad in ["0", "99", "86400001"] {
        let err = resolve_toml(&format!("[transfer]\nlease_ms = {bad}\n")).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("transfer.lease_ms = {bad} is invalid: must be between 100 (0.1 s) and 86400000 (a day)")
        );
    }
}

/// `preset = "deepseek-v4-flash"` / `"deepseek-v4-pro"` reads the same from TOML, JSON
/// and YAML and names the V4 structure (`windowed_spec`); `indexer_dtype` applies to it,
/// the DSA overrides are refused naming the field, and asking a V4 preset for DSA
/// dimensions (`resolve`) is a typed error that says where V4 goes.
#[test]
fn v4_presets_are_read_from_every_format() {
    for (name, want) in [
        ("deepseek-v4-flash", super::V4Spec::flash()),
        ("deepseek-v4-pro", super::V4Spec::pro()),
    ] {
        let toml = format!("[model]\npreset = \"{name}\"\n");
        let json = format!("{{\"model\": {{\"preset\": \"{name}\"}}}}");
        let yaml = format!("model:\n  preset: {name}\n");
        for c in [
            EngineConfig::from_toml_str(&toml).unwrap(),
            EngineConfig::from_json_str(&json).unwrap(),
            EngineConfig::from_yaml_str(&yaml).unwrap(),
        ] {
            assert_eq!(c.model.preset.name(), name);
            assert_eq!(c.model.windowed_spec().unwrap(), Some(want.clone()));
            let e = c.resolve().unwrap_err().to_string();
            assert!(e.contains("is a DeepSeek-V4 model"), "{e}");
            assert!(e.contains("windowed_backend"), "{e}");
        }
    }
    let fp4 = EngineConfig::from_toml_str(
        "[model]\npreset = \"deepseek-v4-flash\"\nindexer_dtype = \"fp4\"\n",
    )
    .unwrap();
    let spec = fp4.model.windowed_spec().unwrap().unwrap();
    assert_eq!(spec.indexer_dtype, IndexerDtype::Fp4);
    let layers =
        EngineConfig::from_toml_str("[model]\npreset = \"deepseek-v4-pro\"\nnum_layers = 3\n")
            .unwrap();
    assert_eq!(
        layers.model.windowed_spec().unwrap_err().to_string(),
        "model.num_layers = set is invalid: deepseek-v4-pro has a fixed layer structure and \
         MODEL1 rows: only model.indexer_dtype applies to it"
    );
    // A DSA preset has no windowed structure.
    assert_eq!(EngineConfig::default().model.windowed_spec().unwrap(), None);
}
