//! `AutoencoderConfig`: the shape of FLUX.1's autoencoder as diffusers' `config.json` gives it,
//! and what follows from it (downsampling, latent sides, decode memory).

use serde::Deserialize;

/// The fields of diffusers' `config.json` the autoencoder needs (others are ignored).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AutoencoderConfig {
    /// Image channels in.
    pub in_channels: i64,
    /// Image channels out.
    pub out_channels: i64,
    /// Latent channels (16 for FLUX.1).
    pub latent_channels: i64,
    /// Width of each down block (and, reversed, up block).
    pub block_out_channels: Vec<i64>,
    /// ResNet blocks per down block (one more per up block).
    pub layers_per_block: i64,
    /// GroupNorm groups.
    #[serde(default = "default_groups")]
    pub norm_num_groups: i64,
    /// Latent normalisation for the transformer: `scale · (z − shift)`.
    pub scaling_factor: f64,
    /// See `scaling_factor` (0 when absent).
    #[serde(default)]
    pub shift_factor: Option<f64>,
    /// A 1×1 conv on the moments (Stable Diffusion's VAEs; not FLUX.1's).
    #[serde(default = "yes")]
    pub use_quant_conv: bool,
    /// A 1×1 conv on latents before decoding.
    #[serde(default = "yes")]
    pub use_post_quant_conv: bool,
    /// Self-attention in the middle blocks.
    #[serde(default = "yes")]
    pub mid_block_add_attention: bool,
    /// `silu` only.
    #[serde(default = "silu")]
    pub act_fn: String,
}

impl AutoencoderConfig {
    /// Bytes decoding `count` images of `height × width` pixels holds at least at once (f32):
    /// the input and output of a convolution of the full-size block, `block_out_channels[0]`
    /// channels per pixel each. Saturates rather than overflows.
    pub fn decode_bytes(&self, count: i64, height: i64, width: i64) -> u128 {
        let channels = self.block_out_channels.first().copied().unwrap_or(1);
        [count, height, width, channels]
            .iter()
            .fold(2 * 4u128, |n, &side| n.saturating_mul(side.max(0) as u128))
    }

    /// The factor between image and latent sides: 2 per down block after the first.
    pub fn downsampling(&self) -> i64 {
        1 << self.block_out_channels.len().saturating_sub(1)
    }

    /// Whether a model taking `channels` latent channels takes this autoencoder's latents
    /// 2×2-packed (FLUX.1: 64 = 4 × 16) rather than as they are. Fails when it is neither.
    pub fn packed_for(&self, channels: i64) -> Result<bool, String> {
        let own = self.latent_channels;
        match channels {
            c if c == 4 * own => Ok(true),
            c if c == own => Ok(false),
            c => Err(format!(
                "the autoencoder has {own} latent channels, the model's {c} are neither that nor \
                 4× that (2×2-packed)"
            )),
        }
    }

    /// The model's latent side for `pixels` image pixels, for a model taking `channels` latent
    /// channels: pixels / downsampling, / 2 more for packed latents. Fails when they do not
    /// divide, saying by what.
    pub fn latent_side(&self, pixels: i64, channels: i64) -> Result<i64, String> {
        let packed = self.packed_for(channels)?;
        let factor = self.downsampling() * if packed { 2 } else { 1 };
        match pixels > 0 && pixels % factor == 0 {
            true => Ok(pixels / factor),
            false => Err(format!(
                "{pixels} is not a positive multiple of {factor} pixels (the VAE's downsampling \
                 {}{})",
                self.downsampling(),
                if packed { " × 2×2 packing" } else { "" }
            )),
        }
    }
}

fn default_groups() -> i64 {
    32
}

fn yes() -> bool {
    true
}

fn silu() -> String {
    "silu".into()
}
