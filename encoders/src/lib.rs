//! # flux-encoders
//!
//! What turns prompts into the conditioning of Flux-class models: [`PromptTokenizer`] reads the
//! tokenizer folders diffusers ships (`tokenizer/` for CLIP-L, `tokenizer_2/` for T5) and pads
//! and truncates as diffusers' Flux pipeline does; [`ClipTextModel`] is CLIP's text transformer
//! (FLUX.1's `text_encoder/`) and [`T5Encoder`] T5's encoder (`text_encoder_2/`), both loaded from
//! the files transformers saves; [`Autoencoder`] is FLUX.1's VAE (`vae/` or BFL's
//! `ae.safetensors`), images ↔ latents;
//! [`PromptEncoder`] runs a FLUX.1 folder's text side as diffusers' pipeline does, and
//! [`write_png`] writes decoded images; [`encode_folder`] turns a folder of captioned images into
//! the latent shards training reads.

mod bfl_vae;
pub mod buckets;
pub mod captions;
pub mod clip;
pub mod encode;
pub mod image_files;
pub mod png;
pub mod prompt;
pub mod t5;
pub mod tokenizer;
pub mod vae;
mod vae_config;
pub mod weights;

pub use buckets::Bucket;
pub use captions::Captions;
pub use clip::{ClipTextConfig, ClipTextModel, ClipTextOutput};
pub use encode::{check_buckets, encode_folder, EncodeOptions, EncodeSummary, Encoders};
pub use png::{grid, png_bytes, save_png, to_rgb, write_png};
pub use prompt::{PromptEmbeddings, PromptEncoder};
pub use t5::{T5Config, T5Encoder};
pub use tokenizer::{PromptTokenizer, TokenBatch, TokenizerError};
pub use vae::{Autoencoder, AutoencoderConfig, Posterior};
pub use weights::LoadError;
