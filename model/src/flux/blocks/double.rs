//! The joint (double-stream, MMDiT) block: image and text keep their own weights but attend jointly.

use flux_macros::diffusion_block;
use tch::Tensor;

use crate::attention::{attention, Qkv};
use crate::embeddings::Rope;
use crate::flux::blocks::BlockOptions;
use crate::layers::{adaln, dropout, Mlp, MlpDims};
use crate::tp::{Linear, RmsNorm};
use crate::FluxConfig;

/// Joint attention weights: per stream a fused `[q; k; v]` projection (column-parallel, split by
/// heads), QK-norm, and an output projection (row-parallel). `linear_*` act on image tokens,
/// `added_*` on text tokens.
#[diffusion_block(config = FluxConfig)]
#[derive(Debug)]
pub struct JointAttention {
    /// Image `[3D, D]`, rows `[q; k; v]`.
    #[linear(in = config.hidden_size, shard = column, bias = config.add_qkv_bias,
             parts = [q = config.hidden_size, k = config.hidden_size, v = config.hidden_size])]
    pub linear_qkv: Linear,
    /// Text `[3D, D]`, rows `[q; k; v]`.
    #[linear(in = config.hidden_size, shard = column, bias = config.add_qkv_bias,
             parts = [q = config.hidden_size, k = config.hidden_size, v = config.hidden_size])]
    pub added_linear_qkv: Linear,
    /// Image query scale `[Dh]`.
    #[norm(dim = config.head_dim(), eps = config.layernorm_epsilon, on_shards)]
    pub q_layernorm: RmsNorm,
    /// Image key scale `[Dh]`.
    #[norm(dim = config.head_dim(), eps = config.layernorm_epsilon, on_shards)]
    pub k_layernorm: RmsNorm,
    /// Text query scale `[Dh]`.
    #[norm(dim = config.head_dim(), eps = config.layernorm_epsilon, on_shards)]
    pub added_q_layernorm: RmsNorm,
    /// Text key scale `[Dh]`.
    #[norm(dim = config.head_dim(), eps = config.layernorm_epsilon, on_shards)]
    pub added_k_layernorm: RmsNorm,
    /// Image output projection `[D, D]`.
    #[linear(in = config.hidden_size, out = config.hidden_size, shard = row)]
    pub linear_proj: Linear,
    /// Text output projection `[D, D]`.
    #[linear(in = config.hidden_size, out = config.hidden_size, shard = row)]
    pub added_linear_proj: Linear,
    #[value(BlockOptions::from_config(config))]
    options: BlockOptions,
}

impl JointAttention {
    /// Modulated `img [B, Li, D]` and `txt [B, Lt, D]`, `rope` over `Lt + Li` tokens (text first)
    /// → projected attention outputs `(img [B, Li, D], txt [B, Lt, D])`. Under sequence
    /// parallelism both streams come and go as this rank's slices `Li/tp` and `Lt/tp`.
    pub fn forward(
        &self,
        img: &Tensor,
        txt: &Tensor,
        rope: &Rope,
        train: bool,
    ) -> (Tensor, Tensor) {
        let o = &self.options;
        let img_qkv = Qkv::from_fused(&self.linear_qkv.forward(img), o.head_dim)
            .normalized(&self.q_layernorm, &self.k_layernorm);
        let txt_qkv = Qkv::from_fused(&self.added_linear_qkv.forward(txt), o.head_dim)
            .normalized(&self.added_q_layernorm, &self.added_k_layernorm);
        let joint = attention(
            &Qkv::cat(&[&txt_qkv, &img_qkv]),
            Some(rope),
            o.attention_dropout(train),
        );
        // The whole streams' lengths: under sequence parallelism `img` and `txt` are this rank's
        // slices, and the projections gathered the rest.
        let (text_len, image_len) = (txt_qkv.tokens(), img_qkv.tokens());
        let txt_out = joint.narrow(1, 0, text_len);
        let img_out = joint.narrow(1, text_len, image_len);
        (
            self.linear_proj.forward(&img_out),
            self.added_linear_proj.forward(&txt_out),
        )
    }
}

/// One joint layer: `transformer.layers.{i}` for `i < num_joint_layers`.
#[diffusion_block(config = FluxConfig)]
#[derive(Debug)]
pub struct DoubleBlock {
    /// Image modulation, two (shift, scale, gate) triples: `[6D, D]`.
    #[linear(in = config.hidden_size, out = 6 * config.hidden_size, name = "adaln.linear")]
    pub adaln: Linear,
    /// Text modulation `[6D, D]`.
    #[linear(in = config.hidden_size, out = 6 * config.hidden_size, name = "adaln_context.linear")]
    pub adaln_context: Linear,
    /// Joint attention.
    #[module]
    pub self_attention: JointAttention,
    /// Image MLP.
    #[module(config = MlpDims { dim: config.hidden_size, hidden: config.mlp_hidden() })]
    pub mlp: Mlp,
    /// Text MLP.
    #[module(config = MlpDims { dim: config.hidden_size, hidden: config.mlp_hidden() })]
    pub context_mlp: Mlp,
    #[value(BlockOptions::from_config(config))]
    options: BlockOptions,
}

impl DoubleBlock {
    /// `img [B, Li, D]`, `txt [B, Lt, D]`, `vec [B, D]`, `rope` over `Lt + Li` tokens (text first)
    /// → updated `(img, txt)`.
    pub fn forward(
        &self,
        img: &Tensor,
        txt: &Tensor,
        vec: &Tensor,
        rope: &Rope,
        train: bool,
    ) -> (Tensor, Tensor) {
        let o = &self.options;
        let [img_attn, img_mlp] = adaln::<2>(&self.adaln, vec);
        let [txt_attn, txt_mlp] = adaln::<2>(&self.adaln_context, vec);

        let (img_out, txt_out) = self.self_attention.forward(
            &img_attn.modulate(img, o.eps),
            &txt_attn.modulate(txt, o.eps),
            rope,
            train,
        );
        let img = img_attn.gated_residual(img, &dropout(img_out, o.hidden_dropout, train));
        let txt = txt_attn.gated_residual(txt, &dropout(txt_out, o.hidden_dropout, train));

        let branch = |mlp: &Mlp, x: &Tensor| dropout(mlp.forward(x), o.hidden_dropout, train);
        let img = img_mlp.gated_residual(&img, &branch(&self.mlp, &img_mlp.modulate(&img, o.eps)));
        let txt = txt_mlp.gated_residual(
            &txt,
            &branch(&self.context_mlp, &txt_mlp.modulate(&txt, o.eps)),
        );
        (img, txt)
    }
}
