//! The model directory Dynamo's frontend reads: a tokenizer for the reference model's
//! 256-token vocabulary, its `config.json` and a chat template, written by code (no hub
//! access).
//!
//! The frontend tokenizes prompts, applies the chat template and turns the worker's token
//! ids back into text; the worker sees token ids only. The tokenizer is a BPE model with
//! no merges, so every character is one token:
//! * ids 0–255 (the model's vocabulary) are 256 distinct non-whitespace characters, so
//!   every token the model can produce decodes to visible text (a load generator rejects
//!   an empty answer);
//! * a normalizer writes a space as `␣`, a newline as `⏎` and a tab as `⇥` (three of those
//!   256), so any ASCII prompt encodes into the vocabulary and decodes back with the three
//!   marks in place of the whitespace;
//! * any other character encodes as `?` (the unknown token, in the vocabulary);
//! * id 256 is `<|eos|>`, a special token the model cannot produce: the end-of-sequence
//!   id the frontend sends with each request. A request stops on it only when it is in
//!   the model's vocabulary, which it is not here; requests end at `max_tokens`.
//!
//! The frontend trusts what it reads there (the chat template is a program it runs), so
//! the directory must be private: [`write`] creates it `0700` and refuses one that is a
//! symbolic link, that another user owns or that its group or others may write; each file
//! is written under a random name of its own (created exclusively) and renamed into
//! place. The default, [`default_dir`], is one per user.

use std::fs::{DirBuilder, Permissions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

/// Token ids of the reference model (`ModelConfig::tiny`'s vocabulary).
pub const MODEL_VOCAB: u32 = 256;
/// The end-of-sequence token: outside the model's vocabulary.
pub const EOS_ID: u32 = MODEL_VOCAB;
/// Its text.
pub const EOS_TEXT: &str = "<|eos|>";
/// What a space, a newline and a tab become.
pub const WHITESPACE_MARKS: [(char, char); 3] = [(' ', '␣'), ('\n', '⏎'), ('\t', '⇥')];
/// Characters outside the vocabulary encode as this one.
pub const UNKNOWN: char = '?';
/// The chat template: one `role: content` line per message, then `assistant: `.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ message['role'] }}: \
{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";

/// The character of each model token, by id: printable ASCII without the space (94),
/// the three whitespace marks, Latin-1's printable letters and signs without the soft
/// hyphen (94), then Greek capitals (24), Greek small letters (25) and the first 16
/// Cyrillic capitals: 256 in all.
pub fn vocabulary() -> Vec<char> {
    let mut v: Vec<char> = ('!'..='~').collect();
    v.extend(WHITESPACE_MARKS.iter().map(|&(_, m)| m));
    v.extend(('\u{a1}'..='\u{ff}').filter(|&c| c != '\u{ad}'));
    v.extend(('\u{391}'..='\u{3a9}').filter(|&c| c != '\u{3a2}'));
    v.extend('\u{3b1}'..='\u{3c9}');
    v.extend('\u{410}'..='\u{41f}');
    v
}

/// `tokenizer.json` (the Hugging Face `tokenizers` format).
pub fn tokenizer_json() -> Value {
    let mut vocab = Map::new();
    for (id, c) in vocabulary().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(id));
    }
    vocab.insert(EOS_TEXT.into(), json!(EOS_ID));
    let normalizers: Vec<Value> = WHITESPACE_MARKS
        .iter()
        .map(|&(from, to)| {
            json!({"type": "Replace", "pattern": {"String": from.to_string()}, "content": to.to_string()})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": EOS_ID, "content": EOS_TEXT, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": UNKNOWN.to_string(),
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    })
}

/// `config.json`: what the frontend reads of a model (its vocabulary, end-of-sequence
/// id and context length).
pub fn config_json(context_length: u32) -> Value {
    json!({
        "architectures": ["DsaKvReferenceForCausalLM"],
        "model_type": "dsa_kv_reference",
        "vocab_size": MODEL_VOCAB + 1,
        "eos_token_id": EOS_ID,
        "max_position_embeddings": context_length,
        "torch_dtype": "bfloat16"
    })
}

/// `tokenizer_config.json`: the chat template and the special tokens.
pub fn tokenizer_config_json(context_length: u32) -> Value {
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": EOS_TEXT,
        "unk_token": UNKNOWN.to_string(),
        "bos_token": null,
        "pad_token": null,
        "add_bos_token": false,
        "add_eos_token": false,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": false
    })
}

/// Why the model directory was not written.
#[derive(Debug, thiserror::Error)]
pub enum ModelDirError {
    /// The path is a symbolic link.
    #[error(
        "the model directory {0} is a symbolic link: give the directory itself (a link can \
         be pointed elsewhere after it is checked)"
    )]
    Symlink(PathBuf),
    /// The path is not a directory.
    #[error("the model directory {0} exists and is not a directory: give another --model-dir")]
    NotADirectory(PathBuf),
    /// Another user owns the directory.
    #[error(
        "the model directory {path} is owned by uid {owner}, not by this user (uid {uid}): \
         that user could change what the frontend reads; give a directory of your own \
         (--model-dir)"
    )]
    NotOurs {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// This process's effective user id.
        uid: u32,
    },
    /// The directory's group or others may write it.
    #[error(
        "the model directory {path} is writable by its group or others (mode {mode:o}): \
         anyone could replace the tokenizer or the chat template the frontend reads; \
         `chmod go-w` it or give another --model-dir"
    )]
    Writable {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A file-system call failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// To which path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// The model directory when none is given: `dsa-kv-dynamo-model-<uid>` in the temporary
/// directory (`$TMPDIR`, else `/tmp`), one per user, so no other user's worker shares
/// it ([`write`] creates it private).
pub fn default_dir() -> PathBuf {
    std::env::temp_dir().join(format!("dsa-kv-dynamo-model-{}", effective_uid()))
}

fn effective_uid() -> u32 {
    // SAFETY: `geteuid` takes nothing, touches no memory of ours and cannot fail.
    unsafe { libc::geteuid() }
}

/// Creates `dir` (`0700`, its missing parents as the umask says) unless it exists, and
/// checks that it is a directory of this user's that nobody else may write, not a link.
fn private_dir(dir: &Path) -> Result<(), ModelDirError> {
    let io = |what, source| ModelDirError::Io {
        what,
        path: dir.to_path_buf(),
        source,
    };
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| io("creating the parents of", e))?;
    }
    match DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(io("creating", e));
        }
        // Created, or there already (made by anyone): checked the same way.
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| io("reading", e))?;
    let path = dir.to_path_buf();
    if meta.file_type().is_symlink() {
        return Err(ModelDirError::Symlink(path));
    }
    if !meta.is_dir() {
        return Err(ModelDirError::NotADirectory(path));
    }
    let uid = effective_uid();
    if meta.uid() != uid {
        return Err(ModelDirError::NotOurs {
            path,
            owner: meta.uid(),
            uid,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(ModelDirError::Writable { path, mode });
    }
    Ok(())
}

/// Writes `tokenizer.json`, `tokenizer_config.json` and `config.json` into `dir`
/// (created `0700` if missing; refused if it is a link, another user's, or writable by
/// its group or others). Each file is written under a random name of its own, created
/// exclusively, and renamed into place, so workers sharing the directory never expose a
/// half-written file and nothing planted under a guessed name is written through.
pub fn write(dir: &Path, context_length: u32) -> Result<(), ModelDirError> {
    private_dir(dir)?;
    for (name, value) in [
        ("tokenizer.json", tokenizer_json()),
        (
            "tokenizer_config.json",
            tokenizer_config_json(context_length),
        ),
        ("config.json", config_json(context_length)),
    ] {
        let path = dir.join(name);
        let io = |what, source| ModelDirError::Io {
            what,
            path: path.clone(),
            source,
        };
        let text = serde_json::to_string_pretty(&value).expect("invariant: a JSON value prints");
        // Readable as the files were before (the directory decides who may reach them).
        let mut part = tempfile::Builder::new()
            .prefix(&format!(".{name}."))
            .permissions(Permissions::from_mode(0o644))
            .tempfile_in(dir)
            .map_err(|e| io("creating a temporary file for", e))?;
        part.write_all((text + "\n").as_bytes())
            .map_err(|e| io("writing", e))?;
        part.persist(&path)
            .map_err(|e| io("renaming into place", e.error))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vocabulary_is_256_distinct_visible_characters() {
        let v = vocabulary();
        assert_eq!(v.len(), MODEL_VOCAB as usize);
        let distinct: std::collections::BTreeSet<char> = v.iter().copied().collect();
        assert_eq!(distinct.len(), v.len());
        for c in &v {
            assert!(!c.is_whitespace() && !c.is_control(), "{c:?}");
        }
        assert!(v.contains(&UNKNOWN));
        assert_eq!(v[0], '!');
        assert_eq!(v[94], '␣');
        assert_eq!(v[255], '\u{41f}');
    }

    #[test]
    fn the_files_are_written_and_parse() {
        let dir =
            std::env::temp_dir().join(format!("dsa-kv-dynamo-fixture-{}", std::process::id()));
        write(&dir, 4096).unwrap();
        for name in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
            let text = std::fs::read_to_string(dir.join(name)).unwrap();
            let _: Value = serde_json::from_str(&text).unwrap();
        }
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["eos_token_id"], json!(256));
        assert_eq!(config["max_position_embeddings"], json!(4096));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
