//! `Built<T>`: a model on one rank — the `ShardedStore` of its shards and its root block `T` —
//! and `RootBlock`, what a root block adds to a [`Block`] so that `Built<T>` is a
//! [`DiffusionModel`].

use tch::{Device, Kind, Tensor};

use crate::architecture::{DiffusionBatch, DiffusionModel, InputError, ModelConfig};
use crate::tp::{Linear, ShardedStore, TpContext};
use crate::{Block, ConfigError};

/// The root block of an architecture (`FluxTransformer`, `DitTransformer`, …).
pub trait RootBlock: Block + std::fmt::Debug {
    /// The prediction `[B, C, H, W]` for `batch` (checked against the model's inputs); `train`
    /// enables dropout and recomputation.
    fn forward_batch(&self, batch: &DiffusionBatch, train: bool) -> Result<Tensor, InputError>;

    /// Recompute each layer's activations in the backward pass (training forward passes only).
    fn set_recompute(&self, on: bool);

    /// The layers `forward_batch` runs through [`crate::residency::run_layer`], by the names it
    /// passes (their parameters' state-dict prefixes, or [`crate::residency::STEM`] and
    /// [`crate::residency::HEAD`] for the parameters before and after the layers), in the order
    /// it runs them ([`crate::residency::stem_layers_head`]). Fully sharded training releases
    /// their weights from the start; a layer missing here is found when it first runs (default:
    /// all are).
    fn layers(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A model with its weights on one rank: this rank's parameter store and the module tree using
/// it.
#[derive(Debug)]
pub struct Built<T> {
    /// This rank's parameters (local shards), their specs and the tensor-parallel group.
    pub store: ShardedStore,
    /// The modules.
    pub transformer: T,
}

impl<T: Block> Built<T> {
    /// This rank's shards of the group `tp` on `device` in `kind`, initialised in f32 from
    /// libtorch's global generator. Fails, before allocating, when `tp` does not divide a split
    /// dimension.
    pub fn build(
        config: &T::Config,
        device: Device,
        kind: Kind,
        tp: TpContext,
    ) -> Result<Self, ConfigError> {
        let specs = T::param_specs("", config, tp.size() as i64);
        let (store, transformer) =
            ShardedStore::build(device, kind, tp, specs, |root, tp| T::new(root, config, tp))?;
        Ok(Self { store, transformer })
    }

    /// Validate `config` and build this rank's shards of the group `tp` (the model's TP rule
    /// checked first). The weights equal the matching slices of a single-rank model built from
    /// the same seed.
    pub fn new_parallel(
        config: &T::Config,
        device: Device,
        kind: Kind,
        tp: TpContext,
    ) -> Result<Self, ConfigError>
    where
        T::Config: ModelConfig,
    {
        config.validate()?;
        config.check_tp_size(tp.size())?;
        Self::build(config, device, kind, tp)
    }

    /// Number of parameters held on this rank: all, or only those that require gradients.
    pub fn get_num_params(&self, trainable_only: bool) -> u64 {
        self.store.num_local_params(trainable_only)
    }
}

impl<T: RootBlock> DiffusionModel for Built<T> {
    fn store(&self) -> &ShardedStore {
        &self.store
    }

    fn store_mut(&mut self) -> &mut ShardedStore {
        &mut self.store
    }

    fn forward(&self, batch: &DiffusionBatch, train: bool) -> Result<Tensor, InputError> {
        self.transformer.forward_batch(batch, train)
    }

    fn set_recompute(&self, on: bool) {
        self.transformer.set_recompute(on);
    }

    fn layers(&self) -> Vec<String> {
        self.transformer.layers()
    }

    fn visit_linears<'s>(&'s self, f: &mut dyn FnMut(&'s Linear)) {
        self.transformer.visit_linears(f);
    }
}
