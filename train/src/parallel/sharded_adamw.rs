//! AdamW whose state is sharded over the data-parallel group (ZeRO-1, Megatron's distributed
//! optimizer; `[parallelism] sharding = "optimizer"`), and with it the gradients (ZeRO-2,
//! `sharding = "gradients"`).
//!
//! The trained parameters (this rank's tensor-parallel shards) fall into buckets and shares as
//! [`ShardLayout`] says. Under `"optimizer"` a step reduce-scatters each bucket's gradients after
//! backward (each rank receives the sum of its share, written back into its part of `.grad`, so
//! it is rounded and clipped exactly as plain data parallelism rounds and clips it); under
//! `"gradients"` backward itself reduce-scatters them into an f32 shard and drops the full
//! gradients ([`GradShard`]). Then each rank sums the global norm from its shares, updates the
//! masters and moments of the parts it owns, and all-gathers each bucket's updated share into
//! every replica's weights. Per replica the optimizer keeps `8 / dp` bytes per parameter in f32
//! training (the weights are their own masters) and `12 / dp` with bf16 weights, against 8 and 12
//! unsharded; `"gradients"` holds `4 / dp` bytes of gradients per parameter after backward
//! instead of the weights' size; collective buffers are one bucket.
//!
//! With `shard_group_size` (HSDP), `dp` is the size of this rank's shard group: the state is
//! sharded within the group and replicated across groups, each share's reduce-scattered sum
//! completed by an all-reduce over the ranks holding the same share in the other groups.

use std::rc::Rc;

use flux_data::checkpoint::{DpParts, OptimizerState};
use flux_model::execution::residency::{install, Installation};
use flux_model::tp::{Collective, DpGroups, ShardedStore};
use tch::{Device, Kind, Tensor};

use crate::config::run_config::Sharding;
use crate::config::sections::OptimizationConfig;
use crate::logging::units::bytes_of;
use crate::optimizer::fused_adamw::{fused_adamw, Hyper};
use crate::optimizer::optim::{clip_coefficient, named_params};
use crate::parallel::data_parallel::{all_finite, nonfinite_param_grads, DpOptimizer};
use crate::parallel::grad_hooks::OverlapReport;
use crate::parallel::shard_layout::{
    gather_bucket, reduce_scatter_bucket, sum_over, ParamOrder, Segment, ShardLayout,
};
use crate::parallel::sharded_grads::GradShard;
use crate::parallel::sharded_params::ShardedParams;

/// Borrows of every tensor of `ts`.
fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
    ts.iter().collect()
}

/// AdamW with f32 masters and moments sharded over the data-parallel group.
pub struct ShardedAdamW<'a> {
    /// Under `sharding = "full"`: routes the model's layers through `residency` (dropped first).
    _installed: Option<Installation>,
    /// Under `sharding = "full"`: which layers' weights are present.
    residency: Option<Rc<ShardedParams<'a>>>,
    /// The trained parameters (this rank's tensor-parallel shards), contiguous, in spec order
    /// except under gradient sharding with tensor parallelism: those the tensor-parallel group
    /// sums after backward come last.
    params: Vec<Tensor>,
    /// The spec index of each parameter.
    spec_of: Vec<usize>,
    /// Whether each parameter decays (two or more dimensions).
    decay: Vec<bool>,
    /// Each parameter's weight in the global squared norm: 1 when split over the tensor-parallel
    /// group, `1 / tp` when replicated (every tensor-parallel rank holds it).
    norm_weight: Vec<f64>,
    /// Whether each parameter had a gradient this step (the same on every replica).
    has_grad: Vec<bool>,
    layout: ShardLayout,
    /// `[owned]` f32 masters of the owned parts of parameters that are not f32 (f32 weights are
    /// their own masters, except under `"full"`); `None` when every weight is its own master.
    masters: Option<Tensor>,
    /// Whether f32 weights are their own masters (not under `"full"`: they come and go).
    weights_are_masters: bool,
    /// `[owned]` AdamW moments of the owned parts.
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    config: OptimizationConfig,
    step: i32,
    /// The replicas the state is sharded over.
    shard: &'a dyn Collective,
    /// The ranks holding the same share in the other shard groups (HSDP), which sum it.
    across: &'a dyn Collective,
    /// Under `sharding = "gradients"`: this rank's share of the summed gradients.
    grads: Option<GradShard<'a>>,
}

impl<'a> ShardedAdamW<'a> {
    /// Shard the optimizer of `store`'s trainable parameters over `groups.shard` (replicated
    /// over `groups.across`), in buckets of at most `bucket` elements; and as `level` says, their
    /// gradients and the weights themselves (under `"full"`, those of the model's `layers`,
    /// [`flux_model::DiffusionModel::layers`], given back at once). `built`: under `"full"`, the
    /// masters `ShardedBuild` took while the model was built (whose layers' weights it gave
    /// back then); else the masters are taken from the weights here.
    pub fn new(
        store: &ShardedStore,
        config: &OptimizationConfig,
        groups: DpGroups<'a>,
        bucket: usize,
        level: Sharding,
        layers: &[String],
        built: Option<Tensor>,
    ) -> Self {
        let shard_grads = matches!(level, Sharding::Gradients | Sharding::Full);
        let full = level == Sharding::Full;
        let specs = store.param_specs();
        let ParamOrder {
            spec_of,
            early,
            unit,
            layout,
        } = ParamOrder::new(
            specs,
            store.tp().size(),
            level,
            bucket,
            groups.shard.size(),
            groups.shard.rank(),
        );
        let named = named_params(store);
        let params: Vec<Tensor> = spec_of
            .iter()
            .map(|&i| named[i].1.shallow_clone())
            .collect();
        assert!(
            params.iter().all(Tensor::is_contiguous),
            "parameters are contiguous"
        );
        let device = params.first().map_or(Device::Cpu, Tensor::device);
        let owned = layout.owned as i64;
        let state = move || Tensor::zeros([owned], (Kind::Float, device));
        let tp = store.tp().size() as f64;
        let taken = built.is_some();
        let masters =
            built.or_else(|| (full || params.iter().any(|p| p.kind() != Kind::Float)).then(state));
        let residency = full.then(|| {
            let masters = masters.as_ref().expect("full sharding keeps masters");
            Rc::new(ShardedParams::new(
                &params,
                &unit,
                &layout,
                masters,
                groups.shard,
            ))
        });
        // SAFETY: the Rc keeps the value alive and in place; the guard, dropped first, goes
        // before the optimizer's last Rc.
        let installed = residency.as_ref().map(|r| unsafe { install(r.as_ref()) });
        let sharded = Self {
            _installed: installed,
            residency,
            weights_are_masters: !full,
            decay: params.iter().map(|p| p.dim() >= 2).collect(),
            norm_weight: spec_of
                .iter()
                .map(|&i| {
                    if specs[i].split_dim.is_some() {
                        1.0
                    } else {
                        1.0 / tp
                    }
                })
                .collect(),
            spec_of,
            // Made once the layers' weights are given back, below.
            grads: None,
            has_grad: vec![true; params.len()],
            masters,
            // Allocated once the layers' weights are given back, below.
            exp_avg: Tensor::new(),
            exp_avg_sq: Tensor::new(),
            params,
            layout,
            config: config.clone(),
            step: 0,
            shard: groups.shard,
            across: groups.across,
        };
        if !taken {
            tch::no_grad(|| {
                for s in sharded.layout.segments() {
                    sharded.master(s).copy_(&sharded.part_of_param(s));
                }
            });
        }
        if let Some(residency) = &sharded.residency {
            residency.release_layers(layers);
        }
        // The moments and the gradient share come after the release, so a rank never holds whole
        // layers beside more than their masters.
        let mut sharded = sharded;
        sharded.exp_avg = state();
        sharded.exp_avg_sq = state();
        sharded.grads = shard_grads.then(|| {
            GradShard::new(
                &sharded.params,
                early,
                &sharded.layout,
                groups.shard,
                sharded.residency.clone(),
                device,
            )
        });
        sharded
    }

    /// The owned part `s` of its parameter (a view).
    fn part_of_param(&self, s: &Segment) -> Tensor {
        self.params[s.param]
            .view([-1])
            .narrow(0, s.in_param as i64, s.len as i64)
    }

    /// The summed gradient of owned part `s` (a view: of the gradient shard, or of the
    /// parameter's `.grad`).
    fn grad_part(&self, s: &Segment) -> Tensor {
        match &self.grads {
            Some(g) => Self::state_part(g.sum(), s),
            None => {
                self.params[s.param]
                    .grad()
                    .view([-1])
                    .narrow(0, s.in_param as i64, s.len as i64)
            }
        }
    }

    /// The f32 master of part `s` (a view: of the parameter itself when it is f32 and its own
    /// master).
    fn master(&self, s: &Segment) -> Tensor {
        let own = self.weights_are_masters && self.params[s.param].kind() == Kind::Float;
        match &self.masters {
            Some(m) if !own => m.narrow(0, s.in_state as i64, s.len as i64),
            _ => self.part_of_param(s),
        }
    }

    /// Whether the optimizer writes bucket `b`'s updated weights (not those of the layers
    /// `"full"` gathers when they run, which it gives back instead).
    fn writes_bucket(&self, b: usize) -> bool {
        match &self.residency {
            Some(r) if r.is_managed(b) => {
                r.release_bucket(b);
                false
            }
            _ => true,
        }
    }

    /// Part `s` of a `[owned]` state tensor (a view).
    fn state_part(t: &Tensor, s: &Segment) -> Tensor {
        t.narrow(0, s.in_state as i64, s.len as i64)
    }

    /// One tensor per segment (this rank's parts) gathered, one bucket at a time (an all-gather
    /// each, for the buckets `wanted` picks): `each(p, value)` gets every parameter `p`'s f32
    /// value, shaped like the parameter, in [`ShardedAdamW::params`]' order, while only its
    /// bucket's buffer is alive.
    fn for_each_gathered(
        &self,
        parts: &[Tensor],
        wanted: impl Fn(usize) -> bool,
        mut each: impl FnMut(usize, Tensor),
    ) {
        let mut at = 0;
        for (i, b) in self.layout.buckets.iter().enumerate() {
            let parts = &parts[at..at + b.segments.len()];
            at += b.segments.len();
            if !wanted(i) {
                continue;
            }
            let full = gather_bucket(b, parts, self.shard, self.params[b.params.start].device());
            let mut start = 0;
            for p in b.params.clone() {
                let n = self.layout.numels[p];
                let value = full.narrow(0, start as i64, n as i64);
                each(p, value.view(self.params[p].size().as_slice()));
                start += n;
            }
        }
    }

    /// Tensors laid out per segment (`local`, like the masters) as each parameter's part in spec
    /// order (empty where this rank owns none of it: a parameter lies in one bucket, so a rank
    /// owns at most one contiguous part of it), and where the parts go.
    fn parts(&self, local: &[Tensor]) -> (Vec<Tensor>, DpParts) {
        let n = self.params.len();
        let mut tensors: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        let mut offsets = vec![0; n];
        for (s, t) in self.layout.segments().zip(local) {
            let i = self.spec_of[s.param];
            tensors[i] = Some(t.shallow_clone());
            offsets[i] = s.in_param;
        }
        let mut local_shapes = vec![Vec::new(); n];
        for (p, &i) in self.spec_of.iter().enumerate() {
            local_shapes[i] = self.params[p].size();
        }
        let device = self.exp_avg.device();
        let tensors = tensors
            .into_iter()
            .map(|t| t.unwrap_or_else(|| Tensor::zeros([0], (Kind::Float, device))))
            .collect();
        let parts = DpParts {
            dp_rank: self.shard.rank(),
            dp_size: self.shard.size(),
            offsets,
            local_shapes,
            writes: self.across.rank() == 0,
        };
        (tensors, parts)
    }

    /// One view per segment of `[owned]` state tensor `t`.
    fn state_parts(&self, t: &Tensor) -> Vec<Tensor> {
        self.layout
            .segments()
            .map(|s| Self::state_part(t, s))
            .collect()
    }
}

impl DpOptimizer for ShardedAdamW<'_> {
    fn before_backward(&mut self, _last: bool) {
        if let Some(grads) = &mut self.grads {
            grads.arm();
        }
    }

    fn after_backward(&mut self, last: bool) -> Option<OverlapReport> {
        let report = self.grads.as_mut().and_then(GradShard::flush);
        report.filter(|_| last)
    }

    fn reduce_and_clip(&mut self, store: &ShardedStore, max_norm: f64) -> f64 {
        let mut local = 0.0;
        match &mut self.grads {
            Some(grads) => {
                self.has_grad = grads.finish(&self.params, &self.layout, self.shard, self.across)
            }
            None => {
                self.has_grad = self.params.iter().map(|p| p.grad().defined()).collect();
                tch::no_grad(|| {
                    for b in &self.layout.buckets {
                        let summed =
                            reduce_scatter_bucket(&self.params, &self.layout, b, self.shard);
                        sum_over(&summed, self.across);
                        for s in b.segments.iter().filter(|s| self.has_grad[s.param]) {
                            let share = summed.narrow(0, s.in_share as i64, s.len as i64);
                            self.grad_part(s).copy_(&share);
                        }
                    }
                });
            }
        }
        for s in self.layout.segments().filter(|s| self.has_grad[s.param]) {
            local += self.norm_weight[s.param]
                * self
                    .grad_part(s)
                    .to_kind(Kind::Float)
                    .square()
                    .sum(Kind::Double)
                    .double_value(&[]);
        }
        // Every share is summed once within the shard group; the other groups hold the same.
        let mut total = [local as f32];
        self.shard.all_reduce_sum(&mut total);
        store.tp().collective().all_reduce_sum(&mut total);
        let norm = (total[0] as f64).sqrt();
        if let Some(coef) = clip_coefficient(norm, max_norm) {
            tch::no_grad(|| {
                for s in self.layout.segments().filter(|s| self.has_grad[s.param]) {
                    let _ = self.grad_part(s).g_mul_scalar_(coef);
                }
            });
        }
        norm
    }

    fn step(&mut self, lr: f64) {
        if let Some(residency) = &self.residency {
            residency.discard_prefetch();
        }
        self.step += 1;
        let c = &self.config;
        tch::no_grad(|| {
            let device = self.exp_avg.device();
            let step = Tensor::from(self.step as f32).to_device(device);
            for decay in [true, false] {
                let segments: Vec<&Segment> = self
                    .layout
                    .segments()
                    .filter(|s| self.decay[s.param] == decay && self.has_grad[s.param])
                    .collect();
                if segments.is_empty() {
                    continue;
                }
                let masters: Vec<Tensor> = segments.iter().map(|s| self.master(s)).collect();
                let grads: Vec<Tensor> = segments
                    .iter()
                    .map(|s| self.grad_part(s).to_kind(Kind::Float))
                    .collect();
                let m: Vec<Tensor> = segments
                    .iter()
                    .map(|s| Self::state_part(&self.exp_avg, s))
                    .collect();
                let v: Vec<Tensor> = segments
                    .iter()
                    .map(|s| Self::state_part(&self.exp_avg_sq, s))
                    .collect();
                let hyper = Hyper::adamw(c, lr, decay);
                fused_adamw(&refs(&masters), &grads, &refs(&m), &refs(&v), &step, hyper);
            }
            let wanted = |b| self.writes_bucket(b);
            self.for_each_gathered(&self.masters(), wanted, |p, value| {
                let param = &self.params[p];
                param
                    .shallow_clone()
                    .copy_(&value.to_kind(param.kind()).to_device(param.device()));
            });
        });
        self.zero_grad();
    }

    fn zero_grad(&mut self) {
        if let Some(grads) = &mut self.grads {
            grads.zero();
        }
        for p in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    fn masters(&self) -> Vec<Tensor> {
        self.layout.segments().map(|s| self.master(s)).collect()
    }

    fn per_param(&self, local: &[Tensor]) -> Vec<Tensor> {
        let mut in_spec_order: Vec<Option<Tensor>> = (0..self.params.len()).map(|_| None).collect();
        self.for_each_gathered(
            local,
            |_| true,
            |p, value| in_spec_order[self.spec_of[p]] = Some(value),
        );
        in_spec_order
            .into_iter()
            .map(|t| t.expect("every parameter is in a bucket"))
            .collect()
    }

    fn to_local(&self, per_param: &[Tensor]) -> Vec<Tensor> {
        self.layout
            .segments()
            .map(|s| {
                per_param[self.spec_of[s.param]]
                    .to_kind(Kind::Float)
                    .reshape([-1])
                    .narrow(0, s.in_param as i64, s.len as i64)
                    .to_device(self.exp_avg.device())
                    .copy()
            })
            .collect()
    }

    fn state(&self) -> OptimizerState {
        OptimizerState {
            step: self.step as u64,
            params: self.per_param(&self.masters()),
            exp_avg: self.per_param(&self.state_parts(&self.exp_avg)),
            exp_avg_sq: self.per_param(&self.state_parts(&self.exp_avg_sq)),
            ema: None,
            parts: None,
        }
    }

    fn state_parts(&self) -> Option<OptimizerState> {
        let (params, parts) = self.parts(&self.masters());
        Some(OptimizerState {
            step: self.step as u64,
            params,
            exp_avg: self.parts(&self.state_parts(&self.exp_avg)).0,
            exp_avg_sq: self.parts(&self.state_parts(&self.exp_avg_sq)).0,
            ema: None,
            parts: Some(parts),
        })
    }

    fn parts_of(&self, local: &[Tensor]) -> Option<Vec<Tensor>> {
        Some(self.parts(local).0)
    }

    fn load_state(&mut self, state: OptimizerState) {
        tch::no_grad(|| {
            let buckets = &self.layout.buckets;
            let written = (0..buckets.len()).filter(|&b| self.writes_bucket(b));
            for p in written.flat_map(|b| buckets[b].params.clone()) {
                let (param, value) = (&self.params[p], &state.params[self.spec_of[p]]);
                param
                    .shallow_clone()
                    .copy_(&value.to_kind(param.kind()).to_device(param.device()));
            }
            let groups = [
                (self.masters(), &state.params),
                (self.state_parts(&self.exp_avg), &state.exp_avg),
                (self.state_parts(&self.exp_avg_sq), &state.exp_avg_sq),
            ];
            for (parts, values) in groups {
                for (part, value) in parts.iter().zip(self.to_local(values)) {
                    part.shallow_clone().copy_(&value);
                }
            }
        });
        self.step = state.step as i32;
    }

    fn state_bytes(&self) -> u64 {
        bytes_of(self.masters.iter().chain([&self.exp_avg, &self.exp_avg_sq]))
    }

    fn gradient_bytes(&self) -> u64 {
        self.grads.as_ref().map_or(0, GradShard::bytes)
    }

    fn weights(&self, store: &ShardedStore) -> Vec<Tensor> {
        if self.residency.is_none() {
            return named_params(store)
                .into_iter()
                .map(|(_, t)| t.detach())
                .collect();
        }
        let kinds: Vec<Kind> = named_params(store).iter().map(|(_, t)| t.kind()).collect();
        self.per_param(&self.masters())
            .into_iter()
            .zip(kinds)
            .map(|(w, kind)| w.to_kind(kind))
            .collect()
    }

    fn nonfinite_grads(&self, store: &ShardedStore) -> Vec<usize> {
        if self.grads.is_none() {
            return nonfinite_param_grads(store);
        }
        let mut bad: Vec<usize> = self
            .layout
            .segments()
            .filter(|s| self.has_grad[s.param] && !all_finite(&self.grad_part(s)))
            .map(|s| self.spec_of[s.param])
            .collect();
        bad.sort_unstable();
        bad.dedup();
        bad
    }
}
