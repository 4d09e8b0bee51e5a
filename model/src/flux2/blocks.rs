//! FLUX.2's blocks, named as diffusers names their weights (with its fused attention
//! projections `to_qkv` / `to_added_qkv`): the SwiGLU feed-forward, the
//! double-stream block (separate image and text weights, joint attention) and the single-stream
//! "parallel" block (attention and MLP share one fused input and one fused output projection).
//! No block has biases or its own modulation: the model computes the modulation once and every
//! block takes it.

use flux_macros::diffusion_block;
use tch::Tensor;

use crate::attention::{attention, Qkv};
use crate::embeddings::Rope;
use crate::flux2::Flux2Config;
use crate::layers::split_modulations;
use crate::tp::{Linear, RmsNorm};

/// SwiGLU feed-forward `D → [gate; value] (2M) → M → D`.
#[diffusion_block(config = Flux2Config)]
#[derive(Debug)]
pub struct FeedForward {
    /// `[2M, D]`, rows `[gate; value]`, each part split over the group.
    #[linear(in = config.hidden_size(), shard = column, bias = false,
             parts = [gate = config.mlp_hidden(), value = config.mlp_hidden()])]
    pub linear_in: Linear,
    /// `[D, M]`, input split; outputs all-reduced.
    #[linear(in = config.mlp_hidden(), out = config.hidden_size(), shard = row, bias = false)]
    pub linear_out: Linear,
}

impl FeedForward {
    /// `x [B, L, D]` → `[B, L, D]`: `linear_out(silu(gate) · value)`; on a shard, this rank's
    /// slices of both halves.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let [gate, value]: [Tensor; 2] = self
            .linear_in
            .split_parts(&self.linear_in.forward(x))
            .try_into()
            .expect("parts gate, value");
        self.linear_out.forward(&(gate.silu() * value))
    }
}

/// Joint attention of the double-stream block: per stream one fused `[q; k; v]` projection
/// (column-parallel, each part split by heads; diffusers' fused `to_qkv` / `to_added_qkv`, BFL's
/// `qkv`), QK-norm, an output projection (row-parallel).
#[diffusion_block(config = Flux2Config)]
#[derive(Debug)]
pub struct Flux2Attention {
    /// Image `[q; k; v]` `[3D, D]`.
    #[linear(in = config.hidden_size(), shard = column, bias = false,
             parts = [q = config.hidden_size(), k = config.hidden_size(), v = config.hidden_size()])]
    pub to_qkv: Linear,
    /// Image query scale `[Dh]`.
    #[norm(dim = config.attention_head_dim, eps = config.eps, on_shards)]
    pub norm_q: RmsNorm,
    /// Image key scale `[Dh]`.
    #[norm(dim = config.attention_head_dim, eps = config.eps, on_shards)]
    pub norm_k: RmsNorm,
    /// Image output projection `[D, D]`.
    #[linear(in = config.hidden_size(), out = config.hidden_size(), shard = row, bias = false,
             name = "to_out.0")]
    pub to_out: Linear,
    /// Text `[q; k; v]` `[3D, D]`.
    #[linear(in = config.hidden_size(), shard = column, bias = false,
             parts = [q = config.hidden_size(), k = config.hidden_size(), v = config.hidden_size()])]
    pub to_added_qkv: Linear,
    /// Text query scale `[Dh]`.
    #[norm(dim = config.attention_head_dim, eps = config.eps, on_shards)]
    pub norm_added_q: RmsNorm,
    /// Text key scale `[Dh]`.
    #[norm(dim = config.attention_head_dim, eps = config.eps, on_shards)]
    pub norm_added_k: RmsNorm,
    /// Text output projection `[D, D]`.
    #[linear(in = config.hidden_size(), out = config.hidden_size(), shard = row, bias = false)]
    pub to_add_out: Linear,
    #[value(config.attention_head_dim)]
    head_dim: i64,
}

impl Flux2Attention {
    /// Modulated `img [B, Li, D]`, `txt [B, Lt, D]`, `rope` over `Lt + Li` tokens (text first)
    /// → projected outputs `(img, txt)`.
    pub fn forward(&self, img: &Tensor, txt: &Tensor, rope: &Rope) -> (Tensor, Tensor) {
        let dh = self.head_dim;
        // A rank's shard is `[q_r; k_r; v_r]`: the fused split works on it unchanged.
        let img_qkv =
            Qkv::from_fused(&self.to_qkv.forward(img), dh).normalized(&self.norm_q, &self.norm_k);
        let txt_qkv = Qkv::from_fused(&self.to_added_qkv.forward(txt), dh)
            .normalized(&self.norm_added_q, &self.norm_added_k);
        let joint = attention(&Qkv::cat(&[&txt_qkv, &img_qkv]), Some(rope), 0.0);
        // The whole streams' lengths (under sequence parallelism `img` and `txt` are slices).
        let text_len = txt_qkv.tokens();
        (
            self.to_out
                .forward(&joint.narrow(1, text_len, img_qkv.tokens())),
            self.to_add_out.forward(&joint.narrow(1, 0, text_len)),
        )
    }
}

/// One double-stream block: `transformer_blocks.{i}`.
#[diffusion_block(config = Flux2Config)]
#[derive(Debug)]
pub struct Flux2TransformerBlock {
    /// Joint attention.
    #[module]
    pub attn: Flux2Attention,
    /// Image feed-forward.
    #[module]
    pub ff: FeedForward,
    /// Text feed-forward.
    #[module]
    pub ff_context: FeedForward,
    #[value(config.eps)]
    eps: f64,
}

impl Flux2TransformerBlock {
    /// `img [B, Li, D]`, `txt [B, Lt, D]`, the shared modulations `mod_img`, `mod_txt`
    /// `[B, 6D]` (two (shift, scale, gate) triples each), `rope` (text first) → `(img, txt)`.
    pub fn forward(
        &self,
        img: &Tensor,
        txt: &Tensor,
        mod_img: &Tensor,
        mod_txt: &Tensor,
        rope: &Rope,
    ) -> (Tensor, Tensor) {
        let [img_attn, img_ff] = split_modulations::<2>(mod_img);
        let [txt_attn, txt_ff] = split_modulations::<2>(mod_txt);
        let (img_out, txt_out) = self.attn.forward(
            &img_attn.modulate(img, self.eps),
            &txt_attn.modulate(txt, self.eps),
            rope,
        );
        let img = img_attn.gated_residual(img, &img_out);
        let txt = txt_attn.gated_residual(txt, &txt_out);
        let img = img_ff.gated_residual(&img, &self.ff.forward(&img_ff.modulate(&img, self.eps)));
        let txt = txt_ff.gated_residual(
            &txt,
            &self.ff_context.forward(&txt_ff.modulate(&txt, self.eps)),
        );
        (img, txt)
    }
}

/// The single-stream block's attention and MLP in one: `[q; k; v; gate; value]` from one fused
/// column-parallel projection, `[attention | MLP]` into one fused row-parallel projection.
#[diffusion_block(config = Flux2Config)]
#[derive(Debug)]
pub struct Flux2ParallelSelfAttention {
    /// `[3D + 2M, D]`, every part split over the group.
    #[linear(in = config.hidden_size(), shard = column, bias = false,
             parts = [q = config.hidden_size(), k = config.hidden_size(), v = config.hidden_size(),
                      gate = config.mlp_hidden(), value = config.mlp_hidden()])]
    pub to_qkv_mlp_proj: Linear,
    /// Query scale `[Dh]`.
    #[norm(dim = config.attention_head_dim, eps = config.eps, on_shards)]
    pub norm_q: RmsNorm,
    /// Key scale `[Dh]`.
    #[norm(dim = config.attention_head_dim, eps = config.eps, on_shards)]
    pub norm_k: RmsNorm,
    /// `[D, D + M]`, input parts `[attention | MLP]` split over the group.
    #[linear(out = config.hidden_size(), shard = row, bias = false,
             parts = [attention = config.hidden_size(), mlp = config.mlp_hidden()])]
    pub to_out: Linear,
    #[value(config.attention_head_dim)]
    head_dim: i64,
}

impl Flux2ParallelSelfAttention {
    /// Modulated `x [B, L, D]`, `rope` over `L` → `[B, L, D]`.
    pub fn forward(&self, x: &Tensor, rope: &Rope) -> Tensor {
        let fused = self.to_qkv_mlp_proj.forward(x);
        let [q, k, v, gate, value]: [Tensor; 5] = self
            .to_qkv_mlp_proj
            .split_parts(&fused)
            .try_into()
            .expect("parts q, k, v, gate, value");
        let qkv =
            Qkv::from_separate(&q, &k, &v, self.head_dim).normalized(&self.norm_q, &self.norm_k);
        let attended = attention(&qkv, Some(rope), 0.0);
        self.to_out
            .forward(&Tensor::cat(&[attended, gate.silu() * value], -1))
    }
}

/// One single-stream block: `single_transformer_blocks.{i}`.
#[diffusion_block(config = Flux2Config)]
#[derive(Debug)]
pub struct Flux2SingleTransformerBlock {
    /// Attention and MLP.
    #[module]
    pub attn: Flux2ParallelSelfAttention,
    #[value(config.eps)]
    eps: f64,
}

impl Flux2SingleTransformerBlock {
    /// `x [B, Lt + Li, D]`, the shared modulation `[B, 3D]`, `rope` → `[B, Lt + Li, D]`.
    pub fn forward(&self, x: &Tensor, modulation: &Tensor, rope: &Rope) -> Tensor {
        let [m] = split_modulations::<1>(modulation);
        m.gated_residual(x, &self.attn.forward(&m.modulate(x, self.eps), rope))
    }
}
