//! The joint (double-stream, MMDiT) block: image and text keep their own weights but attend jointly.

use tch::Tensor;

use crate::attention::{attention, QkNorm, Qkv};
use crate::blocks::BlockOptions;
use crate::embeddings::Rope;
use crate::layers::{dropout, AdaLn, Linear, Mlp};
use crate::params::ParamPath;
use crate::FluxConfig;

/// Joint attention weights: one fused `[q; k; v]` projection, QK-norm and output projection per
/// stream (`linear_*` for image tokens, `added_linear_*` for text tokens).
#[derive(Debug)]
pub struct JointAttention<P = Tensor> {
    /// Image `[3D, D]`, rows `[q; k; v]`.
    pub linear_qkv: Linear<P>,
    /// Text `[3D, D]`, rows `[q; k; v]`.
    pub added_linear_qkv: Linear<P>,
    /// Image QK-norm scales `[Dh]`.
    pub norm: QkNorm<P>,
    /// Text QK-norm scales `[Dh]`.
    pub added_norm: QkNorm<P>,
    /// Image output projection `[D, D]`.
    pub linear_proj: Linear<P>,
    /// Text output projection `[D, D]`.
    pub added_linear_proj: Linear<P>,
}

impl<P> JointAttention<P> {
    fn new<T: ParamPath<Param = P>>(p: &T, config: &FluxConfig) -> Self {
        let (d, bias, eps) = (
            config.hidden_size,
            config.add_qkv_bias,
            config.layernorm_epsilon,
        );
        Self {
            linear_qkv: Linear::new(&p.sub("linear_qkv"), d, 3 * d, bias),
            added_linear_qkv: Linear::new(&p.sub("added_linear_qkv"), d, 3 * d, bias),
            norm: QkNorm::new(p, "", config.head_dim(), eps),
            added_norm: QkNorm::new(p, "added_", config.head_dim(), eps),
            linear_proj: Linear::new(&p.sub("linear_proj"), d, d, true),
            added_linear_proj: Linear::new(&p.sub("added_linear_proj"), d, d, true),
        }
    }
}

/// One joint layer: `transformer.layers.{i}` for `i < num_joint_layers`.
#[derive(Debug)]
pub struct DoubleBlock<P = Tensor> {
    /// Image modulation: two (shift, scale, gate) triples, `[6D, D]`.
    pub adaln: AdaLn<P>,
    /// Text modulation, `[6D, D]`.
    pub adaln_context: AdaLn<P>,
    /// Joint attention weights.
    pub self_attention: JointAttention<P>,
    /// Image MLP.
    pub mlp: Mlp<P>,
    /// Text MLP.
    pub context_mlp: Mlp<P>,
    options: BlockOptions,
}

impl<P> DoubleBlock<P> {
    /// Create the layer's parameters under `p`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, config: &FluxConfig) -> Self {
        let (d, m) = (config.hidden_size, config.mlp_hidden());
        Self {
            adaln: AdaLn::new(&p.sub("adaln"), d, 2),
            adaln_context: AdaLn::new(&p.sub("adaln_context"), d, 2),
            self_attention: JointAttention::new(&p.sub("self_attention"), config),
            mlp: Mlp::new(&p.sub("mlp"), d, m),
            context_mlp: Mlp::new(&p.sub("context_mlp"), d, m),
            options: BlockOptions::from_config(config),
        }
    }
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
        let attn = &self.self_attention;
        let [img_attn_mod, img_mlp_mod]: [_; 2] =
            self.adaln.forward(vec).try_into().expect("two triples");
        let [txt_attn_mod, txt_mlp_mod]: [_; 2] = self
            .adaln_context
            .forward(vec)
            .try_into()
            .expect("two triples");

        let img_qkv = attn.linear_qkv.forward(&img_attn_mod.modulate(img, o.eps));
        let txt_qkv = attn
            .added_linear_qkv
            .forward(&txt_attn_mod.modulate(txt, o.eps));
        let img_qkv = attn.norm.forward(Qkv::from_fused(&img_qkv, o.heads));
        let txt_qkv = attn.added_norm.forward(Qkv::from_fused(&txt_qkv, o.heads));
        let joint = attention(
            &Qkv::cat(&[&txt_qkv, &img_qkv]),
            rope,
            o.attention_dropout(train),
        );
        let txt_len = txt.size()[1];
        let txt_out = joint.narrow(1, 0, txt_len);
        let img_out = joint.narrow(1, txt_len, img.size()[1]);

        let branch = |proj: &Linear, x: &Tensor| dropout(proj.forward(x), o.hidden_dropout, train);
        let img = img_attn_mod.gated_residual(img, &branch(&attn.linear_proj, &img_out));
        let txt = txt_attn_mod.gated_residual(txt, &branch(&attn.added_linear_proj, &txt_out));

        let mlp = |m: &Mlp, x: &Tensor| dropout(m.forward(x), o.hidden_dropout, train);
        let img =
            img_mlp_mod.gated_residual(&img, &mlp(&self.mlp, &img_mlp_mod.modulate(&img, o.eps)));
        let txt = txt_mlp_mod.gated_residual(
            &txt,
            &mlp(&self.context_mlp, &txt_mlp_mod.modulate(&txt, o.eps)),
        );
        (img, txt)
    }
}
