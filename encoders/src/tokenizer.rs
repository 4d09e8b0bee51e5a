//! Prompts → token ids as diffusers' Flux pipeline makes them: `tokenizer(prompts,
//! padding="max_length", max_length=L, truncation=True)`, CLIP-L at 77 tokens and T5 at 512
//! (FLUX.1 [dev]) or 256 ([schnell]).
//!
//! A folder holds either a `tokenizer.json` (transformers' fast tokenizers; T5's `tokenizer_2/`)
//! or CLIP's `vocab.json` and `merges.txt` (FLUX.1's `tokenizer/`), from which the tokenizer
//! transformers' `CLIPTokenizer` builds is built here: NFC, whitespace runs to one space,
//! lower case; CLIP's word pattern and byte-level symbols; BPE with `</w>` ending words;
//! `<|startoftext|>` … `<|endoftext|>` around each prompt. The pad token is the folder's
//! `pad_token` (`tokenizer_config.json`, else `special_tokens_map.json`).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tokenizers::{
    PaddingDirection, PaddingParams, PaddingStrategy, Tokenizer, TruncationDirection,
    TruncationParams, TruncationStrategy,
};

/// Why a tokenizer could not be loaded or could not encode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizerError {
    /// A file of the tokenizer folder is missing, unreadable or malformed.
    #[error("{path}: {why}")]
    File {
        /// The file (or folder).
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The tokenizer failed on a prompt.
    #[error("tokenizing prompt {index}: {why}")]
    Encode {
        /// Index of the prompt in the batch.
        index: usize,
        /// The tokenizer's message.
        why: String,
    },
}

/// The token ids of a batch of prompts: `[batch, length]`, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    /// Token ids, `[batch, length]`.
    pub ids: Vec<i64>,
    /// 1 for a prompt's tokens (its special tokens included), 0 for padding, `[batch, length]`.
    pub attention_mask: Vec<i64>,
    /// Prompts.
    pub batch: usize,
    /// Tokens per prompt (the tokenizer's `max_length`).
    pub length: usize,
}

impl TokenBatch {
    /// The ids of prompt `i`.
    pub fn row(&self, i: usize) -> &[i64] {
        &self.ids[i * self.length..(i + 1) * self.length]
    }

    /// The attention mask of prompt `i`.
    pub fn mask_row(&self, i: usize) -> &[i64] {
        &self.attention_mask[i * self.length..(i + 1) * self.length]
    }
}

/// A text encoder's tokenizer, padding and truncating every prompt to `max_length` tokens.
#[derive(Debug, Clone)]
pub struct PromptTokenizer {
    inner: Tokenizer,
    max_length: usize,
}

fn file_error(path: &Path, why: impl ToString) -> TokenizerError {
    TokenizerError::File {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

fn read_json(path: &Path) -> Result<Value, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e))?;
    serde_json::from_str(&text).map_err(|e| file_error(path, e))
}

/// A special token as a folder's configs name it: a string, or an object with `content`.
fn token_name(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Special token `key` (`pad_token`, `bos_token`, …) of the folder `dir`, from
/// tokenizer_config.json or special_tokens_map.json.
fn special_token(dir: &Path, key: &str) -> Result<Option<String>, TokenizerError> {
    for file in ["tokenizer_config.json", "special_tokens_map.json"] {
        let path = dir.join(file);
        if path.exists() {
            if let Some(name) = read_json(&path)?.get(key).and_then(token_name) {
                return Ok(Some(name));
            }
        }
    }
    Ok(None)
}

/// CLIP's tokenizer from `vocab.json` and `merges.txt` in `dir`, as transformers'
/// `CLIPTokenizer` builds it, with `bos` and `eos` as its special tokens.
fn clip_from_files(dir: &Path, bos: &str, eos: &str) -> Result<Tokenizer, TokenizerError> {
    let vocab_path = dir.join("vocab.json");
    let vocab = read_json(&vocab_path)?;
    let id = |token: &str| {
        vocab.get(token).and_then(Value::as_u64).ok_or_else(|| {
            file_error(
                &vocab_path,
                format!("has no id for special token `{token}`"),
            )
        })
    };
    let (bos_id, eos_id) = (id(bos)?, id(eos)?);
    let merges_path = dir.join("merges.txt");
    let merges: Vec<String> = std::fs::read_to_string(&merges_path)
        .map_err(|e| file_error(&merges_path, e))?
        .lines()
        .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    let special = |token: &str, id: u64| {
        json!({"id": id, "content": token, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let document = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(bos, bos_id), special(eos, eos_id)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"},
            {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "},
            {"type": "Lowercase"},
        ]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split",
             "pattern": {"Regex": format!(
                 "{}|{}|'s|'t|'re|'ve|'m|'ll|'d|[\\p{{L}}]+|[\\p{{N}}]|[^\\s\\p{{L}}\\p{{N}}]+",
                 regex_escape(bos), regex_escape(eos))},
             "behavior": "Removed", "invert": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
             "use_regex": true},
        ]},
        "post_processor": {"type": "RobertaProcessing", "sep": [eos, eos_id],
                           "cls": [bos, bos_id], "trim_offsets": false,
                           "add_prefix_space": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": eos,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "</w>",
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    document
        .to_string()
        .parse::<Tokenizer>()
        .map_err(|e| file_error(dir, format!("vocab.json and merges.txt: {e}")))
}

/// `text` with the regex metacharacters CLIP's special tokens contain escaped.
fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| match c {
            '|' | '(' | ')' | '[' | ']' | '.' | '*' | '+' | '?' | '^' | '$' | '\\' | '{' | '}' => {
                vec!['\\', c]
            }
            _ => vec![c],
        })
        .collect()
}

impl PromptTokenizer {
    /// The tokenizer in `path` (a tokenizer folder, or a `tokenizer.json` file), padding and
    /// truncating to `max_length` tokens. Fails naming the file that is missing or malformed,
    /// or a pad token the vocabulary lacks.
    pub fn load(path: &Path, max_length: usize) -> Result<Self, TokenizerError> {
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("tokenizer.json"))
        } else {
            let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
            (dir, path.to_path_buf())
        };
        let mut inner = if file.exists() {
            Tokenizer::from_file(&file).map_err(|e| file_error(&file, e))?
        } else if dir.join("vocab.json").exists() && dir.join("merges.txt").exists() {
            let bos = special_token(&dir, "bos_token")?.unwrap_or("<|startoftext|>".into());
            let eos = special_token(&dir, "eos_token")?.unwrap_or("<|endoftext|>".into());
            clip_from_files(&dir, &bos, &eos)?
        } else {
            return Err(file_error(
                &dir,
                "holds neither tokenizer.json nor CLIP's vocab.json and merges.txt",
            ));
        };
        let pad = special_token(&dir, "pad_token")?.ok_or_else(|| {
            file_error(
                &dir,
                "names no pad_token (tokenizer_config.json, special_tokens_map.json)",
            )
        })?;
        let pad_id = inner.token_to_id(&pad).ok_or_else(|| {
            file_error(&dir, format!("pad_token `{pad}` is not in the vocabulary"))
        })?;
        inner
            .with_truncation(Some(TruncationParams {
                max_length,
                strategy: TruncationStrategy::LongestFirst,
                direction: TruncationDirection::Right,
                stride: 0,
            }))
            .map_err(|e| file_error(&dir, e))?;
        inner.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::Fixed(max_length),
            direction: PaddingDirection::Right,
            pad_to_multiple_of: None,
            pad_id,
            pad_type_id: 0,
            pad_token: pad,
        }));
        Ok(Self { inner, max_length })
    }

    /// Tokens per prompt.
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// The ids and attention masks of `prompts`, each padded or truncated to `max_length`
    /// tokens, special tokens included.
    pub fn encode(&self, prompts: &[&str]) -> Result<TokenBatch, TokenizerError> {
        let mut batch = TokenBatch {
            ids: Vec::with_capacity(prompts.len() * self.max_length),
            attention_mask: Vec::with_capacity(prompts.len() * self.max_length),
            batch: prompts.len(),
            length: self.max_length,
        };
        for (index, prompt) in prompts.iter().enumerate() {
            let encoding =
                self.inner
                    .encode(*prompt, true)
                    .map_err(|e| TokenizerError::Encode {
                        index,
                        why: e.to_string(),
                    })?;
            batch
                .ids
                .extend(encoding.get_ids().iter().map(|&i| i as i64));
            batch
                .attention_mask
                .extend(encoding.get_attention_mask().iter().map(|&m| m as i64));
        }
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_tokens_are_read_as_strings_or_objects() {
        assert_eq!(token_name(&json!("<pad>")), Some("<pad>".into()));
        assert_eq!(
            token_name(&json!({"content": "<|endoftext|>", "lstrip": false})),
            Some("<|endoftext|>".into())
        );
        assert_eq!(token_name(&json!(3)), None);
    }

    #[test]
    fn clip_special_tokens_are_escaped_for_the_word_pattern() {
        assert_eq!(regex_escape("<|endoftext|>"), "<\\|endoftext\\|>");
    }
}
