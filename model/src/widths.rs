//! `Widths`: the sizes every transformer config has, and the sizes derived from them.

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
}
