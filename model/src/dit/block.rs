//! The DiT block with adaLN-Zero conditioning: attention and MLP over image tokens, each branch
//! scaled by a gate that starts at zero, so every block starts as the identity.

use flux_macros::diffusion_block;
use tch::Tensor;

use crate::attention::{attention, Qkv};
use crate::dit::DitConfig;
use crate::layers::{adaln, Mlp, MlpDims};
use crate::tp::Linear;
use crate::ModelConfig;

/// One DiT block: `blocks.{i}`.
#[diffusion_block(config = DitConfig)]
#[derive(Debug)]
pub struct DitBlock {
    /// adaLN-Zero modulation, two (shift, scale, gate) triples, zero-initialised: `[6D, D]`.
    #[linear(in = config.hidden_size, out = 6 * config.hidden_size, init = zeros, name = "adaln.linear")]
    pub adaln: Linear,
    /// Fused `[q; k; v]` projection, split by heads.
    #[linear(in = config.hidden_size, shard = column,
             parts = [q = config.hidden_size, k = config.hidden_size, v = config.hidden_size])]
    pub linear_qkv: Linear,
    /// Attention output projection.
    #[linear(in = config.hidden_size, out = config.hidden_size, shard = row)]
    pub linear_proj: Linear,
    /// Feed-forward branch.
    #[module(config = MlpDims { dim: config.hidden_size, hidden: config.widths().mlp_hidden() })]
    pub mlp: Mlp,
    #[value(config.widths().head_dim())]
    head_dim: i64,
    #[value(config.layernorm_epsilon)]
    eps: f64,
}

impl DitBlock {
    /// `x [B, N, D]` image tokens, `c [B, D]` conditioning → `[B, N, D]`.
    pub fn forward(&self, x: &Tensor, c: &Tensor) -> Tensor {
        let [attn, ff] = adaln::<2>(&self.adaln, c);
        let qkv = Qkv::from_fused(
            &self.linear_qkv.forward(&attn.modulate(x, self.eps)),
            self.head_dim,
        );
        let x = attn.gated_residual(x, &self.linear_proj.forward(&attention(&qkv, None, 0.0)));
        ff.gated_residual(&x, &self.mlp.forward(&ff.modulate(&x, self.eps)))
    }
}
