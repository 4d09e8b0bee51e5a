//! The DiT model: patch embedding plus fixed 2D positions, timestep and vector conditioning,
//! adaLN-Zero blocks, and a zero-initialised output layer.

use flux_macros::diffusion_block;
use tch::Tensor;

use crate::architecture::Built;
use crate::dit::{sincos_2d, DitBlock, DitConfig};
use crate::embeddings::{EmbedderDims, MlpEmbedder, TimeStepEmbedder};
use crate::execution::Layers;
use crate::layers::{adaln_continuous, Halves};
use crate::patchify::{patchify, unpatchify};
use crate::tp::Linear;
use crate::ModelConfig;

/// DiT's module tree (`x_embedder`, `t_embedder`, `y_embedder`, `blocks.{i}`, `final_layer`).
#[diffusion_block(config = DitConfig)]
#[derive(Debug)]
pub struct DitTransformer {
    /// Patch embedding `C·p²` → `D` (a `p×p`-stride convolution written as a linear on patches).
    #[linear(in = config.widths().token_channels(), out = config.hidden_size)]
    pub x_embedder: Linear,
    /// Timestep sinusoids → `D`.
    #[module(config = EmbedderDims { in_dim: config.frequency_embedding_size, hidden: config.hidden_size, bias: true })]
    pub t_embedder: TimeStepEmbedder,
    /// Conditioning vector → `D`.
    #[module(config = EmbedderDims { in_dim: config.cond_dim, hidden: config.hidden_size, bias: true })]
    pub y_embedder: MlpEmbedder,
    /// The blocks.
    #[layers(count = config.depth, name = "blocks")]
    pub blocks: Layers<DitBlock>,
    /// Output modulation `[shift; scale]`, zero-initialised.
    #[linear(in = config.hidden_size, out = 2 * config.hidden_size, init = zeros, name = "final_layer.adaln.linear")]
    pub final_adaln: Linear,
    /// Output projection to `C·p²`, zero-initialised.
    #[linear(in = config.hidden_size, out = config.widths().token_channels(), init = zeros, name = "final_layer.linear")]
    pub final_linear: Linear,
    #[value(config.clone())]
    config: DitConfig,
}

impl DitTransformer {
    /// The configuration.
    pub fn config(&self) -> &DitConfig {
        &self.config
    }

    /// The name block `i` runs under: its parameters' state-dict prefix.
    pub fn layer_name(i: usize) -> String {
        format!("blocks.{i}")
    }

    /// `x [B, C, H, W]`, `t [B]` in `[0, 1]` (the noise level), `y [B, cond_dim]` → the
    /// prediction `[B, C, H, W]`.
    pub fn forward(&self, x: &Tensor, t: &Tensor, y: &Tensor) -> Tensor {
        let (p, d) = (self.config.patch_size, self.config.hidden_size);
        let (_, _, h, w) = x.size4().expect("x must be [B, C, H, W]");
        let (rows, cols) = (h / p, w / p);

        // The fixed positions join the tokens in the weights' dtype (bf16 stays bf16).
        let patches = self.x_embedder.forward(&patchify(x, p));
        let tokens = &patches + sincos_2d(rows, cols, d, x.device()).to_kind(patches.kind());
        let c = self.t_embedder.forward(t) + self.y_embedder.forward(y);

        let tokens = self
            .blocks
            .run(tokens, &c, |block, x, c| block.forward(&x, c));

        let eps = self.config.layernorm_epsilon;
        let out = adaln_continuous(&self.final_adaln, &tokens, &c, eps, Halves::ShiftScale);
        unpatchify(&self.final_linear.forward(&out), p, rows, cols)
    }
}

/// A DiT with its weights on this rank.
pub type Dit = Built<DitTransformer>;
