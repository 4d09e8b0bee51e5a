//! The Flux model: embedders, joint layers, single layers and the output layer.

use flux_macros::diffusion_block;
use tch::{Device, Kind, Tensor};

use crate::architecture::{check_sequence_split, Built};
use crate::embeddings::{EmbedNd, EmbedderDims, MlpEmbedder, TimeStepEmbedder};
use crate::execution::Layers;
use crate::flux::blocks::{DoubleBlock, SingleBlock};
use crate::layers::{adaln_continuous, Halves};
use crate::patchify::{patchify, unpatchify};
use crate::tp::{Linear, TpContext};
use crate::{ConfigError, FluxConfig, FluxInput, InputError};

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

    /// Predicted velocity `[B, C, H, W]` for `input`; `train` enables dropout.
    pub fn forward(&self, input: &FluxInput, train: bool) -> Result<Tensor, InputError> {
        let (rows, cols) = input.check(&self.config)?;
        let p = self.config.patch_size;
        let text_len = input.txt.size()[1];
        check_sequence_split(
            self.x_embedder.tp(),
            &[("img", rows * cols), ("txt", text_len)],
        )?;

        let img = self.x_embedder.forward(&patchify(input.img, p));
        let txt = self.context_embedder.forward(input.txt);
        let mut vec =
            self.time_embedder.forward(input.timesteps) + self.vector_embedder.forward(input.y);
        if let (Some(embedder), Some(g)) = (&self.guidance_embedder, input.guidance) {
            vec += embedder.forward(g);
        }
        let rope = self
            .pe_embedder
            .forward(&Tensor::cat(&[input.txt_ids, input.img_ids], 1));

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
        Ok(unpatchify(&self.proj_out.forward(&out), p, rows, cols))
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

    /// Predicted velocity `[B, C, H, W]` for `input` (inference: no dropout).
    pub fn forward(&self, input: &FluxInput) -> Result<Tensor, InputError> {
        self.forward_t(input, false)
    }

    /// Predicted velocity `[B, C, H, W]`; `train` enables dropout (and recomputation when set).
    pub fn forward_t(&self, input: &FluxInput, train: bool) -> Result<Tensor, InputError> {
        self.run(train, |t| t.forward(input, train))
    }
}
