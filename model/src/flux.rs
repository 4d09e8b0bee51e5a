//! The Flux model: embedders, joint layers, single layers and the output layer.

use tch::nn::{self, VarStore};
use tch::{Device, Tensor};

use crate::blocks::{DoubleBlock, FinalLayer, SingleBlock};
use crate::embeddings::{EmbedNd, MlpEmbedder, TimeStepEmbedder};
use crate::layers::Linear;
use crate::params::ParamPath;
use crate::patchify::{patchify, unpatchify};
use crate::{ConfigError, FluxConfig, FluxInput, InputError};

/// Flux's module tree, generic over the parameter type (see [`crate::params`]).
///
/// State-dict names: `x_embedder`, `context_embedder`, `time_embedder`, `vector_embedder`,
/// `guidance_embedder`, `transformer.layers.{i}` (joint layers first, then single), `norm_out`,
/// `proj_out`.
#[derive(Debug)]
pub struct FluxTransformer<P = Tensor> {
    /// Image tokens `C·p²` → `D`.
    pub x_embedder: Linear<P>,
    /// Text states `context_dim` → `D`.
    pub context_embedder: Linear<P>,
    /// Timestep sinusoids → `D`.
    pub time_embedder: TimeStepEmbedder<P>,
    /// Pooled text vector → `D`.
    pub vector_embedder: MlpEmbedder<P>,
    /// Guidance-strength sinusoids → `D`, when `guidance_embed`.
    pub guidance_embedder: Option<TimeStepEmbedder<P>>,
    /// `transformer.layers.0 ..< num_joint_layers`.
    pub joint_layers: Vec<DoubleBlock<P>>,
    /// `transformer.layers.num_joint_layers ..< num_layers`.
    pub single_layers: Vec<SingleBlock<P>>,
    /// `norm_out` and `proj_out`.
    pub final_layer: FinalLayer<P>,
}

impl<P> FluxTransformer<P> {
    /// Create every parameter of `config` below `p` (the config must be valid).
    pub fn new<T: ParamPath<Param = P>>(p: &T, config: &FluxConfig) -> Self {
        let d = config.hidden_size;
        let layers = p.sub("transformer").sub("layers");
        let layer = |i: usize| layers.sub(&i.to_string());
        Self {
            x_embedder: Linear::new(&p.sub("x_embedder"), config.token_channels(), d, true),
            context_embedder: Linear::new(&p.sub("context_embedder"), config.context_dim, d, true),
            time_embedder: TimeStepEmbedder::new(&p.sub("time_embedder"), config.model_channels, d),
            vector_embedder: MlpEmbedder::new(&p.sub("vector_embedder"), config.vec_in_dim, d),
            guidance_embedder: config.guidance_embed.then(|| {
                TimeStepEmbedder::new(&p.sub("guidance_embedder"), config.model_channels, d)
            }),
            joint_layers: (0..config.num_joint_layers)
                .map(|i| DoubleBlock::new(&layer(i), config))
                .collect(),
            single_layers: (config.num_joint_layers..config.num_layers())
                .map(|i| SingleBlock::new(&layer(i), config))
                .collect(),
            final_layer: FinalLayer::new(p, config),
        }
    }
}

/// A Flux model with its weights: the `VarStore` that owns them and the module tree using them.
#[derive(Debug)]
pub struct Flux {
    /// Owner of every parameter, keyed by state-dict name.
    pub vs: VarStore,
    /// The modules.
    pub transformer: FluxTransformer,
    config: FluxConfig,
    pe_embedder: EmbedNd,
}

impl Flux {
    /// Validate `config` and allocate a freshly initialised model on `device` (f32).
    pub fn new(config: &FluxConfig, device: Device) -> Result<Self, ConfigError> {
        config.validate()?;
        let vs = VarStore::new(device);
        let transformer = FluxTransformer::new(&vs.root(), config);
        let pe_embedder = EmbedNd::new(config.theta, &config.axes_dim, config.rotary_interleaved);
        Ok(Self {
            vs,
            transformer,
            config: config.clone(),
            pe_embedder,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &FluxConfig {
        &self.config
    }

    /// Number of parameters held: all, or only those that currently require gradients.
    pub fn get_num_params(&self, trainable_only: bool) -> u64 {
        self.vs
            .variables()
            .values()
            .filter(|t| !trainable_only || t.requires_grad())
            .map(|t| t.numel() as u64)
            .sum()
    }

    /// Predicted velocity `[B, C, H, W]` for `input` (inference: no dropout).
    pub fn forward(&self, input: &FluxInput) -> Result<Tensor, InputError> {
        self.forward_t(input, false)
    }

    /// Predicted velocity `[B, C, H, W]`; `train` enables dropout.
    pub fn forward_t(&self, input: &FluxInput, train: bool) -> Result<Tensor, InputError> {
        let (rows, cols) = input.check(&self.config)?;
        let net = &self.transformer;
        let p = self.config.patch_size;

        let mut img = net.x_embedder.forward(&patchify(input.img, p));
        let mut txt = net.context_embedder.forward(input.txt);
        let mut vec =
            net.time_embedder.forward(input.timesteps) + net.vector_embedder.forward(input.y);
        if let (Some(embedder), Some(g)) = (&net.guidance_embedder, input.guidance) {
            vec += embedder.forward(g);
        }
        let rope = self
            .pe_embedder
            .forward(&Tensor::cat(&[input.txt_ids, input.img_ids], 1));

        for layer in &net.joint_layers {
            (img, txt) = layer.forward(&img, &txt, &vec, &rope, train);
        }
        let text_len = txt.size()[1];
        let mut x = Tensor::cat(&[txt, img], 1);
        for layer in &net.single_layers {
            x = layer.forward(&x, &vec, &rope, train);
        }
        let img = x.narrow(1, text_len, rows * cols);
        Ok(unpatchify(
            &net.final_layer.forward(&img, &vec),
            p,
            rows,
            cols,
        ))
    }

    /// The root path of the parameters, for loaders and optimisers.
    pub fn root(&self) -> nn::Path<'_> {
        self.vs.root()
    }
}
