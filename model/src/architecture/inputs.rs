//! What every diffusion model is fed: a model-agnostic batch, the input shapes a model declares,
//! and the error that names a mis-shaped argument.

use tch::{Device, Kind, Tensor};

use crate::tp::TpContext;

/// The inputs a model takes, as its config declares them: what data, samplers and benchmarks must
/// feed it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputSpec {
    /// Latent channels `C` of `[B, C, H, W]`.
    pub latent_channels: i64,
    /// Side of the square patch folded into one token: `H` and `W` must be multiples of it.
    pub patch_size: i64,
    /// Width of the per-token text states `[B, S, text_dim]`, when the model reads text.
    pub text_dim: Option<i64>,
    /// Width of the pooled conditioning vector `[B, pooled_dim]`, when the model takes one.
    pub pooled_dim: Option<i64>,
    /// The guidance strength to feed by default, when the model embeds one (guidance-distilled).
    pub guidance: Option<f64>,
}

impl InputSpec {
    /// Image tokens of one `height × width` latent.
    pub fn image_tokens(&self, height: i64, width: i64) -> i64 {
        (height / self.patch_size) * (width / self.patch_size)
    }

    /// Text tokens of one sample with `text_len` text states (0 when the model reads no text).
    pub fn text_tokens(&self, text_len: i64) -> i64 {
        if self.text_dim.is_some() {
            text_len
        } else {
            0
        }
    }

    /// Check `batch` against the declared inputs; returns the token grid `(rows, cols)`.
    pub fn check(&self, batch: &DiffusionBatch) -> Result<(i64, i64), InputError> {
        let p = self.patch_size;
        let size = batch.latents.size();
        if size.len() != 4
            || size[1] != self.latent_channels
            || size[2] % p != 0
            || size[3] % p != 0
        {
            return Err(InputError {
                argument: "latents",
                expected: format!(
                    "[B, {}, H, W] with H and W divisible by patch_size {p}",
                    self.latent_channels
                ),
                got: format!("shape {size:?}"),
            });
        }
        let b = size[0];
        expect_shape("timesteps", &batch.timesteps, &[b])?;
        let present = |argument, declared: bool, given: bool, what: &str| match (declared, given) {
            (true, false) => Err(InputError {
                argument,
                expected: format!("{what} (the model takes it)"),
                got: "None".into(),
            }),
            (false, true) => Err(InputError {
                argument,
                expected: "None (the model does not take it)".into(),
                got: "a tensor".into(),
            }),
            _ => Ok(()),
        };
        present(
            "text",
            self.text_dim.is_some(),
            batch.text.is_some(),
            "[B, S, text_dim]",
        )?;
        present(
            "pooled",
            self.pooled_dim.is_some(),
            batch.pooled.is_some(),
            "[B, pooled_dim]",
        )?;
        present(
            "guidance",
            self.guidance.is_some(),
            batch.guidance.is_some(),
            "[B]",
        )?;
        if let (Some(dim), Some(text)) = (self.text_dim, &batch.text) {
            let len = text.size().get(1).copied().unwrap_or(-1);
            expect_shape("text", text, &[b, len, dim])?;
        }
        if let (Some(dim), Some(pooled)) = (self.pooled_dim, &batch.pooled) {
            expect_shape("pooled", pooled, &[b, dim])?;
        }
        if let Some(g) = &batch.guidance {
            expect_shape("guidance", g, &[b])?;
        }
        Ok((size[2] / p, size[3] / p))
    }
}

/// One batch of forward-pass inputs for any architecture; which optional parts are present is
/// what the model's [`InputSpec`] declares.
#[derive(Debug)]
pub struct DiffusionBatch {
    /// Noisy latents `[B, C, H, W]`.
    pub latents: Tensor,
    /// Noise level σ `[B]` in `[0, 1]` (1 is pure noise).
    pub timesteps: Tensor,
    /// Text encoder states `[B, S, text_dim]`.
    pub text: Option<Tensor>,
    /// Pooled conditioning vector `[B, pooled_dim]`.
    pub pooled: Option<Tensor>,
    /// Guidance strength `[B]`.
    pub guidance: Option<Tensor>,
}

impl Clone for DiffusionBatch {
    /// Shares the tensors (no copy).
    fn clone(&self) -> Self {
        self.narrow(0, self.latents.size()[0])
    }
}

impl DiffusionBatch {
    /// Standard-normal latents, text and pooled vectors, uniform timesteps and the default
    /// guidance, as `spec` declares them, for `height × width` latents and `text_len` text states,
    /// on `device` in f32. Draws from libtorch's global generator (`tch::manual_seed`).
    pub fn random(
        spec: &InputSpec,
        batch: i64,
        height: i64,
        width: i64,
        text_len: i64,
        device: Device,
    ) -> Self {
        let opts = (Kind::Float, device);
        Self {
            latents: Tensor::randn([batch, spec.latent_channels, height, width], opts),
            timesteps: Tensor::rand([batch], opts),
            text: spec
                .text_dim
                .map(|d| Tensor::randn([batch, text_len, d], opts)),
            pooled: spec.pooled_dim.map(|d| Tensor::randn([batch, d], opts)),
            guidance: spec.guidance.map(|g| Tensor::full([batch], g, opts)),
        }
    }

    /// Samples `start ..< start + len` (a data-parallel replica's share).
    pub fn narrow(&self, start: i64, len: i64) -> Self {
        let cut = |t: &Tensor| t.narrow(0, start, len);
        Self {
            latents: cut(&self.latents),
            timesteps: cut(&self.timesteps),
            text: self.text.as_ref().map(cut),
            pooled: self.pooled.as_ref().map(cut),
            guidance: self.guidance.as_ref().map(cut),
        }
    }

    /// The latents, text and pooled vector in `kind` (the weights' dtype); timesteps and guidance
    /// stay f32 (the embedders cast their sinusoids).
    pub fn to_kind(&self, kind: Kind) -> Self {
        let cast = |t: &Tensor| t.to_kind(kind);
        Self {
            latents: cast(&self.latents),
            timesteps: self.timesteps.shallow_clone(),
            text: self.text.as_ref().map(cast),
            pooled: self.pooled.as_ref().map(cast),
            guidance: self.guidance.as_ref().map(Tensor::shallow_clone),
        }
    }
}

/// A forward-pass argument whose shape does not fit the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model input `{argument}`: expected {expected}, got {got}")]
pub struct InputError {
    /// The argument's name.
    pub argument: &'static str,
    /// The shape rule.
    pub expected: String,
    /// What was passed.
    pub got: String,
}

/// `Ok` when `tensor` has exactly the shape `expected`.
pub(crate) fn expect_shape(
    argument: &'static str,
    tensor: &Tensor,
    expected: &[i64],
) -> Result<(), InputError> {
    let size = tensor.size();
    if size == expected {
        Ok(())
    } else {
        Err(InputError {
            argument,
            expected: format!("shape {expected:?}"),
            got: format!("shape {size:?}"),
        })
    }
}

/// `Ok` when every stream `(argument, tokens)` splits evenly over `tp` (always, without
/// sequence parallelism, which splits each stream's tokens over the group).
pub(crate) fn check_sequence_split(
    tp: &TpContext,
    streams: &[(&'static str, i64)],
) -> Result<(), InputError> {
    for &(argument, tokens) in streams {
        if !tp.divides_sequence(tokens) {
            return Err(InputError {
                argument,
                expected: format!(
                    "a number of tokens divisible by tensor_parallel_size {} \
                     (sequence_parallel splits each stream over the group)",
                    tp.size()
                ),
                got: format!("{tokens} tokens"),
            });
        }
    }
    Ok(())
}
