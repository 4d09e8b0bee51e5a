//! The DiT model: patch embedding plus fixed 2D positions, timestep and vector conditioning,
//! adaLN-Zero blocks, and a zero-initialised output layer.

use std::cell::Cell;

use flux_macros::diffusion_block;
use tch::Tensor;

use crate::architecture::Built;
use crate::dit::{sincos_2d, DitBlock, DitConfig};
use crate::embeddings::{EmbedderDims, MlpEmbedder, TimeStepEmbedder};
use crate::layers::{adaln_continuous, Halves};
use crate::patchify::{patchify, unpatchify};
use crate::residency::{run_layer, HEAD, STEM};
use crate::tp::Linear;

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
    pub blocks: Vec<DitBlock>,
    /// Output modulation `[shift; scale]`, zero-initialised.
    #[linear(in = config.hidden_size, out = 2 * config.hidden_size, init = zeros, name = "final_layer.adaln.linear")]
    pub final_adaln: Linear,
    /// Output projection to `C·p²`, zero-initialised.
    #[linear(in = config.hidden_size, out = config.widths().token_channels(), init = zeros, name = "final_layer.linear")]
    pub final_linear: Linear,
    #[value(config.clone())]
    config: DitConfig,
    /// Recompute each block's activations in the backward pass (training only).
    #[value(Cell::new(false))]
    recompute: Cell<bool>,
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

    /// Recompute each block's activations in the backward pass instead of keeping them
    /// (training forward passes only).
    pub fn set_recompute(&self, on: bool) {
        self.recompute.set(on);
    }

    /// `x [B, C, H, W]`, `t [B]` in `[0, 1]` (the noise level), `y [B, cond_dim]` → the
    /// prediction `[B, C, H, W]` (inference).
    pub fn forward(&self, x: &Tensor, t: &Tensor, y: &Tensor) -> Tensor {
        self.forward_t(x, t, y, false)
    }

    /// As [`DitTransformer::forward`]; `train` turns on block recomputation when it is set.
    pub fn forward_t(&self, x: &Tensor, t: &Tensor, y: &Tensor, train: bool) -> Tensor {
        let (p, d) = (self.config.patch_size, self.config.hidden_size);
        let (_, _, h, w) = x.size4().expect("x must be [B, C, H, W]");
        let (rows, cols) = (h / p, w / p);
        // The stem: under sequence parallelism the blocks work on this rank's slice of the
        // tokens.
        let this = self as *const Self;
        let inputs = [&patchify(x, p), t, y];
        let stem = run_layer(STEM, &inputs, 2, false, move |x| {
            // SAFETY: the model outlives the backward pass of any graph it built.
            let this = unsafe { &*this };
            let tokens = this.x_embedder.forward(&x[0]) + sincos_2d(rows, cols, d, x[0].device());
            let c = this.t_embedder.forward(&x[1]) + this.y_embedder.forward(&x[2]);
            vec![this.x_embedder.tp().scatter_sequence(&tokens), c]
        });
        let [mut tokens, c] = stem.try_into().expect("two outputs");
        let recomputing = train && self.recompute.get();
        for (i, block) in self.blocks.iter().enumerate() {
            let block = block as *const DitBlock;
            let out = run_layer(
                &Self::layer_name(i),
                &[&tokens, &c],
                1,
                recomputing,
                move |x| {
                    // SAFETY: the model outlives the backward pass of any graph it built.
                    vec![unsafe { &*block }.forward(&x[0], &x[1])]
                },
            );
            tokens = out.into_iter().next().expect("one output");
        }
        let out = run_layer(HEAD, &[&tokens, &c], 1, false, move |x| {
            // SAFETY: the model outlives the backward pass of any graph it built.
            let this = unsafe { &*this };
            let tokens = this.x_embedder.tp().gather_sequence(&x[0]);
            let eps = this.config.layernorm_epsilon;
            let out = adaln_continuous(&this.final_adaln, &tokens, &x[1], eps, Halves::ShiftScale);
            vec![this.final_linear.forward(&out)]
        });
        let out = out.into_iter().next().expect("one output");
        unpatchify(&out, p, rows, cols)
    }
}

/// A DiT with its weights on this rank.
pub type Dit = Built<DitTransformer>;
