//! The model directory as the frontend's tokenizer reads it: loaded by the Hugging Face
//! `tokenizers` crate (the one Dynamo's frontend runs), every model token decodes to
//! visible text, ASCII prompts encode into the model's vocabulary and decode back. And
//! the directory is private: created `0700`, one that others can write, that another
//! user owns or that is a symbolic link refused, temporary names not guessable, the
//! default one per user.

use std::os::unix::fs::{chown, symlink, MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::process::Command;

use dsa_kv_dynamo::fixture::{self, EOS_ID, EOS_TEXT, MODEL_VOCAB};
use tokenizers::Tokenizer;

/// The fixture written into a directory of the test's own (`name`), loaded.
fn tokenizer(name: &str) -> Tokenizer {
    let dir = std::env::temp_dir().join(format!("dsa-kv-dynamo-{name}-{}", std::process::id()));
    fixture::write(&dir, 4096).expect("write");
    let t = Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizers loads it");
    std::fs::remove_dir_all(&dir).expect("clean up");
    t
}

#[test]
fn every_model_token_decodes_to_one_visible_character() {
    let t = tokenizer("decode");
    let v = fixture::vocabulary();
    for id in 0..MODEL_VOCAB {
        let text = t.decode(&[id], true).expect("decode");
        assert_eq!(text.chars().count(), 1, "id {id}: {text:?}");
        assert!(!text.trim().is_empty(), "id {id}: {text:?}");
        assert_eq!(text.chars().next(), Some(v[id as usize]));
    }
    // Decoding a run concatenates (no spaces between tokens).
    assert_eq!(
        t.decode(&[39, 68, 75, 75, 78], true).expect("decode"),
        "Hello"
    );
    assert_eq!(t.token_to_id(EOS_TEXT), Some(EOS_ID));
    assert_eq!(t.decode(&[39, EOS_ID], true).expect("decode"), "H");
}

#[test]
fn prompts_encode_into_the_model_vocabulary() {
    let t = tokenizer("encode");
    let text = "user: Hello, world!\n\tWhat's 2+2?";
    let ids = t.encode(text, false).expect("encode").get_ids().to_vec();
    assert_eq!(ids.len(), text.chars().count(), "one token per character");
    assert!(ids.iter().all(|&i| i < MODEL_VOCAB), "{ids:?}");
    assert_eq!(
        t.decode(&ids, true).expect("decode"),
        "user:␣Hello,␣world!⏎⇥What's␣2+2?"
    );
    // Outside the vocabulary: the unknown token `?`.
    let ids = t.encode("a€b", false).expect("encode").get_ids().to_vec();
    assert_eq!(ids, vec![64, 30, 65]);
}

const FILES: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "config.json"];

/// A path of the test's own under the temporary directory, nothing there yet.
fn scratch(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("dsa-kv-dynamo-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    let _ = std::fs::remove_file(&p);
    p
}

/// This process's effective user id: the owner of a file it creates (a file of its own,
/// with a random name: the tests run in parallel threads of one process).
fn our_uid() -> u32 {
    let f = tempfile::NamedTempFile::new().expect("a temporary file");
    f.as_file().metadata().expect("metadata").uid()
}

fn mode(p: &std::path::Path) -> u32 {
    std::fs::symlink_metadata(p).expect("metadata").mode() & 0o7777
}

#[test]
fn a_new_model_directory_is_private_to_its_user() {
    let dir = scratch("private");
    fixture::write(&dir, 4096).expect("write");
    assert_eq!(mode(&dir), 0o700, "{:o}", mode(&dir));
    assert_eq!(std::fs::metadata(&dir).expect("metadata").uid(), our_uid());
    // Written again (a second worker, a restart): accepted, the files replaced.
    fixture::write(&dir, 2048).expect("write again");
    let config = std::fs::read_to_string(dir.join("config.json")).expect("read");
    assert!(
        config.contains("\"max_position_embeddings\": 2048"),
        "{config}"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn a_model_directory_others_could_change_is_refused() {
    // Writable by others: anyone could replace the tokenizer or the chat template.
    let dir = scratch("writable");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let err = fixture::write(&dir, 4096).expect_err("a directory others can write");
    assert!(err.to_string().contains("writable by"), "{err}");
    assert!(err.to_string().contains("777"), "{err}");
    assert!(
        FILES.iter().all(|f| !dir.join(f).exists()),
        "nothing written"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
    // A symbolic link (to a directory of ours, even): refused, nothing written through it.
    let target = scratch("link-target");
    std::fs::create_dir(&target).expect("mkdir");
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let link = scratch("link");
    symlink(&target, &link).expect("symlink");
    let err = fixture::write(&link, 4096).expect_err("a symbolic link");
    assert!(err.to_string().contains("symbolic link"), "{err}");
    assert!(
        FILES.iter().all(|f| !target.join(f).exists()),
        "nothing written"
    );
    std::fs::remove_file(&link).expect("clean up");
    // Owned by another user (as root, one made so; otherwise `/`, which root owns).
    let other = if our_uid() == 0 {
        let d = scratch("not-ours");
        std::fs::create_dir(&d).expect("mkdir");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        chown(&d, Some(65534), Some(65534)).expect("chown");
        d
    } else {
        PathBuf::from("/")
    };
    let err = fixture::write(&other, 4096).expect_err("another user's directory");
    assert!(err.to_string().contains("owned by"), "{err}");
    assert!(
        FILES.iter().all(|f| !other.join(f).exists()),
        "nothing written"
    );
    if other != std::path::Path::new("/") {
        std::fs::remove_dir_all(&other).expect("clean up");
    }
    std::fs::remove_dir_all(&target).expect("clean up");
}

#[test]
fn temporary_names_cannot_be_planted() {
    // Links at the names a writer with predictable temporary names would use (the
    // file's name and this process's id) to a file outside: never written through.
    let dir = scratch("planted");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let victim = scratch("victim");
    std::fs::write(&victim, "not yours").expect("write");
    for f in FILES {
        symlink(&victim, dir.join(format!(".{f}.{}", std::process::id()))).expect("symlink");
    }
    fixture::write(&dir, 4096).expect("write");
    assert_eq!(std::fs::read_to_string(&victim).expect("read"), "not yours");
    for f in FILES {
        let m = std::fs::symlink_metadata(dir.join(f)).expect("written");
        assert!(m.file_type().is_file(), "{f}: a regular file");
    }
    // Nothing left behind but the three files and the planted links.
    let names = std::fs::read_dir(&dir).expect("read_dir").count();
    assert_eq!(names, 6);
    std::fs::remove_dir_all(&dir).expect("clean up");
    std::fs::remove_file(&victim).expect("clean up");
}

#[test]
fn the_default_model_directory_is_per_user() {
    let help = Command::new(env!("CARGO_BIN_EXE_dsa-kv-dynamo"))
        .arg("--help")
        .output()
        .expect("run the worker");
    // Whitespace collapsed: help may be wrapped.
    let text = String::from_utf8_lossy(&help.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let want = std::env::temp_dir().join(format!("dsa-kv-dynamo-model-{}", our_uid()));
    assert!(
        text.contains(&format!("[default: {}]", want.display())),
        "{text}"
    );
}
