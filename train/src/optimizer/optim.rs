//! AdamW with f32 master weights, the learning-rate schedule, and global-norm gradient clipping
//! that is correct across tensor-parallel shards.

use flux_data::checkpoint::OptimizerState;
use flux_model::tp::{ParamSpec, ShardedStore};
use tch::{Kind, Tensor};

use crate::config::sections::{LrSchedule, OptimizationConfig};
use crate::optimizer::fused_adamw::{fused_adamw, Hyper};

/// Learning rate at `step` (0-based): linear warmup over `warmup_steps`, then constant or cosine
/// decay from `learning_rate` to `min_learning_rate` at `total_steps`.
pub fn learning_rate(config: &OptimizationConfig, step: u64, total_steps: u64) -> f64 {
    let (peak, floor, warmup) = (
        config.learning_rate,
        config.min_learning_rate,
        config.warmup_steps,
    );
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    match config.lr_schedule {
        LrSchedule::Constant => peak,
        LrSchedule::Cosine => {
            let span = total_steps.saturating_sub(warmup).max(1) as f64;
            let progress = ((step - warmup) as f64 / span).min(1.0);
            floor + 0.5 * (peak - floor) * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}

struct Slot {
    /// The parameter the model computes with (f32 or bf16).
    param: Tensor,
    /// f32 master copy (the same tensor as `param` in f32 training).
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    decay: bool,
}

/// AdamW (Loshchilov & Hutter) with decoupled weight decay, on f32 master weights.
pub struct AdamW {
    slots: Vec<Slot>,
    config: OptimizationConfig,
    step: i32,
}

impl AdamW {
    /// Optimise `params` (name, tensor). Weights of two or more dimensions decay; biases and norm
    /// scales do not, as in Megatron.
    pub fn new(params: Vec<(String, Tensor)>, config: &OptimizationConfig) -> Self {
        let slots = params
            .into_iter()
            .map(|(_, param)| {
                let master = if param.kind() == Kind::Float {
                    param.shallow_clone()
                } else {
                    param.detach().to_kind(Kind::Float)
                };
                Slot {
                    exp_avg: master.zeros_like(),
                    exp_avg_sq: master.zeros_like(),
                    decay: param.dim() >= 2,
                    master,
                    param,
                }
            })
            .collect();
        Self {
            slots,
            config: config.clone(),
            step: 0,
        }
    }

    /// Steps taken.
    pub fn steps(&self) -> i32 {
        self.step
    }

    /// The f32 master weights and both moments, one tensor each per parameter, and the step
    /// counter (what a checkpoint saves).
    pub fn state(&self) -> OptimizerState {
        let take =
            |f: fn(&Slot) -> &Tensor| self.slots.iter().map(|s| f(s).shallow_clone()).collect();
        OptimizerState {
            step: self.step as u64,
            params: take(|s| &s.master),
            exp_avg: take(|s| &s.exp_avg),
            exp_avg_sq: take(|s| &s.exp_avg_sq),
            ema: None,
            parts: None,
        }
    }

    /// Bytes of the f32 masters kept apart from the weights (none in f32 training) and of both
    /// moments.
    pub fn state_bytes(&self) -> u64 {
        let separate = self
            .slots
            .iter()
            .filter(|s| s.param.kind() != Kind::Float)
            .map(|s| &s.master);
        crate::logging::units::bytes_of(
            separate.chain(self.slots.iter().flat_map(|s| [&s.exp_avg, &s.exp_avg_sq])),
        )
    }

    /// Restore master weights (also copied into the model's parameters), moments and step counter
    /// (`state.ema` is not the optimizer's and is ignored).
    pub fn load_state(&mut self, state: OptimizerState) {
        let OptimizerState {
            step,
            params,
            exp_avg,
            exp_avg_sq,
            ..
        } = state;
        tch::no_grad(|| {
            for (((s, w), m), v) in self
                .slots
                .iter_mut()
                .zip(params)
                .zip(exp_avg)
                .zip(exp_avg_sq)
            {
                s.master.copy_(&w);
                s.param.copy_(&w);
                s.exp_avg.copy_(&m);
                s.exp_avg_sq.copy_(&v);
            }
        });
        self.step = step as i32;
    }

    /// Apply one update at learning rate `lr` from the parameters' gradients, then clear them.
    /// Decaying and non-decaying parameters go through the fused kernel in chunks of at most
    /// [`STEP_CHUNK_ELEMENTS`] (a larger parameter alone), so the f32 copies of bf16 gradients
    /// never exceed a chunk.
    pub fn step(&mut self, lr: f64) {
        self.step += 1;
        let c = &self.config;
        tch::no_grad(|| {
            for decay in [true, false] {
                let slots: Vec<&Slot> = self
                    .slots
                    .iter()
                    .filter(|s| s.decay == decay && s.param.grad().defined())
                    .collect();
                let Some(first) = slots.first() else {
                    continue;
                };
                let step = Tensor::from(self.step as f32).to_device(first.master.device());
                let hyper = Hyper::adamw(c, lr, decay);
                let sizes: Vec<usize> = slots.iter().map(|s| s.param.numel()).collect();
                for chunk in chunk_ranges(&sizes, STEP_CHUNK_ELEMENTS) {
                    let slots = &slots[chunk];
                    let grads: Vec<Tensor> = slots
                        .iter()
                        .map(|s| s.param.grad().to_kind(Kind::Float))
                        .collect();
                    let take =
                        |f: fn(&Slot) -> &Tensor| slots.iter().map(|s| f(s)).collect::<Vec<_>>();
                    fused_adamw(
                        &take(|s| &s.master),
                        &grads,
                        &take(|s| &s.exp_avg),
                        &take(|s| &s.exp_avg_sq),
                        &step,
                        hyper,
                    );
                }
            }
            for s in self
                .slots
                .iter_mut()
                .filter(|s| s.param.kind() != Kind::Float)
            {
                s.param.copy_(&s.master);
            }
        });
        self.zero_grad();
    }

    /// Clear every gradient.
    pub fn zero_grad(&mut self) {
        for s in &mut self.slots {
            let mut g = s.param.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }
}

/// Elements per fused AdamW call of the replicated optimizer: 2^25 (128 MiB of f32 gradient
/// copies under bf16).
pub const STEP_CHUNK_ELEMENTS: usize = 1 << 25;

/// Consecutive index ranges over `sizes` whose sums stay within `cap` (an item larger than `cap`
/// alone).
pub fn chunk_ranges(sizes: &[usize], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut total) = (0, 0);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && total + n > cap {
            out.push(start..i);
            (start, total) = (i, 0);
        }
        total += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// Global L2 norm of all gradients of `store`'s model. Split parameters contribute their shard on
/// every rank; replicated ones (identical on every rank of the group) once; the squares are summed
/// over the tensor-parallel group. Call after gradients are complete (TP and DP reduced).
pub fn global_grad_norm(store: &ShardedStore) -> f64 {
    let vars = store.vs.variables();
    let tp = store.tp().size() as f64;
    let mut local = 0f64;
    for spec in store.param_specs() {
        let g = vars[&spec.name].grad();
        if g.defined() {
            let weight = if spec.split_dim.is_some() {
                1.0
            } else {
                1.0 / tp
            };
            // Squares in f32 (a bf16 square would round each one), summed in f64.
            local += weight
                * g.to_kind(Kind::Float)
                    .square()
                    .sum(Kind::Double)
                    .double_value(&[]);
        }
    }
    let mut total = [local as f32];
    store.tp().collective().all_reduce_sum(&mut total);
    // No clamping: a NaN or infinite gradient must show in the norm (see `[training] nonfinite`).
    (total[0] as f64).sqrt()
}

/// The factor that scales gradients of global norm `norm` to at most `max_norm` (0 disables),
/// or `None` when they need no clipping.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Option<f64> {
    (max_norm > 0.0 && norm > max_norm).then(|| max_norm / (norm + 1e-6))
}

/// Scale every gradient so the global norm is at most `max_norm` (0 disables); returns the norm
/// before clipping.
pub fn clip_grad_norm(store: &ShardedStore, max_norm: f64) -> f64 {
    let norm = global_grad_norm(store);
    if let Some(coef) = clip_coefficient(norm, max_norm) {
        tch::no_grad(|| {
            for var in store.vs.variables().values() {
                let mut g = var.grad();
                if g.defined() {
                    let _ = g.g_mul_scalar_(coef);
                }
            }
        });
    }
    norm
}

/// Specs and tensors of every trainable parameter, in spec order.
pub fn named_params(store: &ShardedStore) -> Vec<(String, Tensor)> {
    let vars = store.vs.variables();
    store
        .param_specs()
        .iter()
        .map(|s: &ParamSpec| (s.name.clone(), vars[&s.name].shallow_clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::chunk_ranges;

    #[test]
    fn chunks_stay_within_the_cap_and_a_large_item_goes_alone() {
        assert_eq!(chunk_ranges(&[3, 3, 3, 3], 6), vec![0..2, 2..4]);
        assert_eq!(chunk_ranges(&[2, 9, 2, 2], 6), vec![0..1, 1..2, 2..4]);
        assert_eq!(chunk_ranges(&[7], 6), vec![0..1]);
        assert!(chunk_ranges(&[], 6).is_empty());
    }
}
