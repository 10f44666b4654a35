//! The model directory as the frontend's tokenizer reads it: loaded by the Hugging Face
//! `tokenizers` crate (the one Dynamo's frontend runs), every model token decodes to
//! visible text, ASCII prompts encode into the model's vocabulary and decode back.

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
