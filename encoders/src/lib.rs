//! # flux-encoders
//!
//! What turns prompts into the inputs of Flux-class text encoders: [`PromptTokenizer`] reads the
//! tokenizer folders diffusers ships (`tokenizer/` for CLIP-L, `tokenizer_2/` for T5) and pads
//! and truncates as diffusers' Flux pipeline does.

pub mod tokenizer;

pub use tokenizer::{PromptTokenizer, TokenBatch, TokenizerError};
