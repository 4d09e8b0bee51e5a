//! `Widths`: the sizes every transformer config has, the sizes derived from them, and the rules
//! they share.

use crate::ConfigError;

/// Largest accepted width (`hidden_size`, `context_dim`, …): 64 Ki, far above any real model.
pub(crate) const MAX_WIDTH: i64 = 1 << 16;

/// Largest accepted number of layers of one kind.
pub(crate) const MAX_LAYERS: usize = 1024;

/// Model width, heads, MLP ratio and patching of a transformer over latent images.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Widths {
    /// Model width `D`.
    pub hidden_size: i64,
    /// Attention heads `H`.
    pub num_attention_heads: i64,
    /// MLP width as a multiple of `D`.
    pub mlp_ratio: f64,
    /// Latent channels `C`.
    pub in_channels: i64,
    /// Patch side `p`.
    pub patch_size: i64,
}

impl Widths {
    /// Head width `D / H`.
    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_attention_heads
    }

    /// MLP hidden width `mlp_ratio · D`.
    pub fn mlp_hidden(&self) -> i64 {
        (self.hidden_size as f64 * self.mlp_ratio).round() as i64
    }

    /// Features per token entering the model: `C · p²`.
    pub fn token_channels(&self) -> i64 {
        self.in_channels * self.patch_size * self.patch_size
    }

    /// Check the rules every transformer shares: positive, bounded sizes; heads dividing the
    /// width; an integral MLP width. The error names the field as written in `[model]`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("in_channels", self.in_channels),
            ("patch_size", self.patch_size),
        ] {
            positive_width(field, value)?;
        }
        ConfigError::check(
            self.hidden_size % self.num_attention_heads == 0,
            "num_attention_heads",
            || {
                format!(
                    "{} heads do not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                )
            },
        )?;
        let mlp = self.hidden_size as f64 * self.mlp_ratio;
        ConfigError::check(
            self.mlp_ratio > 0.0 && self.mlp_ratio <= 64.0 && mlp.fract() == 0.0,
            "mlp_ratio",
            || {
                format!("mlp_ratio must be in (0, 64] with mlp_ratio × hidden_size an integer, got {mlp}")
            },
        )
    }
}

/// `value` must be in `1..=MAX_WIDTH` (far above any real model; keeps every size product, such
/// as parameter counts, in range).
pub(crate) fn positive_width(field: &str, value: i64) -> Result<(), ConfigError> {
    ConfigError::check(value > 0, field, || {
        format!("must be positive, got {value}")
    })?;
    ConfigError::check(value <= MAX_WIDTH, field, || {
        format!("must be at most {MAX_WIDTH}, got {value}")
    })
}
