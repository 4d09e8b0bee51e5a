//! `Built<T>`: a model on one rank — the `ShardedStore` of its shards and its root block `T` —
//! and `RootBlock`, what a root block adds to a [`Block`] so that `Built<T>` is a
//! [`DiffusionModel`].

use std::cell::Cell;

use tch::{Device, Kind, Tensor};

use crate::architecture::{
    check_sequence_split, DiffusionBatch, DiffusionModel, InputError, InputSpec, ModelConfig,
};
use crate::execution::{residency, run_model, LayerStack};
use crate::tp::{Linear, ShardedStore, TpContext};
use crate::{Block, ConfigError};

/// The root block of an architecture (`FluxTransformer`, `DitTransformer`, …).
pub trait RootBlock: Block + std::fmt::Debug {
    /// The inputs the model declares, which every batch is checked against before
    /// [`RootBlock::forward_batch`] sees it.
    fn inputs(&self) -> InputSpec;

    /// The prediction `[B, C, H, W]` for `batch`, already checked against
    /// [`RootBlock::inputs`] (shapes, the conditioning the model reads, and under sequence
    /// parallelism token counts the group divides); `train` enables dropout. Its `#[layers]` fields run their blocks through
    /// [`crate::execution::Layers::run`]; the parameters declared before the first of them are
    /// the stem, those after the last the head.
    fn forward_batch(&self, batch: &DiffusionBatch, train: bool) -> Result<Tensor, InputError>;
}

/// A model with its weights on one rank: this rank's parameter store and the module tree using
/// it.
#[derive(Debug)]
pub struct Built<T> {
    /// This rank's parameters (local shards), their specs and the tensor-parallel group.
    pub store: ShardedStore,
    /// The modules.
    pub transformer: T,
    /// Recompute each layer's activations in the backward pass of training forward passes.
    recompute: Cell<bool>,
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
        Ok(Self {
            store,
            transformer,
            recompute: Cell::new(false),
        })
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

    /// Run `forward`, a forward pass of the root block, as the framework runs models: the
    /// parameters before its first `#[layers]` field (the stem) and after its last (the head)
    /// gathered and released around the layers, each layer recomputed when `train` and
    /// [`DiffusionModel::set_recompute`] say so.
    pub fn run<E>(
        &self,
        train: bool,
        forward: impl FnOnce(&T) -> Result<Tensor, E>,
    ) -> Result<Tensor, E> {
        let recompute = train && self.recompute.get();
        run_model(&self.stacks(), recompute, || forward(&self.transformer))
    }

    /// The root block's `#[layers]` fields, in declaration order.
    fn stacks(&self) -> Vec<&dyn LayerStack> {
        let mut stacks = Vec::new();
        self.transformer.visit_layers(&mut |s| stacks.push(s));
        stacks
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
        let (rows, cols) = self.transformer.inputs().check(batch)?;
        let text = batch.text.as_ref().map_or(0, |t| t.size()[1]);
        check_sequence_split(self.store.tp(), &[("latents", rows * cols), ("text", text)])?;
        self.run(train, |t| t.forward_batch(batch, train))
    }

    fn set_recompute(&self, on: bool) {
        self.recompute.set(on);
    }

    fn layers(&self) -> Vec<String> {
        let stacks = self.stacks();
        let names = stacks.iter().flat_map(|s| s.names().iter().cloned());
        residency::stem_layers_head(names)
    }

    fn visit_linears<'s>(&'s self, f: &mut dyn FnMut(&'s Linear)) {
        self.transformer.visit_linears(f);
    }
}
