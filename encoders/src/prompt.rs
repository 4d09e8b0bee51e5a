//! A diffusers FLUX.1 folder's text side as one encoder: `tokenizer/` + `text_encoder/` (CLIP-L,
//! 77 tokens, its pooled vector) and `tokenizer_2/` + `text_encoder_2/` (T5, its final states),
//! called as diffusers' `FluxPipeline.encode_prompt` calls them (no attention masks).

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::{ClipTextModel, LoadError, PromptTokenizer, T5Encoder};

/// CLIP's prompt length.
pub const CLIP_TOKENS: usize = 77;

/// The conditioning of a batch of prompts.
#[derive(Debug)]
pub struct PromptEmbeddings {
    /// T5's final states `[B, L, D_text]` (f32).
    pub text: Tensor,
    /// CLIP's pooled vector `[B, D_pooled]` (f32).
    pub pooled: Tensor,
}

/// Both text encoders of a FLUX.1 folder with their tokenizers.
#[derive(Debug)]
pub struct PromptEncoder {
    clip_tokenizer: PromptTokenizer,
    clip: ClipTextModel,
    t5_tokenizer: PromptTokenizer,
    t5: T5Encoder,
    device: Device,
}

impl PromptEncoder {
    /// The text encoders in `dir` (a diffusers FLUX.1 folder), T5 padding prompts to
    /// `t5_tokens` (512 for FLUX.1 [dev], 256 for [schnell]) with weights in `t5_kind`.
    pub fn load(
        dir: &Path,
        t5_tokens: usize,
        t5_kind: Kind,
        device: Device,
    ) -> Result<Self, LoadError> {
        let tokenizer = |name: &str, length| {
            PromptTokenizer::load(&dir.join(name), length)
                .map_err(|e| LoadError::new(&dir.join(name), e))
        };
        Ok(Self {
            clip_tokenizer: tokenizer("tokenizer", CLIP_TOKENS)?,
            clip: ClipTextModel::load(&dir.join("text_encoder"), device)?,
            t5_tokenizer: tokenizer("tokenizer_2", t5_tokens)?,
            t5: T5Encoder::load(&dir.join("text_encoder_2"), device, t5_kind)?,
            device,
        })
    }

    /// The width of the text states and of the pooled vector (what a model's `context_dim` and
    /// `vec_in_dim` must be).
    pub fn widths(&self) -> (i64, i64) {
        (self.t5.config().d_model, self.clip.config().hidden_size)
    }

    /// Encode `prompts`.
    pub fn encode(&self, prompts: &[&str]) -> Result<PromptEmbeddings, LoadError> {
        let ids = |tokenizer: &PromptTokenizer| {
            let batch = tokenizer
                .encode(prompts)
                .map_err(|e| LoadError::new(Path::new("prompt"), e))?;
            Ok::<_, LoadError>(
                Tensor::from_slice(&batch.ids)
                    .view([batch.batch as i64, batch.length as i64])
                    .to_device(self.device),
            )
        };
        let (clip_ids, t5_ids) = (ids(&self.clip_tokenizer)?, ids(&self.t5_tokenizer)?);
        Ok(tch::no_grad(|| PromptEmbeddings {
            text: self.t5.forward(&t5_ids, None).to_kind(Kind::Float),
            pooled: self.clip.forward(&clip_ids).pooled.to_kind(Kind::Float),
        }))
    }
}
