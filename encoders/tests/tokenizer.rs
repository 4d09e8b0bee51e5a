//! Token ids equal to transformers' for hard captions (empty, unicode, emoji, over-long,
//! whitespace runs, mixed case, contractions), for tiny CLIP and T5 tokenizers that
//! tests/fixtures/make_text_fixtures.py builds and saves with transformers: CLIP from its
//! tokenizer.json and from FLUX.1's vocab.json + merges.txt layout, T5 from its tokenizer.json;
//! exact ids and attention masks, CLIP at 77 tokens and T5 at 32. Broken folders are refused
//! naming the file.

use std::path::{Path, PathBuf};

use flux_encoders::{PromptTokenizer, TokenizerError};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/data/text")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json"))
        .expect("fixtures: run scripts/test.sh or tests/fixtures/make_text_fixtures.py");
    serde_json::from_str(&text).unwrap()
}

fn assert_matches_transformers(folder: &str, which: &str) {
    let expected = &expected()[which];
    let length = expected["max_length"].as_u64().unwrap() as usize;
    let tokenizer = PromptTokenizer::load(&fixtures().join(folder), length).unwrap();
    let captions: Vec<&str> = expected["captions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    let batch = tokenizer.encode(&captions).unwrap();
    assert_eq!((batch.batch, batch.length), (captions.len(), length));
    let rows = |key: &str, i: usize| -> Vec<i64> {
        expected[key][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect()
    };
    for (i, caption) in captions.iter().enumerate() {
        assert_eq!(batch.row(i), rows("input_ids", i), "{folder}: {caption:?}");
        assert_eq!(
            batch.mask_row(i),
            rows("attention_mask", i),
            "{folder}: mask of {caption:?}"
        );
    }
}

#[test]
fn clip_ids_equal_transformers_from_tokenizer_json() {
    assert_matches_transformers("clip", "clip");
}

#[test]
fn clip_ids_equal_transformers_from_vocab_and_merges() {
    assert_matches_transformers("clip_files", "clip");
}

#[test]
fn t5_ids_equal_transformers() {
    assert_matches_transformers("t5", "t5");
}

#[test]
fn broken_tokenizer_folders_are_refused_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("flux-tokenizer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let why = |path: &Path| match PromptTokenizer::load(path, 8).unwrap_err() {
        TokenizerError::File { path, why } => format!("{}: {why}", path.display()),
        other => panic!("{other}"),
    };
    assert!(why(&dir).contains("neither tokenizer.json nor"));

    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    assert!(why(&dir).contains("tokenizer.json"));

    // A T5 folder whose config names a pad token the vocabulary lacks.
    let t5 = fixtures().join("t5");
    std::fs::copy(t5.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"pad_token": "<nothing>"}"#,
    )
    .unwrap();
    assert!(why(&dir).contains("pad_token `<nothing>` is not in the vocabulary"));
    std::fs::remove_dir_all(dir).unwrap();
}
