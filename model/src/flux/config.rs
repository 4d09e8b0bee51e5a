//! `FluxConfig`: the shape of a Flux MMDiT, its presets, and validation that names the bad field.

use serde::{Deserialize, Serialize};

use crate::tp::ParamSpec;
use crate::widths::{positive_width, MAX_LAYERS};
use crate::ModelConfig;
use crate::{Block, ConfigError, FluxTransformer};

/// Hyper-parameters of a Flux model (the `[model]` table of a run config).
///
/// Defaults are FLUX.1's (Primus' `FluxConfig`): 19 joint + 38 single layers, hidden 3072, 24 heads,
/// T5-XXL context (4096), CLIP-L pooled vector (768), RoPE axes (16, 56, 56).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FluxConfig {
    /// Number of joint (double-stream, MMDiT) layers.
    pub num_joint_layers: usize,
    /// Number of single-stream layers after the joint ones.
    pub num_single_layers: usize,
    /// Model width `D`.
    pub hidden_size: i64,
    /// Attention heads `H`; the head width is `D / H`.
    pub num_attention_heads: i64,
    /// Latent channels `C` of the `[B, C, H, W]` input (64 = 16 VAE channels packed 2×2).
    pub in_channels: i64,
    /// Side of the square patch folded into one token (1: every latent pixel is a token).
    pub patch_size: i64,
    /// Width of the text context (T5-XXL: 4096).
    pub context_dim: i64,
    /// Width of the pooled text vector (CLIP-L: 768).
    pub vec_in_dim: i64,
    /// Width of the sinusoidal timestep (and guidance) features.
    pub model_channels: i64,
    /// MLP width as a multiple of `D`.
    pub mlp_ratio: f64,
    /// Embed a guidance strength into the conditioning vector (guidance-distilled models).
    pub guidance_embed: bool,
    /// Guidance strength used at inference when `guidance_embed` is on.
    pub guidance_scale: f64,
    /// RoPE base frequency.
    pub theta: f64,
    /// RoPE width per position axis (index, row, column); must sum to the head width.
    pub axes_dim: Vec<i64>,
    /// RoPE rotates interleaved pairs `(x[2i], x[2i+1])` (FLUX.1) rather than halves.
    pub rotary_interleaved: bool,
    /// Bias on the joint blocks' QKV projections.
    pub add_qkv_bias: bool,
    /// Bias on the single blocks' fused linears.
    pub single_block_bias: bool,
    /// Epsilon of every LayerNorm and RMSNorm.
    pub layernorm_epsilon: f64,
    /// Dropout on attention-projection and MLP outputs in training.
    pub hidden_dropout: f64,
    /// Dropout on attention probabilities in training.
    pub attention_dropout: f64,
}

impl Default for FluxConfig {
    fn default() -> Self {
        Self {
            num_joint_layers: 19,
            num_single_layers: 38,
            hidden_size: 3072,
            num_attention_heads: 24,
            in_channels: 64,
            patch_size: 1,
            context_dim: 4096,
            vec_in_dim: 768,
            model_channels: 256,
            mlp_ratio: 4.0,
            guidance_embed: false,
            guidance_scale: 3.5,
            theta: 10_000.0,
            axes_dim: vec![16, 56, 56],
            rotary_interleaved: true,
            add_qkv_bias: true,
            single_block_bias: true,
            layernorm_epsilon: 1e-6,
            hidden_dropout: 0.0,
            attention_dropout: 0.0,
        }
    }
}

impl FluxConfig {
    /// FLUX.1 at full width with 1 joint + 1 single layer: 535,318,336 parameters without guidance.
    pub fn flux_535m() -> Self {
        Self {
            num_joint_layers: 1,
            num_single_layers: 1,
            ..Self::default()
        }
    }

    /// FLUX.1 [dev]/[schnell] shape: 19 joint + 38 single layers, about 11.9 B parameters.
    pub fn flux_12b() -> Self {
        Self::default()
    }

    /// Head width `D / H`.
    pub fn head_dim(&self) -> i64 {
        self.widths().head_dim()
    }

    /// MLP hidden width `mlp_ratio · D`.
    pub fn mlp_hidden(&self) -> i64 {
        self.widths().mlp_hidden()
    }

    /// Features per token entering the model: `C · p²`.
    pub fn token_channels(&self) -> i64 {
        self.widths().token_channels()
    }

    /// Total number of transformer layers (joint then single).
    pub fn num_layers(&self) -> usize {
        self.num_joint_layers + self.num_single_layers
    }

    /// Check every rule; the error names the first offending field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::check(self.num_joint_layers > 0, "num_joint_layers", || {
            "must be at least 1".into()
        })?;
        ConfigError::check(self.num_single_layers > 0, "num_single_layers", || {
            "must be at least 1".into()
        })?;
        self.widths().validate()?;
        for (field, value) in [
            ("context_dim", self.context_dim),
            ("vec_in_dim", self.vec_in_dim),
            ("model_channels", self.model_channels),
        ] {
            positive_width(field, value)?;
        }
        for (field, value) in [
            ("num_joint_layers", self.num_joint_layers),
            ("num_single_layers", self.num_single_layers),
        ] {
            ConfigError::check(value <= MAX_LAYERS, field, || {
                format!("must be at most {MAX_LAYERS}, got {value}")
            })?;
        }
        ConfigError::check(
            self.model_channels > 0 && self.model_channels % 2 == 0,
            "model_channels",
            || {
                format!(
                    "must be a positive even number, got {}",
                    self.model_channels
                )
            },
        )?;
        ConfigError::check(self.theta > 0.0, "theta", || {
            format!("must be positive, got {}", self.theta)
        })?;
        ConfigError::check(self.axes_dim.len() == 3, "axes_dim", || {
            format!(
                "needs exactly 3 entries (index, row, column), got {}",
                self.axes_dim.len()
            )
        })?;
        ConfigError::check(
            self.axes_dim.iter().all(|&d| d > 0 && d % 2 == 0),
            "axes_dim",
            || format!("entries must be positive and even, got {:?}", self.axes_dim),
        )?;
        let sum: i64 = self.axes_dim.iter().sum();
        ConfigError::check(sum == self.head_dim(), "axes_dim", || {
            format!(
                "entries sum to {sum} but the head width hidden_size / num_attention_heads is {}",
                self.head_dim()
            )
        })?;
        ConfigError::check(self.layernorm_epsilon > 0.0, "layernorm_epsilon", || {
            format!("must be positive, got {}", self.layernorm_epsilon)
        })?;
        for (field, p) in [
            ("hidden_dropout", self.hidden_dropout),
            ("attention_dropout", self.attention_dropout),
        ] {
            ConfigError::check((0.0..1.0).contains(&p), field, || {
                format!("must be in [0, 1), got {p}")
            })?;
        }
        ConfigError::check(self.guidance_scale >= 0.0, "guidance_scale", || {
            format!("must be non-negative, got {}", self.guidance_scale)
        })?;
        Ok(())
    }

    /// Every parameter's name and logical shape, in creation order, computed without allocating.
    pub fn param_layout(&self) -> Vec<ParamSpec> {
        FluxTransformer::param_specs("", self, 1)
    }

    /// Number of parameters, computed from the layout (no weights are allocated).
    pub fn num_params(&self) -> u64 {
        FluxTransformer::num_params(self)
    }
}
