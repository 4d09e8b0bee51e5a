//! `FluxInput`: the arguments of one forward pass, and the shape checks that guard it.

use tch::{Device, Kind, Tensor};

use crate::architecture::expect_shape;
use crate::embeddings::{text_position_ids, token_grid_ids};
use crate::{FluxConfig, InputError};

/// The inputs of `Flux::forward`, named as in the reference API.
#[derive(Debug, Clone, Copy)]
pub struct FluxInput<'a> {
    /// Noisy latents `[B, C, H, W]`; `H` and `W` divisible by the patch size.
    pub img: &'a Tensor,
    /// Text encoder states `[B, S, context_dim]` (T5-XXL).
    pub txt: &'a Tensor,
    /// Pooled text vector `[B, vec_in_dim]` (CLIP-L).
    pub y: &'a Tensor,
    /// Flow time `[B]` in `[0, 1]` (σ; 1 is pure noise).
    pub timesteps: &'a Tensor,
    /// Image token positions `[B, (H/p)·(W/p), 3]`.
    pub img_ids: &'a Tensor,
    /// Text token positions `[B, S, 3]` (zeros in FLUX.1).
    pub txt_ids: &'a Tensor,
    /// Guidance strength `[B]`; required exactly when the config has `guidance_embed`.
    pub guidance: Option<&'a Tensor>,
}

impl FluxInput<'_> {
    /// Check every shape against `config`; returns the token grid `(rows, cols)` of the image.
    pub fn check(&self, config: &FluxConfig) -> Result<(i64, i64), InputError> {
        let p = config.patch_size;
        let size = self.img.size();
        let ok = size.len() == 4
            && size[1] == config.in_channels
            && size[2] % p == 0
            && size[3] % p == 0;
        if !ok {
            return Err(InputError {
                argument: "img",
                expected: format!(
                    "[B, {}, H, W] with H and W divisible by patch_size {p}",
                    config.in_channels
                ),
                got: format!("shape {size:?}"),
            });
        }
        let (b, rows, cols) = (size[0], size[2] / p, size[3] / p);
        let text_len = self.txt.size().get(1).copied().unwrap_or(-1);
        expect_shape("txt", self.txt, &[b, text_len, config.context_dim])?;
        expect_shape("y", self.y, &[b, config.vec_in_dim])?;
        expect_shape("timesteps", self.timesteps, &[b])?;
        expect_shape("img_ids", self.img_ids, &[b, rows * cols, 3])?;
        expect_shape("txt_ids", self.txt_ids, &[b, text_len, 3])?;
        match (config.guidance_embed, self.guidance) {
            (true, Some(g)) => expect_shape("guidance", g, &[b])?,
            (false, None) => {}
            (true, None) => {
                return Err(InputError {
                    argument: "guidance",
                    expected: "a [B] tensor (the model has guidance_embed = true)".into(),
                    got: "None".into(),
                })
            }
            (false, Some(_)) => {
                return Err(InputError {
                    argument: "guidance",
                    expected: "None (the model has guidance_embed = false)".into(),
                    got: "a tensor".into(),
                })
            }
        }
        Ok((rows, cols))
    }
}

/// An owned batch of forward-pass inputs (see [`FluxInput`] for shapes).
#[derive(Debug)]
pub struct FluxBatch {
    /// `[B, C, H, W]`.
    pub img: Tensor,
    /// `[B, S, context_dim]`.
    pub txt: Tensor,
    /// `[B, vec_in_dim]`.
    pub y: Tensor,
    /// `[B]` in `[0, 1]`.
    pub timesteps: Tensor,
    /// `[B, (H/p)·(W/p), 3]`.
    pub img_ids: Tensor,
    /// `[B, S, 3]`.
    pub txt_ids: Tensor,
    /// `[B]`, present when the config embeds guidance.
    pub guidance: Option<Tensor>,
}

impl FluxBatch {
    /// Standard-normal latents, text and pooled vectors, uniform timesteps, the config's guidance
    /// scale, and grid/text position ids, for a `rows × cols` token grid and `text_len` text
    /// tokens, on `device` in f32. Draws from libtorch's global generator (`tch::manual_seed`).
    pub fn random(
        config: &FluxConfig,
        batch: i64,
        rows: i64,
        cols: i64,
        text_len: i64,
        device: Device,
    ) -> Self {
        let opts = (Kind::Float, device);
        let p = config.patch_size;
        Self {
            img: Tensor::randn([batch, config.in_channels, rows * p, cols * p], opts),
            txt: Tensor::randn([batch, text_len, config.context_dim], opts),
            y: Tensor::randn([batch, config.vec_in_dim], opts),
            timesteps: Tensor::rand([batch], opts),
            img_ids: token_grid_ids(batch, rows, cols, device),
            txt_ids: text_position_ids(batch, text_len, device),
            guidance: config
                .guidance_embed
                .then(|| Tensor::full([batch], config.guidance_scale, opts)),
        }
    }

    /// Samples `start ..< start + len` of the batch (a data-parallel replica's share).
    pub fn narrow(&self, start: i64, len: i64) -> Self {
        let cut = |t: &Tensor| t.narrow(0, start, len);
        Self {
            img: cut(&self.img),
            txt: cut(&self.txt),
            y: cut(&self.y),
            timesteps: cut(&self.timesteps),
            img_ids: cut(&self.img_ids),
            txt_ids: cut(&self.txt_ids),
            guidance: self.guidance.as_ref().map(cut),
        }
    }

    /// Borrow as the forward pass' arguments.
    pub fn as_input(&self) -> FluxInput<'_> {
        FluxInput {
            img: &self.img,
            txt: &self.txt,
            y: &self.y,
            timesteps: &self.timesteps,
            img_ids: &self.img_ids,
            txt_ids: &self.txt_ids,
            guidance: self.guidance.as_ref(),
        }
    }
}
