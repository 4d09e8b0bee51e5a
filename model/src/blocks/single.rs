//! The single-stream block: text and image tokens as one sequence, attention and MLP in parallel
//! from one fused input projection and into one fused output projection.

use tch::Tensor;

use crate::attention::{attention, QkNorm, Qkv};
use crate::blocks::BlockOptions;
use crate::embeddings::Rope;
use crate::layers::{dropout, AdaLn, Linear};
use crate::params::ParamPath;
use crate::FluxConfig;

/// One single-stream layer: `transformer.layers.{num_joint_layers + j}`.
#[derive(Debug)]
pub struct SingleBlock<P = Tensor> {
    /// One (shift, scale, gate) triple, `[3D, D]`.
    pub adaln: AdaLn<P>,
    /// Fused input projection `[3D + M, D]`, rows `[q; k; v; mlp_in]`.
    pub linear_qkv_fc1: Linear<P>,
    /// Fused output projection `[D, D + M]`, columns `[attn_out | mlp_hidden]`.
    pub linear_proj_fc2: Linear<P>,
    /// QK-norm scales `[Dh]` (under `self_attention.`).
    pub self_attention: QkNorm<P>,
    options: BlockOptions,
    hidden: i64,
}

impl<P> SingleBlock<P> {
    /// Create the layer's parameters under `p`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, config: &FluxConfig) -> Self {
        let (d, m, bias) = (
            config.hidden_size,
            config.mlp_hidden(),
            config.single_block_bias,
        );
        Self {
            adaln: AdaLn::new(&p.sub("adaln"), d, 1),
            linear_qkv_fc1: Linear::new(&p.sub("linear_qkv_fc1"), d, 3 * d + m, bias),
            linear_proj_fc2: Linear::new(&p.sub("linear_proj_fc2"), d + m, d, bias),
            self_attention: QkNorm::new(
                &p.sub("self_attention"),
                "",
                config.head_dim(),
                config.layernorm_epsilon,
            ),
            options: BlockOptions::from_config(config),
            hidden: d,
        }
    }
}

impl SingleBlock {
    /// `x [B, L, D]` (text then image tokens), `vec [B, D]`, `rope` over `L` → `[B, L, D]`.
    pub fn forward(&self, x: &Tensor, vec: &Tensor, rope: &Rope, train: bool) -> Tensor {
        let o = &self.options;
        let [modulation]: [_; 1] = self.adaln.forward(vec).try_into().expect("one triple");
        let fused = self.linear_qkv_fc1.forward(&modulation.modulate(x, o.eps));
        let mlp_width = fused.size()[2] - 3 * self.hidden;
        let parts = fused.split_with_sizes([3 * self.hidden, mlp_width], -1);
        let qkv = self
            .self_attention
            .forward(Qkv::from_fused(&parts[0], o.heads));
        let attn = attention(&qkv, rope, o.attention_dropout(train));
        let out = self
            .linear_proj_fc2
            .forward(&Tensor::cat(&[attn, parts[1].gelu("tanh")], -1));
        modulation.gated_residual(x, &dropout(out, o.hidden_dropout, train))
    }
}
