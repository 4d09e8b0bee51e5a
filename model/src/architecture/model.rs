//! The traits that make the model a parameter of the rest of flux-hpc: [`ModelConfig`], what an
//! architecture's `[model]` table implements (object-safe), [`Registered`], what names it, and
//! [`DiffusionModel`], what it builds.

use std::any::Any;
use std::fmt::Debug;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::activations::Activations;
use crate::architecture::{Built, DiffusionBatch, InputError, InputSpec, RootBlock};
use crate::convert::{Layout, Source};
use crate::flops::{Attention, ForwardFlops, Rows};
use crate::tp::{check_tp_size, Linear, ParamSpec, ShardedStore, TpContext};
use crate::{Block, ConfigError, Widths};

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
/// without allocating weights. Object-safe: a [`crate::ModelSpec`] is a `dyn ModelConfig` of
/// whichever architecture a run names, and every command calls these methods on it. The
/// architecture's name, root block and tiny test config come from [`Registered`].
pub trait ModelConfig: Erased + Debug + Send + Sync {
    /// Check every rule; the error names the field as written in `[model]`.
    fn validate(&self) -> Result<(), ConfigError>;

    /// Width, heads, MLP ratio, latent channels and patch side.
    fn widths(&self) -> Widths;

    /// Whether a tensor-parallel group of `tp` ranks can split the model (heads and MLP width,
    /// from [`ModelConfig::widths`]); the error names `tensor_parallel_size` and the sizes it
    /// must divide.
    fn check_tp_size(&self, tp: usize) -> Result<(), ConfigError> {
        let widths = self.widths();
        check_tp_size(widths.num_attention_heads, widths.mlp_hidden(), tp)
    }

    /// Whether the model's layers can work on slices of the sequence (`[parallelism]
    /// sequence_parallel`); the error names the field that rules it out. The framework splits
    /// the streams of every `#[layers]` field; an architecture says yes once its blocks apply
    /// per-sample conditioning through `adaln` / `modulation_params` (whose gradients are summed
    /// over the group) and draw no dropout masks the ranks' slices would share. By default it
    /// does not.
    fn check_sequence_parallel(&self) -> Result<(), ConfigError> {
        Err(ConfigError::new(
            "sequence_parallel",
            format!(
                "architecture \"{}\" does not support sequence parallelism",
                self.name()
            ),
        ))
    }

    /// The inputs the model takes.
    fn inputs(&self) -> InputSpec;

    /// Every weight matrix as `(in · out, rows it is applied to)`, each 2-D parameter once.
    fn weight_matrices(&self) -> Vec<(f64, Rows)>;

    /// The attention layers, for the FLOPs count.
    fn attention(&self) -> Attention;

    /// Forward FLOPs on `batch` samples of `img` image and `txt` text tokens.
    fn forward_flops(&self, batch: i64, img: i64, txt: i64) -> ForwardFlops {
        ForwardFlops::of(&self.weight_matrices(), self.attention(), batch, img, txt)
    }

    /// Number of parameters (from the specs; nothing is allocated).
    fn num_params(&self) -> u64 {
        self.param_specs(1).iter().map(ParamSpec::numel).sum()
    }

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
            self.name()
        ))
    }

    /// `(label, value)` lines describing the shape, for `flux-hpc info`.
    fn summary(&self) -> Vec<(&'static str, String)>;

    /// As [`Erased::build_as`] in f32.
    fn build(&self, device: Device, tp: TpContext) -> Result<Box<dyn DiffusionModel>, ConfigError> {
        self.build_as(device, Kind::Float, tp)
    }
}

/// What makes a [`ModelConfig`] type an architecture `[model] architecture = NAME` selects: its
/// name, its root block, its `[model]` table (serde) and a tiny config for tests. Registering
/// the type in [`crate::architecture::ARCHITECTURES`] is the one line a new model adds outside
/// its folder.
pub trait Registered:
    ModelConfig + Serialize + DeserializeOwned + Clone + PartialEq + Default + 'static
{
    /// The root block the config builds.
    type Root: RootBlock<Config = Self> + 'static;

    /// The name `[model] architecture` selects it by.
    const NAME: &'static str;

    /// A one-line description for `--help` and errors.
    const ABOUT: &'static str;

    /// A config small enough for tests on two CPU cores that still has every feature of the
    /// architecture: what registry-driven tests build every registered model from.
    fn tiny() -> Self;
}

/// The type-level parts of a [`Registered`] config behind `&self`, so that a `dyn ModelConfig`
/// has them: implemented for every registered config, never by hand.
pub trait Erased: Any {
    /// The registered name ([`Registered::NAME`]).
    fn name(&self) -> &'static str;

    /// The config's own keys as a `[model]` table (without `architecture`).
    fn fields(&self) -> toml::Table;

    /// A boxed copy.
    fn clone_box(&self) -> Box<dyn ModelConfig>;

    /// Whether `other` is the same architecture with the same values.
    fn same_as(&self, other: &dyn ModelConfig) -> bool;

    /// As [`Any`], to get the typed config back.
    fn as_any(&self) -> &dyn Any;

    /// As [`Any`], mutable.
    fn as_any_mut(&mut self) -> &mut dyn Any;

    /// Every parameter's logical name, shape and split for a group of `tp_size` ranks: the root
    /// block's specs.
    fn param_specs(&self, tp_size: i64) -> Vec<ParamSpec>;

    /// Validate and build this rank's shards of the model for the tensor-parallel group `tp`, on
    /// `device` in `kind`, initialised in f32 from libtorch's global generator (the same weights
    /// for every group size) and rounded to `kind` weight by weight.
    fn build_as(
        &self,
        device: Device,
        kind: Kind,
        tp: TpContext,
    ) -> Result<Box<dyn DiffusionModel>, ConfigError>;
}

impl<C: Registered> Erased for C {
    fn name(&self) -> &'static str {
        C::NAME
    }

    fn fields(&self) -> toml::Table {
        toml::Table::try_from(self).expect("configs serialise to tables")
    }

    fn clone_box(&self) -> Box<dyn ModelConfig> {
        Box::new(self.clone())
    }

    fn same_as(&self, other: &dyn ModelConfig) -> bool {
        other.as_any().downcast_ref::<C>() == Some(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn param_specs(&self, tp_size: i64) -> Vec<ParamSpec> {
        C::Root::param_specs("", self, tp_size)
    }

    fn build_as(
        &self,
        device: Device,
        kind: Kind,
        tp: TpContext,
    ) -> Result<Box<dyn DiffusionModel>, ConfigError> {
        Ok(Box::new(Built::<C::Root>::new_parallel(
            self, device, kind, tp,
        )?))
    }
}
