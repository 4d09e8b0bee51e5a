//! `FluxInput`: the arguments of one forward pass, and the shape checks that guard it.

use tch::Tensor;

use crate::FluxConfig;

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

/// A forward-pass argument whose shape does not fit the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Flux input `{argument}`: expected {expected}, got {got}")]
pub struct InputError {
    /// The argument's name, as in [`FluxInput`].
    pub argument: &'static str,
    /// The shape rule.
    pub expected: String,
    /// What was passed.
    pub got: String,
}

fn expect_shape(argument: &'static str, tensor: &Tensor, expected: &[i64]) -> Result<(), InputError> {
    let size = tensor.size();
    if size == expected {
        Ok(())
    } else {
        Err(InputError { argument, expected: format!("shape {expected:?}"), got: format!("shape {size:?}") })
    }
}

impl FluxInput<'_> {
    /// Check every shape against `config`; returns the token grid `(rows, cols)` of the image.
    pub fn check(&self, config: &FluxConfig) -> Result<(i64, i64), InputError> {
        let p = config.patch_size;
        let size = self.img.size();
        let ok = size.len() == 4 && size[1] == config.in_channels && size[2] % p == 0 && size[3] % p == 0;
        if !ok {
            return Err(InputError {
                argument: "img",
                expected: format!("[B, {}, H, W] with H and W divisible by patch_size {p}", config.in_channels),
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
