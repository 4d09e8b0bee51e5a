//! The two traits that make the model a parameter of the rest of flux-hpc: [`ModelConfig`], what
//! an architecture's `[model]` table implements, and [`DiffusionModel`], what it builds.

use std::fmt::Debug;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::activations::Activations;
use crate::architecture::{Built, DiffusionBatch, InputError, InputSpec, RootBlock};
use crate::convert::{Layout, Source};
use crate::flops::{Attention, ForwardFlops, Rows};
use crate::tp::{Linear, ParamSpec, ShardedStore, TpContext};
use crate::{Block, ConfigError};

/// One rank's built model, whatever its architecture: its parameters and its forward pass.
pub trait DiffusionModel: Debug {
    /// This rank's parameters (local shards), their specs and the tensor-parallel group.
    fn store(&self) -> &ShardedStore;

    /// As [`DiffusionModel::store`], to load or cast weights.
    fn store_mut(&mut self) -> &mut ShardedStore;

    /// The model's prediction `[B, C, H, W]` (the latents' shape) for `batch`; `train` enables
    /// dropout and layer recomputation. Fails naming the argument that does not fit.
    fn forward(&self, batch: &DiffusionBatch, train: bool) -> Result<Tensor, InputError>;

    /// Recompute each layer's activations in the backward pass instead of keeping them (training
    /// forward passes only).
    fn set_recompute(&self, on: bool);

    /// The units the forward pass gathers and releases, by name, in order: the stem
    /// ([`crate::execution::residency::STEM`]), each block of the `#[layers]` fields under its
    /// state-dict prefix, the head ([`crate::execution::residency::HEAD`]).
    fn layers(&self) -> Vec<String>;

    /// Call `f` on every `Linear` of the model, in declaration order.
    fn visit_linears<'s>(&'s self, f: &mut dyn FnMut(&'s Linear));

    /// The dtype of the weights (frozen ones included), which inputs are cast to.
    fn kind(&self) -> Kind {
        self.store()
            .vs
            .variables()
            .values()
            .next()
            .map_or(Kind::Float, Tensor::kind)
    }
}

/// The `[model]` table of one architecture: everything the trainer, sampler, checkpoints,
/// `check-parallel`, `bench` and `info` need to know about a model, computed from its config
/// without allocating weights. Registering the type in [`crate::architecture::ARCHITECTURES`]
/// makes `[model] architecture = NAME` select it.
pub trait ModelConfig:
    Serialize + DeserializeOwned + Clone + PartialEq + Debug + Send + Sync + 'static
{
    /// The root block the config builds.
    type Root: RootBlock<Config = Self> + 'static;

    /// The name `[model] architecture` selects it by.
    const NAME: &'static str;

    /// A one-line description for `--help` and errors.
    const ABOUT: &'static str;

    /// Check every rule; the error names the field as written in `[model]`.
    fn validate(&self) -> Result<(), ConfigError>;

    /// Whether a tensor-parallel group of `tp` ranks can split the model; the error names
    /// `tensor_parallel_size` and the sizes it must divide.
    fn check_tp_size(&self, tp: usize) -> Result<(), ConfigError>;

    /// Whether the model's layers can work on slices of the sequence (`[parallelism]
    /// sequence_parallel`); the error names the field that rules it out. By default an
    /// architecture cannot: its forward pass must scatter and gather the sequence where its
    /// layers start and stop working on slices.
    fn check_sequence_parallel(&self) -> Result<(), ConfigError> {
        Err(ConfigError::new(
            "sequence_parallel",
            format!(
                "architecture \"{}\" does not support sequence parallelism",
                Self::NAME
            ),
        ))
    }

    /// The inputs the model takes.
    fn inputs(&self) -> InputSpec;

    /// Every parameter's logical name, shape and split for a group of `tp_size` ranks: the root
    /// block's specs.
    fn param_specs(&self, tp_size: i64) -> Vec<ParamSpec> {
        Self::Root::param_specs("", self, tp_size)
    }

    /// Every weight matrix as `(in · out, rows it is applied to)`, each 2-D parameter once.
    fn weight_matrices(&self) -> Vec<(f64, Rows)>;

    /// The attention layers, for the FLOPs count.
    fn attention(&self) -> Attention;

    /// What the training forward pass saves for backward, layer by layer (`flux-hpc plan`).
    fn activations(&self) -> Activations;

    /// Whether training draws dropout masks (which layer recomputation cannot replay).
    fn uses_dropout(&self) -> bool {
        false
    }

    /// The external weight layouts the model is imported from and exported to (`convert`).
    fn weight_layouts(&self) -> Vec<Layout> {
        Vec::new()
    }

    /// Where native parameter `native` lives in `layout` (`None`: not there, or no such layout).
    fn external_source(&self, native: &str, layout: Layout) -> Option<Source> {
        let _ = (native, layout);
        None
    }

    /// diffusers' `config.json` for this model (for the diffusers layout); the error says why
    /// diffusers cannot express the config.
    fn diffusers_config(&self) -> Result<serde_json::Value, String> {
        Err(format!(
            "architecture \"{}\" has no diffusers layout",
            Self::NAME
        ))
    }

    /// `(label, value)` lines describing the shape, for `flux-hpc info`.
    fn summary(&self) -> Vec<(&'static str, String)>;

    /// Validate and build this rank's shards of the model for the tensor-parallel group `tp`, on
    /// `device` in `kind`, initialised in f32 from libtorch's global generator (the same weights
    /// for every group size) and rounded to `kind` weight by weight.
    fn build_as(
        &self,
        device: Device,
        kind: Kind,
        tp: TpContext,
    ) -> Result<Box<dyn DiffusionModel>, ConfigError> {
        Ok(Box::new(Built::<Self::Root>::new_parallel(
            self, device, kind, tp,
        )?))
    }

    /// As [`ModelConfig::build_as`] in f32.
    fn build(&self, device: Device, tp: TpContext) -> Result<Box<dyn DiffusionModel>, ConfigError> {
        self.build_as(device, Kind::Float, tp)
    }
}

/// Forward FLOPs of `config`'s model on `batch` samples of `img` image and `txt` text tokens.
pub fn forward_flops<C: ModelConfig>(config: &C, batch: i64, img: i64, txt: i64) -> ForwardFlops {
    ForwardFlops::of(
        &config.weight_matrices(),
        config.attention(),
        batch,
        img,
        txt,
    )
}
