//! The Flux model: embedders, joint layers, single layers and the output layer.

use flux_macros::diffusion_block;
use tch::{Device, Kind, Tensor};

use crate::architecture::Built;
use crate::embeddings::{
    text_position_ids, token_grid_ids, EmbedNd, EmbedderDims, MlpEmbedder, TimeStepEmbedder,
};
use crate::execution::Layers;
use crate::flux::blocks::{DoubleBlock, SingleBlock};
use crate::layers::{adaln_continuous, Halves};
use crate::patchify::{patchify, unpatchify};
use crate::tp::{Linear, TpContext};
use crate::{ConfigError, FluxConfig};

/// Flux's module tree. State-dict names: `x_embedder`, `context_embedder`, `time_embedder`,
/// `vector_embedder`, `guidance_embedder`, `transformer.layers.{i}` (joint layers first, then
/// single), `norm_out`, `proj_out`. The embedders and the output layer are replicated.
#[diffusion_block(config = FluxConfig)]
#[derive(Debug)]
pub struct FluxTransformer {
    /// Image tokens `C·p²` → `D`.
    #[linear(in = config.token_channels(), out = config.hidden_size)]
    pub x_embedder: Linear,
    /// Text states `context_dim` → `D`.
    #[linear(in = config.context_dim, out = config.hidden_size)]
    pub context_embedder: Linear,
    /// Timestep sinusoids → `D`.
    #[module(config = EmbedderDims { in_dim: config.model_channels, hidden: config.hidden_size, bias: true })]
    pub time_embedder: TimeStepEmbedder,
    /// Pooled text vector → `D`.
    #[module(config = EmbedderDims { in_dim: config.vec_in_dim, hidden: config.hidden_size, bias: true })]
    pub vector_embedder: MlpEmbedder,
    /// Guidance-strength sinusoids → `D`, when `guidance_embed`.
    #[module(config = EmbedderDims { in_dim: config.model_channels, hidden: config.hidden_size, bias: true },
             when = config.guidance_embed)]
    pub guidance_embedder: Option<TimeStepEmbedder>,
    /// `transformer.layers.0 ..< num_joint_layers`.
    #[layers(count = config.num_joint_layers, name = "transformer.layers")]
    pub joint_layers: Layers<DoubleBlock>,
    /// `transformer.layers.num_joint_layers ..< num_layers`.
    #[layers(count = config.num_single_layers, start = config.num_joint_layers, name = "transformer.layers")]
    pub single_layers: Layers<SingleBlock>,
    /// Output modulation `[2D, D]`, rows `[shift; scale]`.
    #[linear(in = config.hidden_size, out = 2 * config.hidden_size, name = "norm_out.linear")]
    pub norm_out: Linear,
    /// Projection to `C·p²` channels per token.
    #[linear(in = config.hidden_size, out = config.token_channels())]
    pub proj_out: Linear,
    #[value(EmbedNd::new(config.theta, &config.axes_dim, config.rotary_interleaved))]
    pe_embedder: EmbedNd,
    #[value(config.clone())]
    config: FluxConfig,
}

impl FluxTransformer {
    /// The model's configuration.
    pub fn config(&self) -> &FluxConfig {
        &self.config
    }

    /// The name layer `i` runs under (joint layers first, then single ones): its parameters'
    /// state-dict prefix.
    pub fn layer_name(i: usize) -> String {
        format!("transformer.layers.{i}")
    }

    /// `latents [B, C, H, W]`, `text [B, S, context_dim]` (T5), `pooled [B, vec_in_dim]`
    /// (CLIP), `timesteps [B]` (σ in `[0, 1]`), `guidance [B]` when the config embeds it →
    /// predicted velocity `[B, C, H, W]`; `train` enables dropout. Image tokens sit at
    /// `(0, row, column)` of the token grid, text tokens at 0 (FLUX.1's positions).
    pub fn forward(
        &self,
        latents: &Tensor,
        text: &Tensor,
        pooled: &Tensor,
        timesteps: &Tensor,
        guidance: Option<&Tensor>,
        train: bool,
    ) -> Tensor {
        let p = self.config.patch_size;
        let (b, _, h, w) = latents.size4().expect("latents must be [B, C, H, W]");
        let (rows, cols) = (h / p, w / p);
        let text_len = text.size()[1];
        let device = latents.device();

        let img = self.x_embedder.forward(&patchify(latents, p));
        let txt = self.context_embedder.forward(text);
        let mut vec = self.time_embedder.forward(timesteps) + self.vector_embedder.forward(pooled);
        if let (Some(embedder), Some(g)) = (&self.guidance_embedder, guidance) {
            vec += embedder.forward(g);
        }
        let ids = Tensor::cat(
            &[
                text_position_ids(b, text_len, device),
                token_grid_ids(b, rows, cols, device),
            ],
            1,
        );
        let rope = self.pe_embedder.forward(&ids);

        let (img, txt) = self.joint_layers.run(
            (img, txt),
            (&vec, &rope),
            move |layer, (img, txt), (vec, rope)| layer.forward(&img, &txt, vec, rope, train),
        );
        let x = self.single_layers.run(
            Tensor::cat(&[txt, img], 1),
            (&vec, &rope),
            move |layer, x, (vec, rope)| layer.forward(&x, vec, rope, train),
        );

        let img = x.narrow(1, text_len, rows * cols);
        let eps = self.config.layernorm_epsilon;
        let out = adaln_continuous(&self.norm_out, &img, &vec, eps, Halves::ShiftScale);
        unpatchify(&self.proj_out.forward(&out), p, rows, cols)
    }
}

/// A Flux model with its weights: this rank's parameter store and the module tree using it.
pub type Flux = Built<FluxTransformer>;

impl Built<FluxTransformer> {
    /// Validate `config` and allocate a freshly initialised single-rank model on `device` (f32).
    pub fn new(config: &FluxConfig, device: Device) -> Result<Self, ConfigError> {
        Self::new_parallel(config, device, Kind::Float, TpContext::single())
    }

    /// The model's configuration.
    pub fn config(&self) -> &FluxConfig {
        self.transformer.config()
    }
}
