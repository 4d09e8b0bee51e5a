//! How the optimizer's work is divided over the data-parallel group: [`Replicated`] (every
//! replica sums all gradients and updates every weight) or [`crate::ShardedAdamW`] (each replica
//! updates its share, `[parallelism] sharding = "optimizer"`, and keeps only its share of the
//! gradients, `"gradients"`). The training loop drives both through [`DpOptimizer`].

use flux_data::checkpoint::OptimizerState;
use flux_model::tp::{all_reduce_grads, Collective, DpGroups, GradSync, ShardedStore};
use tch::Tensor;

use crate::config::run_config::{ParallelismConfig, Sharding};
use crate::config::sections::OptimizationConfig;
use crate::optimizer::optim::{clip_grad_norm, named_params, AdamW};
use crate::parallel::grad_hooks::OverlapReport;
use crate::parallel::overlapped_reduce::OverlappedReduce;
use crate::ShardedAdamW;

/// The optimizer as a training step uses it.
pub trait DpOptimizer {
    /// Before each micro-batch's backward; `last` is the step's last, whose backward may start
    /// summing gradient buckets (`[parallelism] overlap_grad_reduce`; every backward reduces
    /// under `sharding = "gradients"`).
    fn before_backward(&mut self, _last: bool) {}

    /// After each micro-batch's backward (`last`: the step's last), before
    /// [`ShardedStore::finish_grads`]: complete the reductions the backward started. After the
    /// last, when buckets were reduced during backward, how that overlapped it.
    fn after_backward(&mut self, _last: bool) -> Option<OverlapReport> {
        None
    }

    /// Complete this step's gradients of `store` over the data-parallel group (after
    /// [`ShardedStore::finish_grads`]), clip them to a global norm of `max_norm` (0: never) and
    /// return the global L2 norm before clipping (NaN or infinite when a gradient is). A
    /// collective over the data- and tensor-parallel groups.
    fn reduce_and_clip(&mut self, store: &ShardedStore, max_norm: f64) -> f64;

    /// Apply one AdamW update at learning rate `lr` from the completed gradients, then clear
    /// the model's gradients (a collective when sharded: the updated weights are gathered).
    fn step(&mut self, lr: f64);

    /// Clear the model's gradients without an update.
    fn zero_grad(&mut self);

    /// This rank's f32 master weights in the optimizer's own layout: one tensor per parameter,
    /// or one per part of a parameter a sharded optimizer owns. What an EMA averages beside
    /// them.
    fn masters(&self) -> Vec<Tensor>;

    /// Tensors laid out like [`DpOptimizer::masters`] as one tensor per parameter (this rank's
    /// tensor-parallel shard): an all-gather over the data-parallel group when sharded.
    fn per_param(&self, local: &[Tensor]) -> Vec<Tensor>;

    /// One tensor per parameter (this rank's tensor-parallel shard) as laid out like
    /// [`DpOptimizer::masters`].
    fn to_local(&self, per_param: &[Tensor]) -> Vec<Tensor>;

    /// Master weights, moments and step counter, one tensor per parameter (what a checkpoint
    /// holds, whatever the sharding; a collective when sharded).
    fn state(&self) -> OptimizerState;

    /// As [`DpOptimizer::state`], but each tensor only this rank's part of it, with
    /// [`flux_data::checkpoint::DpParts`] saying where the parts go (no collective): for a
    /// checkpoint each rank writes its own part of. `None` when every rank holds whole tensors.
    fn state_parts(&self) -> Option<OptimizerState> {
        None
    }

    /// Tensors laid out like [`DpOptimizer::masters`] as this rank's part of each parameter, in
    /// spec order, as [`DpOptimizer::state_parts`] lays them out (`None` when it gives none).
    fn parts_of(&self, _local: &[Tensor]) -> Option<Vec<Tensor>> {
        None
    }

    /// Continue from `state` (one tensor per parameter): masters, moments, step counter, and the
    /// model's weights set from the masters.
    fn load_state(&mut self, state: OptimizerState);

    /// Bytes this rank holds for the optimizer beyond the weights and their gradients: f32
    /// masters kept apart from the weights, and both moments.
    fn state_bytes(&self) -> u64;

    /// Bytes this rank holds for gradients apart from the parameters' `.grad` (the shard of
    /// summed gradients under `sharding = "gradients"` and `"full"`).
    fn gradient_bytes(&self) -> u64 {
        0
    }

    /// The current weights of `store`'s trained parameters (this rank's tensor-parallel shards,
    /// spec order): the parameters themselves, or under `sharding = "full"` gathered from the
    /// masters (a collective over the data-parallel group).
    fn weights(&self, store: &ShardedStore) -> Vec<Tensor> {
        named_params(store)
            .into_iter()
            .map(|(_, t)| t.detach())
            .collect()
    }

    /// Indices (in `store`'s parameter specs) of the parameters whose gradient, as far as this
    /// rank holds it after [`DpOptimizer::reduce_and_clip`], has a NaN or an infinity.
    fn nonfinite_grads(&self, store: &ShardedStore) -> Vec<usize> {
        nonfinite_param_grads(store)
    }
}

/// Indices (in `store`'s parameter specs) of the parameters whose `.grad` has a NaN or an
/// infinity.
pub(crate) fn nonfinite_param_grads(store: &ShardedStore) -> Vec<usize> {
    named_params(store)
        .iter()
        .enumerate()
        .filter(|(_, (_, p))| {
            let g = p.grad();
            g.defined() && !all_finite(&g)
        })
        .map(|(i, _)| i)
        .collect()
}

/// Whether every element of `t` is finite.
pub(crate) fn all_finite(t: &Tensor) -> bool {
    bool::try_from(t.isfinite().all()).unwrap_or(false)
}

/// The optimizer of `store`'s trainable parameters for data-parallel groups `groups`, sharded
/// and bucketed as `parallelism` says; `layers` are the model's
/// ([`flux_model::DiffusionModel::layers`]), whose weights full sharding gives back at once;
/// `built`, under full sharding, the masters taken while the model was built (`[owned]` f32).
pub fn dp_optimizer<'a>(
    store: &ShardedStore,
    config: &OptimizationConfig,
    parallelism: &ParallelismConfig,
    groups: DpGroups<'a>,
    layers: &[String],
    built: Option<Tensor>,
) -> Box<dyn DpOptimizer + 'a> {
    let dp = groups.all;
    let bucket = parallelism.bucket_elements();
    match parallelism.sharding {
        Sharding::None => {
            // Gradients summed over the tensor-parallel group by `finish_grads` are summed over
            // the data-parallel group after it, as without overlap, so that the two sums round
            // in the same order; every other gradient during backward.
            let overlapped = parallelism.overlap_grad_reduce && dp.size() > 1;
            let (late, early) = match overlapped {
                false => (store.vs.trainable_variables(), Vec::new()),
                true => {
                    let vars = store.vs.variables();
                    let (late, early): (Vec<_>, Vec<_>) = store
                        .param_specs()
                        .iter()
                        .map(|s| (s, vars[&s.name].shallow_clone()))
                        .filter(|(_, v)| v.requires_grad())
                        .partition(|(s, _)| s.grad_sync == GradSync::SumOverGroup);
                    let vars = |p: Vec<(_, Tensor)>| p.into_iter().map(|(_, v)| v).collect();
                    (vars(late), vars(early))
                }
            };
            let overlap = overlapped.then(|| OverlappedReduce::new(early, dp, bucket));
            Box::new(Replicated {
                adamw: AdamW::new(named_params(store), config),
                dp,
                bucket,
                overlap,
                late,
            })
        }
        level => Box::new(ShardedAdamW::new(
            store, config, groups, bucket, level, layers, built,
        )),
    }
}

/// Plain data parallelism: gradients all-reduced in flat buckets (during backward under
/// `overlap_grad_reduce`), every replica updates every weight with the whole optimizer state.
pub struct Replicated<'a> {
    adamw: AdamW,
    dp: &'a dyn Collective,
    /// Largest all-reduce, in elements.
    bucket: usize,
    /// The buckets summed during backward, under `overlap_grad_reduce`.
    overlap: Option<OverlappedReduce<'a>>,
    /// The parameters whose gradients are summed after backward: all, or under overlap those
    /// `finish_grads` sums over the tensor-parallel group first.
    late: Vec<Tensor>,
}

impl DpOptimizer for Replicated<'_> {
    fn before_backward(&mut self, last: bool) {
        if let Some(overlap) = &mut self.overlap {
            overlap.arm(last);
        }
    }

    fn after_backward(&mut self, last: bool) -> Option<OverlapReport> {
        self.overlap
            .as_mut()
            .filter(|_| last)
            .map(OverlappedReduce::finish)
    }

    fn reduce_and_clip(&mut self, store: &ShardedStore, max_norm: f64) -> f64 {
        all_reduce_grads(&self.late, self.dp, 1.0, self.bucket);
        clip_grad_norm(store, max_norm)
    }

    fn step(&mut self, lr: f64) {
        self.adamw.step(lr);
    }

    fn zero_grad(&mut self) {
        self.adamw.zero_grad();
    }

    fn masters(&self) -> Vec<Tensor> {
        self.adamw.state().params
    }

    fn per_param(&self, local: &[Tensor]) -> Vec<Tensor> {
        local.iter().map(Tensor::shallow_clone).collect()
    }

    fn to_local(&self, per_param: &[Tensor]) -> Vec<Tensor> {
        per_param.iter().map(Tensor::shallow_clone).collect()
    }

    fn state(&self) -> OptimizerState {
        self.adamw.state()
    }

    fn load_state(&mut self, state: OptimizerState) {
        self.adamw.load_state(state);
    }

    fn state_bytes(&self) -> u64 {
        self.adamw.state_bytes()
    }
}
