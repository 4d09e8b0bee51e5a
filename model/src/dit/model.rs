//! The DiT model: patch embedding plus fixed 2D positions, timestep and vector conditioning,
//! adaLN-Zero blocks, and a zero-initialised output layer.

use flux_macros::diffusion_block;
use tch::{Device, Tensor};

use crate::dit::{sincos_2d, DitBlock, DitConfig};
use crate::embeddings::{EmbedderDims, MlpEmbedder, TimeStepEmbedder};
use crate::layers::adaln_continuous;
use crate::patchify::{patchify, unpatchify};
use crate::tp::{check_tp_size, Linear, ShardedStore, TpContext};
use crate::ConfigError;

/// DiT's module tree (`x_embedder`, `t_embedder`, `y_embedder`, `blocks.{i}`, `final_layer`).
#[diffusion_block(config = DitConfig)]
#[derive(Debug)]
pub struct DitTransformer {
    /// Patch embedding `C·p²` → `D` (a `p×p`-stride convolution written as a linear on patches).
    #[linear(in = config.widths.token_channels(), out = config.widths.hidden_size)]
    pub x_embedder: Linear,
    /// Timestep sinusoids → `D`.
    #[module(config = EmbedderDims { in_dim: config.frequency_embedding_size, hidden: config.widths.hidden_size })]
    pub t_embedder: TimeStepEmbedder,
    /// Conditioning vector → `D`.
    #[module(config = EmbedderDims { in_dim: config.cond_dim, hidden: config.widths.hidden_size })]
    pub y_embedder: MlpEmbedder,
    /// The blocks.
    #[layers(count = config.depth, name = "blocks")]
    pub blocks: Vec<DitBlock>,
    /// Output modulation `[shift; scale]`, zero-initialised.
    #[linear(in = config.widths.hidden_size, out = 2 * config.widths.hidden_size, init = zeros, name = "final_layer.adaln.linear")]
    pub final_adaln: Linear,
    /// Output projection to `C·p²`, zero-initialised.
    #[linear(in = config.widths.hidden_size, out = config.widths.token_channels(), init = zeros, name = "final_layer.linear")]
    pub final_linear: Linear,
    #[value(config.clone())]
    config: DitConfig,
}

impl DitTransformer {
    /// `x [B, C, H, W]`, `t [B]` in `[0, 1]` (DDPM step / 1000), `y [B, cond_dim]` → the
    /// objective's prediction `[B, C, H, W]`.
    pub fn forward(&self, x: &Tensor, t: &Tensor, y: &Tensor) -> Tensor {
        let (p, d) = (
            self.config.widths.patch_size,
            self.config.widths.hidden_size,
        );
        let (_, _, h, w) = x.size4().expect("x must be [B, C, H, W]");
        let (rows, cols) = (h / p, w / p);
        let mut tokens =
            self.x_embedder.forward(&patchify(x, p)) + sincos_2d(rows, cols, d, x.device());
        let c = self.t_embedder.forward(t) + self.y_embedder.forward(y);
        for block in &self.blocks {
            tokens = block.forward(&tokens, &c);
        }
        let out = adaln_continuous(
            &self.final_adaln,
            &tokens,
            &c,
            self.config.layernorm_epsilon,
        );
        unpatchify(&self.final_linear.forward(&out), p, rows, cols)
    }
}

/// A DiT with its weights on this rank.
#[derive(Debug)]
pub struct Dit {
    /// This rank's parameters.
    pub store: ShardedStore,
    /// The modules.
    pub transformer: DitTransformer,
}

impl Dit {
    /// Validate `config` and build this rank's shards for the group `tp` on `device`.
    pub fn new_parallel(
        config: &DitConfig,
        device: Device,
        tp: TpContext,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        check_tp_size(
            config.widths.num_attention_heads,
            config.widths.mlp_hidden(),
            tp.size(),
        )?;
        let specs = DitTransformer::param_specs("", config, tp.size() as i64);
        let (store, transformer) = ShardedStore::build(device, tp, specs, |root, tp| {
            DitTransformer::new(root, config, tp)
        });
        Ok(Self { store, transformer })
    }
}
