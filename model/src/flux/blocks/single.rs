//! The single-stream block: text and image tokens as one sequence, attention and MLP in parallel
//! from one fused input projection and into one fused output projection.

use flux_macros::diffusion_block;
use tch::Tensor;

use crate::attention::{attention, Qkv};
use crate::embeddings::Rope;
use crate::flux::blocks::BlockOptions;
use crate::layers::{adaln, dropout};
use crate::tp::{Linear, RmsNorm};
use crate::FluxConfig;

/// One single-stream layer: `transformer.layers.{num_joint_layers + j}`.
#[diffusion_block(config = FluxConfig)]
#[derive(Debug)]
pub struct SingleBlock {
    /// One (shift, scale, gate) triple: `[3D, D]`.
    #[linear(in = config.hidden_size, out = 3 * config.hidden_size, name = "adaln.linear")]
    pub adaln: Linear,
    /// Fused input projection `[3D + M, D]`, rows `[q; k; v; mlp]`; each part split over the group.
    #[linear(in = config.hidden_size, shard = column, bias = config.single_block_bias,
             parts = [q = config.hidden_size, k = config.hidden_size, v = config.hidden_size,
                      mlp = config.mlp_hidden()])]
    pub linear_qkv_fc1: Linear,
    /// Fused output projection `[D, D + M]`, columns `[attention | mlp]`, each split over the group.
    #[linear(out = config.hidden_size, shard = row, bias = config.single_block_bias,
             parts = [attn = config.hidden_size, mlp = config.mlp_hidden()])]
    pub linear_proj_fc2: Linear,
    /// Query scale `[Dh]`.
    #[norm(dim = config.head_dim(), eps = config.layernorm_epsilon, on_shards,
           name = "self_attention.q_layernorm")]
    pub q_layernorm: RmsNorm,
    /// Key scale `[Dh]`.
    #[norm(dim = config.head_dim(), eps = config.layernorm_epsilon, on_shards,
           name = "self_attention.k_layernorm")]
    pub k_layernorm: RmsNorm,
    #[value(BlockOptions::from_config(config))]
    options: BlockOptions,
}

impl SingleBlock {
    /// `x [B, L, D]` (text then image tokens), `vec [B, D]`, `rope` over `L` → `[B, L, D]`.
    pub fn forward(&self, x: &Tensor, vec: &Tensor, rope: &Rope, train: bool) -> Tensor {
        let o = &self.options;
        let [modulation] = adaln::<1>(&self.adaln, vec);
        let fused = self.linear_qkv_fc1.forward(&modulation.modulate(x, o.eps));
        let [q, k, v, mlp]: [Tensor; 4] = self
            .linear_qkv_fc1
            .split_parts(&fused)
            .try_into()
            .expect("parts q, k, v, mlp");
        let qkv = Qkv::from_separate(&q, &k, &v, o.head_dim)
            .normalized(&self.q_layernorm, &self.k_layernorm);
        let attn = attention(&qkv, Some(rope), o.attention_dropout(train));
        let out = self
            .linear_proj_fc2
            .forward(&Tensor::cat(&[attn, mlp.gelu("tanh")], -1));
        modulation.gated_residual(x, &dropout(out, o.hidden_dropout, train))
    }
}
