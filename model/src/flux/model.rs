//! The Flux model: embedders, joint layers, single layers and the output layer.

use std::cell::Cell;

use flux_macros::diffusion_block;
use tch::{Device, Kind, Tensor};

use crate::architecture::{check_sequence_split, Built};
use crate::blocks::{DoubleBlock, SingleBlock};
use crate::embeddings::{EmbedNd, EmbedderDims, MlpEmbedder, TimeStepEmbedder};
use crate::layers::{adaln_continuous, Halves};
use crate::patchify::{patchify, unpatchify};
use crate::residency::{run_layer, HEAD, STEM};
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
    pub joint_layers: Vec<DoubleBlock>,
    /// `transformer.layers.num_joint_layers ..< num_layers`.
    #[layers(count = config.num_single_layers, start = config.num_joint_layers, name = "transformer.layers")]
    pub single_layers: Vec<SingleBlock>,
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
    /// Recompute each layer's activations in the backward pass (training only).
    #[value(Cell::new(false))]
    recompute: Cell<bool>,
}

impl FluxTransformer {
    /// The model's configuration.
    pub fn config(&self) -> &FluxConfig {
        &self.config
    }

    /// Recompute each layer's activations in the backward pass instead of keeping them
    /// (training forward passes only; layers must be deterministic, i.e. no dropout).
    pub fn set_recompute(&self, on: bool) {
        self.recompute.set(on);
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
        let tp = self.x_embedder.tp();
        let text_len = input.txt.size()[1];
        check_sequence_split(tp, &[("img", rows * cols), ("txt", text_len)])?;

        // The stem: under sequence parallelism the layers work on this rank's slice of each
        // stream.
        let this = self as *const Self;
        let latents = patchify(input.img, p);
        let mut inputs = vec![&latents, input.txt, input.timesteps, input.y];
        inputs.extend(input.guidance);
        let stem = run_layer(STEM, &inputs, 3, false, move |x| {
            // SAFETY: the model outlives the backward pass of any graph it built.
            let this = unsafe { &*this };
            let tp = this.x_embedder.tp();
            let mut vec = this.time_embedder.forward(&x[2]) + this.vector_embedder.forward(&x[3]);
            if let (Some(embedder), Some(g)) = (&this.guidance_embedder, x.get(4)) {
                vec += embedder.forward(g);
            }
            vec![
                tp.scatter_sequence(&this.x_embedder.forward(&x[0])),
                tp.scatter_sequence(&this.context_embedder.forward(&x[1])),
                vec,
            ]
        });
        let [mut img, mut txt, vec] = stem.try_into().expect("three outputs");
        let rope = self
            .pe_embedder
            .forward(&Tensor::cat(&[input.txt_ids, input.img_ids], 1));

        let recomputing = train && self.recompute.get();
        let name = Self::layer_name;
        for (i, layer) in self.joint_layers.iter().enumerate() {
            let (block, rope) = (layer as *const DoubleBlock, rope.clone());
            let out = run_layer(&name(i), &[&img, &txt, &vec], 2, recomputing, move |x| {
                // SAFETY: the model outlives the backward pass of any graph it built.
                let (img, txt) = unsafe { &*block }.forward(&x[0], &x[1], &x[2], &rope, train);
                vec![img, txt]
            });
            [img, txt] = out.try_into().expect("two outputs");
        }
        let mut x = tp.join_sequences(&[&txt, &img]);
        let joint = self.joint_layers.len();
        for (i, layer) in self.single_layers.iter().enumerate() {
            let (block, rope) = (layer as *const SingleBlock, rope.clone());
            let out = run_layer(&name(joint + i), &[&x, &vec], 1, recomputing, move |x| {
                // SAFETY: the model outlives the backward pass of any graph it built.
                vec![unsafe { &*block }.forward(&x[0], &x[1], &rope, train)]
            });
            x = out.into_iter().next().expect("one output");
        }
        let out = run_layer(HEAD, &[&x, &vec], 1, false, move |x| {
            // SAFETY: the model outlives the backward pass of any graph it built.
            let this = unsafe { &*this };
            let tp = this.x_embedder.tp();
            let img = tp.gather_sequence(&x[0]).narrow(1, text_len, rows * cols);
            let eps = this.config.layernorm_epsilon;
            let out = adaln_continuous(&this.norm_out, &img, &x[1], eps, Halves::ShiftScale);
            vec![this.proj_out.forward(&out)]
        });
        let out = out.into_iter().next().expect("one output");
        Ok(unpatchify(&out, p, rows, cols))
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
        self.transformer.forward(input, false)
    }

    /// Predicted velocity `[B, C, H, W]`; `train` enables dropout.
    pub fn forward_t(&self, input: &FluxInput, train: bool) -> Result<Tensor, InputError> {
        self.transformer.forward(input, train)
    }
}
