//! AdamW whose state is sharded over the data-parallel group (ZeRO-1, Megatron's distributed
//! optimizer; `[parallelism] sharding = "optimizer"`).
//!
//! The trained parameters (this rank's tensor-parallel shards, in spec order) are laid end to end
//! in one flat space, padded to a multiple of the group size and cut into equal contiguous
//! shares; data-parallel rank `r` owns share `r`. Each step the flat gradient is reduce-scattered
//! (each rank receives the sum of its share only), the global norm is summed from the shares,
//! every rank updates the f32 masters and moments of its share, and the updated shares are
//! all-gathered into every replica's weights. Per replica the f32 masters and both moments take
//! `12 / dp` bytes per parameter instead of 12.

use flux_data::checkpoint::OptimizerState;
use flux_model::tp::{Collective, ShardedStore};
use tch::{Device, Kind, Tensor};

use crate::data_parallel::DpOptimizer;
use crate::fused_adamw::{fused_adamw, Hyper};
use crate::optim::{clip_coefficient, named_params};
use crate::sections::OptimizationConfig;

/// The part of one parameter that falls in this rank's share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    /// Index of the parameter.
    param: usize,
    /// Where the part starts in the share.
    in_share: usize,
    /// Elements in the part.
    len: usize,
}

/// Parameters of `numels` elements laid end to end and cut into `ranks` equal shares.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FlatLayout {
    /// Where each parameter starts in the flat space.
    offsets: Vec<usize>,
    /// Elements of each parameter.
    numels: Vec<usize>,
    /// Elements per share (the flat space padded to `share · ranks`).
    share: usize,
    /// The pieces of parameters in this rank's share, in flat order.
    segments: Vec<Segment>,
}

impl FlatLayout {
    fn new(numels: Vec<usize>, ranks: usize, rank: usize) -> Self {
        let offsets: Vec<usize> = numels
            .iter()
            .scan(0, |at, n| {
                let start = *at;
                *at += n;
                Some(start)
            })
            .collect();
        let total: usize = numels.iter().sum();
        let share = total.div_ceil(ranks).max(1);
        let (lo, hi) = (rank * share, (rank + 1) * share);
        let segments = offsets
            .iter()
            .zip(&numels)
            .enumerate()
            .filter_map(|(param, (&start, &n))| {
                let (from, to) = (start.max(lo), (start + n).min(hi));
                (from < to).then(|| Segment {
                    param,
                    in_share: from - lo,
                    len: to - from,
                })
            })
            .collect();
        Self {
            offsets,
            numels,
            share,
            segments,
        }
    }

    /// Length of the padded flat space.
    fn padded(&self, ranks: usize) -> usize {
        self.share * ranks
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

/// `t` as a contiguous f32 CPU tensor (itself when it is one).
fn on_host(t: &Tensor) -> Tensor {
    t.to_device(Device::Cpu).to_kind(Kind::Float).contiguous()
}

/// Borrows of every tensor of `ts`.
fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
    ts.iter().collect()
}

/// AdamW with f32 masters and moments sharded over the data-parallel group.
pub struct ShardedAdamW<'a> {
    /// The trained parameters (this rank's tensor-parallel shards), in spec order.
    params: Vec<Tensor>,
    /// Whether each parameter decays (two or more dimensions).
    decay: Vec<bool>,
    /// Whether each parameter had a gradient this step (the same on every replica).
    has_grad: Vec<bool>,
    layout: FlatLayout,
    /// This rank's share `[share]` (f32, on the parameters' device): masters, moments, and the
    /// summed gradient of the step.
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad: Tensor,
    /// `[share]`: each element's weight in the global squared norm: 1 for a parameter split over
    /// the tensor-parallel group, `1 / tp` for a replicated one (every tensor-parallel rank holds
    /// it), 0 for padding.
    norm_weight: Tensor,
    config: OptimizationConfig,
    step: i32,
    dp: &'a dyn Collective,
}

impl<'a> ShardedAdamW<'a> {
    /// Shard the optimizer of `store`'s trainable parameters over `dp`.
    pub fn new(store: &ShardedStore, config: &OptimizationConfig, dp: &'a dyn Collective) -> Self {
        let params: Vec<Tensor> = named_params(store).into_iter().map(|(_, t)| t).collect();
        let layout = FlatLayout::new(
            params.iter().map(|p| p.numel()).collect(),
            dp.size(),
            dp.rank(),
        );
        let device = params.first().map_or(Device::Cpu, Tensor::device);
        let tp = store.tp().size() as f64;
        let weights: Vec<Tensor> = store
            .param_specs()
            .iter()
            .zip(&params)
            .map(|(spec, p)| {
                let w = if spec.split_dim.is_some() {
                    1.0
                } else {
                    1.0 / tp
                };
                Tensor::full([p.numel() as i64], w, (Kind::Float, Device::Cpu))
            })
            .collect();
        let mut sharded = Self {
            decay: params.iter().map(|p| p.dim() >= 2).collect(),
            has_grad: vec![true; params.len()],
            master: Tensor::zeros([layout.share as i64], (Kind::Float, device)),
            exp_avg: Tensor::zeros([layout.share as i64], (Kind::Float, device)),
            exp_avg_sq: Tensor::zeros([layout.share as i64], (Kind::Float, device)),
            grad: Tensor::zeros([layout.share as i64], (Kind::Float, device)),
            norm_weight: Tensor::zeros([layout.share as i64], (Kind::Float, device)),
            params,
            layout,
            config: config.clone(),
            step: 0,
            dp,
        };
        sharded.norm_weight = sharded.own(&weights);
        let values: Vec<Tensor> = sharded.params.iter().map(Tensor::detach).collect();
        sharded.master = sharded.own(&values);
        sharded
    }

    /// One tensor per parameter, flattened end to end in f32 and padded: `[padded]` on the CPU.
    fn flatten(&self, per_param: &[Tensor]) -> Tensor {
        let mut parts: Vec<Tensor> = per_param
            .iter()
            .map(|t| t.to_device(Device::Cpu).to_kind(Kind::Float).flatten(0, -1))
            .collect();
        let total: usize = self.layout.numels.iter().sum();
        let pad = self.layout.padded(self.dp.size()) - total;
        parts.push(Tensor::zeros([pad as i64], (Kind::Float, Device::Cpu)));
        Tensor::cat(&parts, 0)
    }

    /// This rank's share of one tensor per parameter: `[share]` f32 on the parameters' device.
    fn own(&self, per_param: &[Tensor]) -> Tensor {
        let lo = (self.dp.rank() * self.layout.share) as i64;
        self.flatten(per_param)
            .narrow(0, lo, self.layout.share as i64)
            .to_device(self.master.device())
            .copy()
    }

    /// Every rank's share of a `[share]` tensor, all-gathered into `[padded]` on the CPU.
    fn gather(&self, share: &Tensor) -> Tensor {
        let full = Tensor::zeros(
            [self.layout.padded(self.dp.size()) as i64],
            (Kind::Float, Device::Cpu),
        );
        with_elements(&on_host(share), |data| {
            with_elements(&full, |out| self.dp.all_gather(data, out))
        });
        full
    }

    /// Round the gradient share to each parameter's dtype, as plain data parallelism holds the
    /// summed and the clipped gradient in the parameter's `.grad` (bf16 under `precision =
    /// "bf16"`): both train alike.
    fn round_grad_to_param_kinds(&self) {
        for s in &self.layout.segments {
            let kind = self.params[s.param].kind();
            if kind != Kind::Float {
                let mut part = self.grad.narrow(0, s.in_share as i64, s.len as i64);
                part.copy_(&part.to_kind(kind).to_kind(Kind::Float));
            }
        }
    }

    /// A `[padded]` flat tensor cut into one tensor per parameter, shaped like the parameters.
    fn split(&self, full: &Tensor) -> Vec<Tensor> {
        self.params
            .iter()
            .zip(self.layout.offsets.iter().zip(&self.layout.numels))
            .map(|(p, (&at, &n))| {
                full.narrow(0, at as i64, n as i64)
                    .view(p.size().as_slice())
            })
            .collect()
    }
}

impl DpOptimizer for ShardedAdamW<'_> {
    fn reduce_and_clip(&mut self, store: &ShardedStore, max_norm: f64) -> f64 {
        let grads: Vec<Tensor> = self.params.iter().map(Tensor::grad).collect();
        self.has_grad = grads.iter().map(Tensor::defined).collect();
        let grads: Vec<Tensor> = grads
            .iter()
            .zip(&self.params)
            .map(|(g, p)| match g.defined() {
                true => g.shallow_clone(),
                false => p.zeros_like(),
            })
            .collect();
        let summed = Tensor::zeros([self.layout.share as i64], (Kind::Float, Device::Cpu));
        with_elements(&self.flatten(&grads), |data| {
            with_elements(&summed, |out| self.dp.reduce_scatter_sum(data, out))
        });
        self.grad = summed.to_device(self.master.device());
        self.round_grad_to_param_kinds();
        let local = (&self.norm_weight * self.grad.square())
            .sum(Kind::Double)
            .double_value(&[]);
        let mut total = [local as f32];
        self.dp.all_reduce_sum(&mut total);
        store.tp().collective().all_reduce_sum(&mut total);
        let norm = (total[0] as f64).sqrt();
        if let Some(coef) = clip_coefficient(norm, max_norm) {
            let _ = self.grad.g_mul_scalar_(coef);
            self.round_grad_to_param_kinds();
        }
        norm
    }

    fn step(&mut self, lr: f64) {
        self.step += 1;
        let c = &self.config;
        tch::no_grad(|| {
            let step = Tensor::from(self.step as f32).to_device(self.master.device());
            for decay in [true, false] {
                let segments: Vec<&Segment> = self
                    .layout
                    .segments
                    .iter()
                    .filter(|s| self.decay[s.param] == decay && self.has_grad[s.param])
                    .collect();
                if segments.is_empty() {
                    continue;
                }
                let part = |t: &Tensor| -> Vec<Tensor> {
                    segments
                        .iter()
                        .map(|s| t.narrow(0, s.in_share as i64, s.len as i64))
                        .collect()
                };
                let (masters, grads, m, v) = (
                    part(&self.master),
                    part(&self.grad),
                    part(&self.exp_avg),
                    part(&self.exp_avg_sq),
                );
                let hyper = Hyper {
                    lr,
                    beta1: c.beta1,
                    beta2: c.beta2,
                    weight_decay: if decay { c.weight_decay } else { 0.0 },
                    eps: c.epsilon,
                };
                fused_adamw(&refs(&masters), &grads, &refs(&m), &refs(&v), &step, hyper);
            }
            let full = self.gather(&self.master);
            for (param, value) in self.params.iter().zip(self.split(&full)) {
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
        vec![self.master.shallow_clone()]
    }

    fn per_param(&self, local: &[Tensor]) -> Vec<Tensor> {
        self.split(&self.gather(&local[0]))
    }

    fn to_local(&self, per_param: &[Tensor]) -> Vec<Tensor> {
        vec![self.own(per_param)]
    }

    fn state(&self) -> OptimizerState {
        OptimizerState {
            step: self.step as u64,
            params: self.per_param(&self.masters()),
            exp_avg: self.split(&self.gather(&self.exp_avg)),
            exp_avg_sq: self.split(&self.gather(&self.exp_avg_sq)),
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
        });
        self.master = self.own(&state.params);
        self.exp_avg = self.own(&state.exp_avg);
        self.exp_avg_sq = self.own(&state.exp_avg_sq);
        self.step = state.step as i32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_equal_padded_and_cut_parameters_where_they_fall() {
        // 3 + 5 + 2 = 10 elements over 3 ranks: shares of 4, the last padded by 2.
        let layouts: Vec<FlatLayout> = (0..3)
            .map(|r| FlatLayout::new(vec![3, 5, 2], 3, r))
            .collect();
        assert_eq!(layouts[0].share, 4);
        assert_eq!(layouts[0].padded(3), 12);
        let seg = |param, in_share, len| Segment {
            param,
            in_share,
            len,
        };
        assert_eq!(layouts[0].segments, [seg(0, 0, 3), seg(1, 3, 1)]);
        assert_eq!(layouts[1].segments, [seg(1, 0, 4)]);
        assert_eq!(layouts[2].segments, [seg(2, 0, 2)]);
        // Every element of every parameter is owned exactly once.
        let owned: usize = layouts
            .iter()
            .flat_map(|l| l.segments.iter().map(|s| s.len))
            .sum();
        assert_eq!(owned, 10);
    }

    #[test]
    fn more_ranks_than_elements_leave_some_shares_all_padding() {
        let layout = FlatLayout::new(vec![1], 4, 3);
        assert_eq!((layout.share, layout.segments.len()), (1, 0));
    }
}
