//! AdamW whose state is sharded over the data-parallel group (ZeRO-1, Megatron's distributed
//! optimizer; `[parallelism] sharding = "optimizer"`).
//!
//! The trained parameters (this rank's tensor-parallel shards, in spec order) are grouped into
//! buckets of consecutive parameters (`[parallelism] bucket_mib`, a larger parameter alone);
//! each bucket, laid end to end and padded, is cut into equal contiguous shares, and
//! data-parallel rank `r` owns share `r` of every bucket. A step reduce-scatters each bucket's
//! gradients (each rank receives the sum of its share, written back into its part of `.grad`,
//! so it is rounded and clipped exactly as plain data parallelism rounds and clips it), sums the
//! global norm from the shares, updates the masters and moments of the owned parts, and
//! all-gathers each bucket's updated share into every replica's weights. Per replica the optimizer
//! keeps `8 / dp` bytes per parameter in f32 training (the weights are their own masters) and
//! `12 / dp` with bf16 weights, against 8 and 12 unsharded; collective buffers are one bucket.

use std::ops::Range;

use flux_data::checkpoint::OptimizerState;
use flux_model::tp::{Collective, ShardedStore};
use tch::{Device, Kind, Tensor};

use crate::data_parallel::{bytes_of, DpOptimizer};
use crate::fused_adamw::{fused_adamw, Hyper};
use crate::optim::{clip_coefficient, named_params};
use crate::sections::OptimizationConfig;

/// The part of one parameter in this rank's share of its bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    /// Index of the parameter.
    param: usize,
    /// First element of the part among the parameter's (flattened) elements.
    in_param: usize,
    /// Where the part starts in this rank's share of the bucket.
    in_share: usize,
    /// Where the part starts in this rank's optimizer state (its parts end to end).
    in_state: usize,
    /// Elements in the part.
    len: usize,
}

/// Consecutive parameters reduced and gathered together.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bucket {
    /// The parameters, by index.
    params: Range<usize>,
    /// Elements per share: the bucket's elements padded to `share · ranks`.
    share: usize,
    /// The parts of its parameters this rank owns, in order.
    segments: Vec<Segment>,
}

/// How parameters of `numels` elements fall into buckets and shares.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShardLayout {
    numels: Vec<usize>,
    buckets: Vec<Bucket>,
    /// Elements of this rank's optimizer state (the lengths of all its segments).
    owned: usize,
}

impl ShardLayout {
    /// Parameters of `numels` elements in buckets of at most `cap` elements (a larger parameter
    /// alone), each cut into `ranks` shares, seen from rank `rank`.
    fn new(numels: Vec<usize>, cap: usize, ranks: usize, rank: usize) -> Self {
        let mut buckets = Vec::new();
        let mut owned = 0;
        let mut first = 0;
        while first < numels.len() {
            let (mut end, mut total) = (first, 0);
            while end < numels.len() && (end == first || total + numels[end] <= cap) {
                total += numels[end];
                end += 1;
            }
            let share = total.div_ceil(ranks).max(1);
            let (lo, hi) = (rank * share, (rank + 1) * share);
            let mut segments = Vec::new();
            let mut start = 0;
            for (param, &n) in numels.iter().enumerate().take(end).skip(first) {
                let (from, to) = (start.max(lo), (start + n).min(hi));
                if from < to {
                    segments.push(Segment {
                        param,
                        in_param: from - start,
                        in_share: from - lo,
                        in_state: owned,
                        len: to - from,
                    });
                    owned += to - from;
                }
                start += n;
            }
            buckets.push(Bucket {
                params: first..end,
                share,
                segments,
            });
            first = end;
        }
        Self {
            numels,
            buckets,
            owned,
        }
    }

    fn segments(&self) -> impl Iterator<Item = &Segment> {
        self.buckets.iter().flat_map(|b| b.segments.iter())
    }
}

/// `f` run on the elements of `t`, a contiguous f32 CPU tensor that nothing else reads or writes
/// while `f` runs.
fn with_elements<R>(t: &Tensor, f: impl FnOnce(&mut [f32]) -> R) -> R {
    assert!(t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous());
    let n = t.numel();
    // SAFETY: checked above to be `n` contiguous f32 values in host memory; the caller guarantees
    // no other access while the slice, which does not outlive `f`, exists.
    f(unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) })
}

/// A zero f32 CPU tensor of `n` elements.
fn host_zeros(n: usize) -> Tensor {
    Tensor::zeros([n as i64], (Kind::Float, Device::Cpu))
}

/// Borrows of every tensor of `ts`.
fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
    ts.iter().collect()
}

/// AdamW with f32 masters and moments sharded over the data-parallel group.
pub struct ShardedAdamW<'a> {
    /// The trained parameters (this rank's tensor-parallel shards), in spec order, contiguous.
    params: Vec<Tensor>,
    /// Whether each parameter decays (two or more dimensions).
    decay: Vec<bool>,
    /// Each parameter's weight in the global squared norm: 1 when split over the tensor-parallel
    /// group, `1 / tp` when replicated (every tensor-parallel rank holds it).
    norm_weight: Vec<f64>,
    /// Whether each parameter had a gradient this step (the same on every replica).
    has_grad: Vec<bool>,
    layout: ShardLayout,
    /// `[owned]` f32 masters of the owned parts of parameters that are not f32 (f32 weights are
    /// their own masters); `None` when every parameter is f32.
    masters: Option<Tensor>,
    /// `[owned]` AdamW moments of the owned parts.
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    config: OptimizationConfig,
    step: i32,
    dp: &'a dyn Collective,
}

impl<'a> ShardedAdamW<'a> {
    /// Shard the optimizer of `store`'s trainable parameters over `dp`, in buckets of at most
    /// `bucket` elements.
    pub fn new(
        store: &ShardedStore,
        config: &OptimizationConfig,
        dp: &'a dyn Collective,
        bucket: usize,
    ) -> Self {
        let named = named_params(store);
        let params: Vec<Tensor> = named.into_iter().map(|(_, t)| t).collect();
        assert!(
            params.iter().all(Tensor::is_contiguous),
            "parameters are contiguous"
        );
        let layout = ShardLayout::new(
            params.iter().map(|p| p.numel()).collect(),
            bucket,
            dp.size(),
            dp.rank(),
        );
        let device = params.first().map_or(Device::Cpu, Tensor::device);
        let state = || Tensor::zeros([layout.owned as i64], (Kind::Float, device));
        let tp = store.tp().size() as f64;
        let sharded = Self {
            decay: params.iter().map(|p| p.dim() >= 2).collect(),
            norm_weight: store
                .param_specs()
                .iter()
                .map(|s| if s.split_dim.is_some() { 1.0 } else { 1.0 / tp })
                .collect(),
            has_grad: vec![true; params.len()],
            masters: params.iter().any(|p| p.kind() != Kind::Float).then(state),
            exp_avg: state(),
            exp_avg_sq: state(),
            params,
            layout,
            config: config.clone(),
            step: 0,
            dp,
        };
        tch::no_grad(|| {
            for s in sharded.layout.segments() {
                sharded.master(s).copy_(&sharded.part_of_param(s));
            }
        });
        sharded
    }

    /// The owned part `s` of its parameter (a view).
    fn part_of_param(&self, s: &Segment) -> Tensor {
        self.params[s.param]
            .view([-1])
            .narrow(0, s.in_param as i64, s.len as i64)
    }

    /// The owned part `s` of its parameter's gradient (a view).
    fn part_of_grad(&self, s: &Segment) -> Tensor {
        self.params[s.param]
            .grad()
            .view([-1])
            .narrow(0, s.in_param as i64, s.len as i64)
    }

    /// The f32 master of part `s` (a view: of the parameter itself when it is f32).
    fn master(&self, s: &Segment) -> Tensor {
        match (&self.masters, self.params[s.param].kind()) {
            (Some(m), kind) if kind != Kind::Float => m.narrow(0, s.in_state as i64, s.len as i64),
            _ => self.part_of_param(s),
        }
    }

    /// Part `s` of a `[owned]` state tensor (a view).
    fn state_part(t: &Tensor, s: &Segment) -> Tensor {
        t.narrow(0, s.in_state as i64, s.len as i64)
    }

    /// Every rank's `parts` of bucket `b` (one tensor per segment, this rank's), all-gathered:
    /// the bucket's elements end to end, `[share · ranks]` f32 on the CPU.
    fn gather_bucket(&self, b: &Bucket, parts: &[Tensor]) -> Tensor {
        let share = host_zeros(b.share);
        for (s, part) in b.segments.iter().zip(parts) {
            share
                .narrow(0, s.in_share as i64, s.len as i64)
                .copy_(&part.to_device(Device::Cpu).to_kind(Kind::Float));
        }
        let full = host_zeros(b.share * self.dp.size());
        with_elements(&share, |data| {
            with_elements(&full, |out| self.dp.all_gather(data, out))
        });
        full
    }

    /// One tensor per segment (this rank's parts) gathered into one f32 tensor per parameter,
    /// shaped like the parameters: an all-gather per bucket.
    fn gather_params(&self, parts: &[Tensor]) -> Vec<Tensor> {
        let mut out = Vec::with_capacity(self.params.len());
        let mut at = 0;
        for b in &self.layout.buckets {
            let full = self.gather_bucket(b, &parts[at..at + b.segments.len()]);
            at += b.segments.len();
            let mut start = 0;
            for p in b.params.clone() {
                let n = self.layout.numels[p];
                out.push(
                    full.narrow(0, start as i64, n as i64)
                        .view(self.params[p].size().as_slice()),
                );
                start += n;
            }
        }
        out
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
    fn reduce_and_clip(&mut self, store: &ShardedStore, max_norm: f64) -> f64 {
        self.has_grad = self.params.iter().map(|p| p.grad().defined()).collect();
        let ranks = self.dp.size();
        let mut local = 0.0;
        tch::no_grad(|| {
            for b in &self.layout.buckets {
                let mut flat: Vec<Tensor> = b
                    .params
                    .clone()
                    .map(|p| match self.has_grad[p] {
                        true => self.params[p].grad().to_device(Device::Cpu),
                        false => self.params[p].zeros_like().to_device(Device::Cpu),
                    })
                    .map(|g| g.to_kind(Kind::Float).flatten(0, -1))
                    .collect();
                let total: usize = b.params.clone().map(|p| self.layout.numels[p]).sum();
                flat.push(host_zeros(b.share * ranks - total));
                let flat = Tensor::cat(&flat, 0);
                let summed = host_zeros(b.share);
                with_elements(&flat, |data| {
                    with_elements(&summed, |out| self.dp.reduce_scatter_sum(data, out))
                });
                for s in b.segments.iter().filter(|s| self.has_grad[s.param]) {
                    let mut grad = self.part_of_grad(s);
                    grad.copy_(&summed.narrow(0, s.in_share as i64, s.len as i64));
                    local += self.norm_weight[s.param]
                        * grad
                            .to_kind(Kind::Float)
                            .square()
                            .sum(Kind::Double)
                            .double_value(&[]);
                }
            }
        });
        let mut total = [local as f32];
        self.dp.all_reduce_sum(&mut total);
        store.tp().collective().all_reduce_sum(&mut total);
        let norm = (total[0] as f64).sqrt();
        if let Some(coef) = clip_coefficient(norm, max_norm) {
            tch::no_grad(|| {
                for s in self.layout.segments().filter(|s| self.has_grad[s.param]) {
                    let _ = self.part_of_grad(s).g_mul_scalar_(coef);
                }
            });
        }
        norm
    }

    fn step(&mut self, lr: f64) {
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
                    .map(|s| self.part_of_grad(s).to_kind(Kind::Float))
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
            let masters = self.masters();
            for (param, value) in self.params.iter().zip(self.gather_params(&masters)) {
                param
                    .shallow_clone()
                    .copy_(&value.to_kind(param.kind()).to_device(param.device()));
            }
        });
        self.zero_grad();
    }

    fn zero_grad(&mut self) {
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
        self.gather_params(local)
    }

    fn to_local(&self, per_param: &[Tensor]) -> Vec<Tensor> {
        self.layout
            .segments()
            .map(|s| {
                per_param[s.param]
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
        }
    }

    fn load_state(&mut self, state: OptimizerState) {
        tch::no_grad(|| {
            for (param, value) in self.params.iter().zip(&state.params) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(param: usize, in_param: usize, in_share: usize, in_state: usize, len: usize) -> Segment {
        Segment {
            param,
            in_param,
            in_share,
            in_state,
            len,
        }
    }

    #[test]
    fn buckets_are_cut_into_equal_padded_shares_owned_once() {
        // 3 + 5 + 2 + 9 elements, buckets of at most 10: [3, 5, 2] and [9]; 3 ranks: shares of 4
        // and 3.
        let layouts: Vec<ShardLayout> = (0..3)
            .map(|r| ShardLayout::new(vec![3, 5, 2, 9], 10, 3, r))
            .collect();
        let first = &layouts[0].buckets;
        assert_eq!((first[0].params.clone(), first[0].share), (0..3, 4));
        assert_eq!((first[1].params.clone(), first[1].share), (3..4, 3));
        assert_eq!(first[0].segments, [seg(0, 0, 0, 0, 3), seg(1, 0, 3, 3, 1)]);
        assert_eq!(first[1].segments, [seg(3, 0, 0, 4, 3)]);
        assert_eq!(layouts[1].buckets[0].segments, [seg(1, 1, 0, 0, 4)]);
        // The last share of the first bucket is half padding.
        assert_eq!(layouts[2].buckets[0].segments, [seg(2, 0, 0, 0, 2)]);
        assert_eq!(layouts[2].buckets[1].segments, [seg(3, 6, 0, 2, 3)]);
        // Every element of every parameter is owned exactly once.
        let owned: usize = layouts.iter().map(|l| l.owned).sum();
        assert_eq!(owned, 19);
    }

    #[test]
    fn more_ranks_than_elements_leave_some_shares_all_padding() {
        let layout = ShardLayout::new(vec![1], 10, 4, 3);
        assert_eq!(layout.buckets[0].share, 1);
        assert_eq!(layout.owned, 0);
    }
}
