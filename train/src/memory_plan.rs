//! How much memory one rank's tensors need at the peak of a training step, predicted from the
//! model's parameter specs and the activations its layers save ([`flux_model::activations`]),
//! for a parallel layout: tensor and data parallel sizes, sharding level, sequence parallelism,
//! recomputation and micro-batch. `flux-hpc plan` prints it; the bench measures the same
//! quantity on the CPU (`peak_tensor_mib`, [`flux_model::tensor_memory`]).
//!
//! The step is followed through its phases, as the trainer runs them:
//!
//! - **backward**, layer by layer in reverse: the activations of the layers not yet reached, the
//!   recomputed layer's whole set, gradients of buckets not yet complete (sharded gradients drop
//!   a bucket's as soon as it is reduce-scattered, after flattening it in f32), and under full
//!   sharding the layer whose weights are gathered;
//! - **gradient reduction** after backward (plain and optimizer sharding): a bucket flattened in
//!   f32;
//! - **optimizer step**: the f32 copies of bf16 gradients, and the all-gather of each updated
//!   bucket.
//!
//! Between them the state stays: weights present, gradients kept between steps, f32 masters,
//! AdamW's two moments, the EMA, and the f32 gradient share of sharded gradients. A `[lora]`
//! run trains its adapters alone: the frozen base is held in its own dtype and its layers save
//! only what the adapters' gradients need ([`lora`]). Libraries'
//! own workspaces (cuBLAS, oneDNN), the CUDA context, NCCL's buffers and allocator fragmentation
//! are not tensors and are left to the headroom.

mod lora;

use flux_model::activations::{bytes_of, ActivationShape, Kernels, Saved};
use flux_model::execution::residency::{HEAD, STEM};
use flux_model::tp::ParamSpec;
use flux_model::ConfigError;

use crate::config::run_config::{RunConfig, Sharding};
use crate::optimizer::optim::{chunk_ranges, STEP_CHUNK_ELEMENTS};
use crate::parallel::shard_layout::{Bucket, ParamOrder, ShardLayout};
use lora::LoraPlan;

/// One way to lay a run out over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// Replicas that shard among themselves (HSDP); 0: all of them.
    pub shard_group: usize,
    /// What the replicas shard.
    pub sharding: Sharding,
    /// Whether the tensor-parallel group splits the sequence.
    pub sequence_parallel: bool,
    /// Whether layers recompute their activations in backward.
    pub recompute: bool,
    /// Samples per micro-batch on each replica.
    pub micro_batch: u64,
}

impl Layout {
    /// The layout `run` asks for on `ranks` ranks; the error names the field that cannot apply
    /// there (`parallelism.…`, or `training.global_batch_size` for a batch that does not
    /// split), as training would refuse it.
    pub fn of(run: &RunConfig, ranks: usize) -> Result<Self, ConfigError> {
        let p = &run.parallelism;
        let dp = p.replicas(ranks).map_err(|e| e.within("parallelism"))?;
        run.check_batch_split(dp)?;
        Ok(Self {
            tp: p.tensor_parallel_size as usize,
            dp,
            shard_group: p.shard_group_size as usize,
            sharding: p.sharding,
            sequence_parallel: p.sequence_parallel,
            recompute: run.training.recompute,
            micro_batch: run.training.micro_batch_size,
        })
    }

    /// `run` launched in this layout: its parallelism, recomputation and micro-batch.
    pub fn applied_to(&self, run: &RunConfig) -> RunConfig {
        let mut run = run.clone();
        let p = &mut run.parallelism;
        p.tensor_parallel_size = self.tp as i64;
        p.shard_group_size = self.shard_group as u64;
        p.sharding = self.sharding;
        p.sequence_parallel = self.sequence_parallel;
        run.training.recompute = self.recompute;
        run.training.micro_batch_size = self.micro_batch;
        run
    }

    /// Whether training would accept `run` in this layout on `ranks` ranks: the config's
    /// rules, the replicas and the batch split, as `train` checks them.
    pub fn accepted(&self, run: &RunConfig, ranks: usize) -> Result<(), ConfigError> {
        let launched = self.applied_to(run);
        launched.validate()?;
        let replicas = launched
            .parallelism
            .replicas(ranks)
            .map_err(|e| e.within("parallelism"))?;
        launched.check_batch_split(replicas)
    }

    /// Ranks that hold the parts of one sharded parameter.
    fn shards(&self) -> usize {
        match (self.sharding, self.shard_group) {
            (Sharding::None, _) => 1,
            (_, 0) => self.dp,
            (_, g) => g,
        }
    }
}

/// A moment of training where a rank's memory may peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Building the model: every weight of the rank's tensor-parallel shard is initialised
    /// whole in f32 and kept in the training dtype; under full sharding the f32 masters exist
    /// from the start, take each weight's share as it is created, and the weights of layers,
    /// stem and head are given back at once (the state the optimizer then adds is counted in
    /// the other phases).
    Build,
    /// While backward runs through the layers.
    Backward,
    /// While gradients are summed over the replicas after backward.
    GradientReduction,
    /// While the optimizer updates and gathers the weights.
    OptimizerStep,
}

impl Phase {
    /// How the phase reads in a report.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Build => "build",
            Phase::Backward => "backward",
            Phase::GradientReduction => "gradient reduction",
            Phase::OptimizerStep => "optimizer step",
        }
    }
}

/// A rank's tensor bytes at the top of one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhasePeak {
    /// The phase.
    pub phase: Phase,
    /// What the micro-batch's forward pass still keeps for backward.
    pub activations: u64,
    /// Everything else alive beside the state: gradients of buckets not yet reduced, the
    /// gathered layer, flattened buckets, f32 copies of bf16 gradients.
    pub transient: u64,
    /// All of it, the state included (during the build: the f32 weights alone).
    pub total: u64,
}

/// One rank's tensor bytes: the state kept between steps, and the top of each phase.
#[derive(Debug, Clone, PartialEq)]
pub struct RankMemory {
    /// Elements of the parameters this rank trains (the adapters' under `[lora]`).
    pub trained_params: u64,
    /// Weights present between steps (none of those full sharding gives back).
    pub weights: u64,
    /// Gradients kept between steps (sharded gradients keep none; their f32 share lives from
    /// the first backward to the optimizer step, a transient).
    pub gradients: u64,
    /// f32 masters (where the weights are not their own) and AdamW's two moments.
    pub optimizer: u64,
    /// The f32 moving average of the weights.
    pub ema: u64,
    /// The top of each phase.
    pub phases: Vec<PhasePeak>,
}

impl RankMemory {
    /// State kept between steps.
    pub fn state(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.ema
    }

    /// The phase where memory peaks.
    pub fn peak_phase(&self) -> &PhasePeak {
        self.phases
            .iter()
            .max_by_key(|p| p.total)
            .expect("a plan has phases")
    }

    /// The most bytes alive at once.
    pub fn peak(&self) -> u64 {
        self.peak_phase().total
    }
}

/// Where a parameter sits in the forward pass: the unit fully sharded training gathers it with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// Before the layers (the embedders).
    Stem,
    /// Layer `i` of the model's layers.
    Layer(usize),
    /// After the layers (the output layer).
    Head,
}

impl Unit {
    /// Whether `full` sharding gives this unit's weights back between uses: a layer's always,
    /// the stem's and head's where the model runs them like layers (`stem_and_head`).
    fn given_back(self, full: bool, stem_and_head: bool) -> bool {
        full && (stem_and_head || matches!(self, Unit::Layer(_)))
    }
}

/// The trained parameters of one rank (the model's, or a LoRA run's adapters) as the optimizer
/// lays them out: in spec order, with the gradients the tensor-parallel group sums last, cut
/// into the same buckets and shares.
struct Trained {
    /// Each parameter's spec, in the optimizer's order.
    specs: Vec<ParamSpec>,
    /// Each parameter's unit.
    unit: Vec<Unit>,
    /// The buckets and this rank's shares of them (rank 0, which owns the most).
    buckets: ShardLayout,
}

impl Trained {
    fn new(all: &[ParamSpec], run: &RunConfig, layout: &Layout, layer_names: &[&str]) -> Self {
        let cap = run.parallelism.bucket_elements();
        let order = ParamOrder::new(all, layout.tp, layout.sharding, cap, layout.shards(), 0);
        let specs: Vec<ParamSpec> = order.spec_of.iter().map(|&i| all[i].clone()).collect();
        let unit = order
            .unit
            .iter()
            .map(|u| match u.as_str() {
                STEM => Unit::Stem,
                HEAD => Unit::Head,
                layer => Unit::Layer(
                    layer_names
                        .iter()
                        .position(|&n| n == layer)
                        .unwrap_or_else(|| panic!("`{layer}` is not among the model's layers")),
                ),
            })
            .collect();
        Self {
            specs,
            unit,
            buckets: order.layout,
        }
    }

    /// Each parameter's local elements.
    fn numels(&self) -> &[usize] {
        &self.buckets.numels
    }

    /// Elements of the parameters `p` selects.
    fn sum(&self, mut p: impl FnMut(usize) -> bool) -> u64 {
        (0..self.numels().len())
            .filter(|&i| p(i))
            .map(|i| self.numels()[i] as u64)
            .sum()
    }

    /// Elements of bucket `b`.
    fn bucket(&self, b: &Bucket) -> u64 {
        b.params.clone().map(|p| self.numels()[p] as u64).sum()
    }

    /// Bytes of a collective on bucket `b` in flight: the bucket whole in f32 beside this
    /// rank's f32 share of it (a gather landing, or a reduce-scatter's input and result).
    fn in_flight(&self, b: &Bucket) -> u64 {
        4 * (self.bucket(b) + b.share as u64)
    }

    /// When backward produces parameter `p`'s gradient, of `n` layers: the head's first, layer
    /// `i` at `n - i`, the stem's last.
    fn produced_at(&self, p: usize, n: usize) -> usize {
        match self.unit[p] {
            Unit::Head => 0,
            Unit::Layer(i) => n - i,
            Unit::Stem => n + 1,
        }
    }

    /// Bytes of unit `u`'s weights, gathered, at `elt` bytes an element.
    fn weights_of(&self, u: Unit, elt: u64) -> u64 {
        self.sum(|p| self.unit[p] == u) * elt
    }

    /// Bytes of unit `u`'s gathers in flight: each of its buckets whole beside this rank's
    /// share, in the weights' dtype (`elt` bytes an element).
    fn gathering(&self, u: Unit, elt: u64) -> u64 {
        let buckets = self.buckets.buckets.iter();
        let of_unit = buckets.filter(|b| self.unit[b.params.start] == u);
        of_unit
            .map(|b| elt * (self.bucket(b) + b.share as u64))
            .sum()
    }

    /// Elements of the largest chunk replicated AdamW copies to f32 at once (decaying matrices
    /// and the rest are chunked apart).
    fn largest_adamw_chunk(&self) -> u64 {
        [true, false]
            .into_iter()
            .flat_map(|decays| {
                let group: Vec<usize> = (0..self.specs.len())
                    .filter(|&i| (self.specs[i].shape.len() >= 2) == decays)
                    .map(|i| self.numels()[i])
                    .collect();
                chunk_ranges(&group, STEP_CHUNK_ELEMENTS)
                    .into_iter()
                    .map(move |r| group[r].iter().sum::<usize>() as u64)
                    .collect::<Vec<_>>()
            })
            .max()
            .unwrap_or(0)
    }
}

/// Bytes one micro-batch's forward pass keeps for backward.
struct MicroBatch {
    /// Each layer's whole saved set.
    saved: Vec<u64>,
    /// What each layer's forward pass makes, alive while it runs: everything full training
    /// saves of it (more than a frozen layer keeps).
    working: Vec<u64>,
    /// What each layer keeps until backward reaches it: its saved set, or under recomputation
    /// its inputs.
    kept: Vec<u64>,
    /// Everything outside the layers.
    around: u64,
    /// Whether the stem and head are gathered like layers, and the layers whose backward the
    /// stem is back for ([`flux_model::activations::Activations::stem_regathered_for`]).
    stem_regathered_for: Option<usize>,
}

impl MicroBatch {
    /// Under `lora`, the layers save what a frozen model does.
    fn new(
        run: &RunConfig,
        layout: &Layout,
        kernels: Kernels,
        elt: u64,
        lora: Option<&LoraPlan>,
    ) -> Self {
        let t = &run.training;
        let inputs = run.model.inputs();
        let shape = ActivationShape {
            batch: layout.micro_batch as i64,
            img: inputs.image_tokens(t.latent_height, t.latent_width),
            txt: inputs.text_tokens(t.text_len),
            tp: layout.tp as i64,
            sequence_parallel: layout.sequence_parallel,
            elt: elt as i64,
            kernels,
        };
        let activations = run.model.activations();
        let bytes = |saved: &[Saved]| bytes_of(saved, &shape) as u64;
        let layers = &activations.layers;
        let working: Vec<u64> = layers.iter().map(|l| bytes(&l.saved)).collect();
        let saved: Vec<u64> = (0..layers.len())
            .map(|i| match lora {
                None => working[i],
                Some(lora) if lora.reaches(layers, i) => bytes(&lora.saved(&layers[i])),
                Some(_) => 0,
            })
            .collect();
        let kept = match layout.recompute {
            true => activations
                .layers
                .iter()
                .map(|l| bytes(&l.inputs))
                .collect(),
            false => saved.clone(),
        };
        Self {
            saved,
            working,
            kept,
            around: bytes(&activations.outside),
            stem_regathered_for: activations.stem_regathered_for,
        }
    }
}

/// The top of backward as `(activations, transient)`, walking the head, the layers from the
/// last and the stem: entering layer `i`, the kept activations of the layers before it and its
/// whole saved set (or what its forward pass makes, where a frozen layer keeps less); leaving it, its gradients all produced and a bucket it completes flattened
/// (`flat` bytes per element) with its summed share. Sharded gradients keep only buckets not yet
/// complete, and their f32 `share` lives throughout; full sharding holds the running unit's
/// weights and the next one's gathers in flight.
fn backward_peak(
    trained: &Trained,
    acts: &MicroBatch,
    sharding: Sharding,
    elt: u64,
    share: u64,
) -> (u64, u64) {
    let shard_grads = matches!(sharding, Sharding::Gradients | Sharding::Full);
    let n = acts.saved.len();
    let flat = if elt == 4 { 4 } else { 8 };
    let buckets = &trained.buckets.buckets;
    let at: Vec<usize> = (0..trained.numels().len())
        .map(|p| trained.produced_at(p, n))
        .collect();
    let done: Vec<usize> = buckets
        .iter()
        .map(|b| b.params.clone().map(|p| at[p]).max().unwrap_or(0))
        .collect();
    // Gradients alive at `step`: of buckets not complete before it, produced before it (or by
    // it, `produced`).
    let grads_at = |step: usize, produced: bool| -> u64 {
        if !shard_grads {
            return 0;
        }
        let alive = |p: usize| at[p] < step || (produced && at[p] == step);
        let pending = buckets.iter().zip(&done).filter(|(_, &d)| d >= step);
        pending
            .flat_map(|(b, _)| b.params.clone())
            .filter(|&p| alive(p))
            .map(|p| trained.numels()[p] as u64 * elt)
            .sum()
    };
    let full = sharding == Sharding::Full;
    let stem_for = acts.stem_regathered_for.filter(|_| full);
    let given_back = |u: Unit| u.given_back(full, stem_for.is_some());
    let mut top = (0, 0);
    for step in 0..=n + 1 {
        let unit = match step {
            0 => Unit::Head,
            s if s > n => Unit::Stem,
            s => Unit::Layer(n - s),
        };
        let layer = match unit {
            Unit::Layer(i) => Some(i),
            _ => None,
        };
        let before = acts.around
            + match unit {
                Unit::Layer(i) => acts.kept[..i].iter().sum::<u64>(),
                Unit::Head => acts.kept.iter().sum(),
                Unit::Stem => 0,
            };
        // The unit's weights, gathered (and the stem's, back early for the first layers); and
        // the gathers of the unit backward reaches next in flight: each of its buckets whole
        // beside this rank's share of it, in the weights' dtype.
        let stem_back = stem_for.is_some_and(|k| layer.is_some_and(|i| i < k));
        let next = match unit {
            Unit::Head if n > 0 => Some(Unit::Layer(n - 1)),
            Unit::Layer(i) if i > 0 => Some(Unit::Layer(i - 1)),
            Unit::Head | Unit::Layer(_) if !stem_back => Some(Unit::Stem),
            _ => None,
        };
        let weights = match given_back(unit) {
            true => trained.weights_of(unit, elt),
            false => 0,
        };
        let stem = match stem_back {
            true => trained.weights_of(Unit::Stem, elt),
            false => 0,
        };
        let prefetch = next
            .filter(|&u| given_back(u))
            .map_or(0, |u| trained.gathering(u, elt));
        let gathered = weights + stem + prefetch;
        // Sharded gradients: a completing bucket flattened into f32 (after f32 copies of bf16
        // gradients) beside its gradients; then, while backward goes on, its reduce-scatter in
        // flight (the f32 bucket and the share it brings), until the next bucket completes.
        let completing = |at_step: usize| {
            buckets
                .iter()
                .zip(&done)
                .filter(move |(_, &d)| d == at_step)
                .map(|(b, _)| b)
        };
        let flattening = match shard_grads {
            true => completing(step)
                .map(|b| flat * trained.bucket(b))
                .max()
                .unwrap_or(0),
            false => 0,
        };
        let last_completion = done.iter().copied().filter(|&d| d < step).max();
        let reducing = match (shard_grads, last_completion) {
            (true, Some(d)) => completing(d)
                .map(|b| trained.in_flight(b))
                .max()
                .unwrap_or(0),
            _ => 0,
        };
        let entering = (
            before + layer.map_or(0, |i| acts.saved[i].max(acts.working[i])),
            share + grads_at(step, false) + gathered + reducing,
        );
        let leaving = (before, share + grads_at(step, true) + flattening + gathered);
        for (a, t) in [entering, leaving] {
            if a + t > top.0 + top.1 {
                top = (a, t);
            }
        }
    }
    top
}

/// Predict one rank's peak tensor memory for `run` laid out as `layout`, with `kernels` running
/// (libtorch's CPU kernels save more than the fused CUDA ones). Fails naming the field where the
/// plan cannot apply.
pub fn predict(
    run: &RunConfig,
    layout: &Layout,
    kernels: Kernels,
) -> Result<RankMemory, ConfigError> {
    let elt = run.training.precision.kind().elt_size_in_bytes() as u64;
    let sharding = layout.sharding;
    let shard_grads = matches!(sharding, Sharding::Gradients | Sharding::Full);
    let full = sharding == Sharding::Full;
    let activations = run.model.activations();
    let layer_names: Vec<&str> = activations.layers.iter().map(|l| l.name.as_str()).collect();
    let specs = run.model.param_specs(layout.tp as i64);
    let lora = match &run.lora {
        Some(l) => Some(LoraPlan::new(l, &specs, elt)?),
        None => None,
    };
    let trained = Trained::new(
        lora.as_ref().map_or(&specs, |l| &l.specs),
        run,
        layout,
        &layer_names,
    );
    // Whether full sharding gives parameter `p`'s weight back between uses.
    let stem_and_head = activations.stem_regathered_for.is_some();
    let given_back = |p: usize| trained.unit[p].given_back(full, stem_and_head);
    let params = trained.sum(|_| true);
    let owned = trained.buckets.owned as u64;
    let shards = layout.shards() as u64;

    // State between steps.
    let kept = if sharding == Sharding::None {
        params
    } else {
        owned
    };
    let weights = trained.sum(|p| !given_back(p)) * elt + lora.as_ref().map_or(0, |l| l.base);
    let gradients = if shard_grads { 0 } else { params * elt };
    let masters = if full || elt != 4 { 4 * kept } else { 0 };
    let optimizer = masters + 8 * kept;
    let ema = if run.training.ema_decay > 0.0 {
        4 * kept
    } else {
        0
    };
    let state = weights + gradients + optimizer + ema;
    let share = if shard_grads { 4 * owned } else { 0 };

    let activation_elt = lora.as_ref().map_or(elt, |l| l.activation_elt);
    let acts = MicroBatch::new(run, layout, kernels, activation_elt, lora.as_ref());
    let (backward_acts, mut backward) = backward_peak(&trained, &acts, sharding, elt, share);
    // A float8 base widens each weight to bf16 for its product.
    backward += 2 * lora.as_ref().map_or(0, |l| l.widened);

    // Gradient reduction after backward: a bucket's gradients flattened (in f32, after f32
    // copies of bf16 ones), and under optimizer sharding this rank's summed share.
    let flat = if elt == 4 { 4 } else { 8 };
    let buckets = &trained.buckets.buckets;
    let largest_bucket = buckets.iter().map(|b| trained.bucket(b)).max().unwrap_or(0);
    let reduction = match sharding {
        Sharding::None if layout.dp > 1 => flat * largest_bucket,
        Sharding::Optimizer => flat * largest_bucket + 4 * largest_bucket / shards,
        _ => 0,
    };

    // Optimizer step: bf16 gradients copied to f32 for the fused update, then each updated
    // bucket whose weights stay gathered (the bucket and this rank's share in f32, one
    // parameter converted).
    let whole = buckets.iter().filter(|b| !given_back(b.params.start));
    let gather = match whole.map(|b| trained.bucket(b)).max() {
        Some(updated) => {
            let largest_param = trained.numels().iter().copied().max().unwrap_or(0) as u64;
            4 * updated + 4 * updated / shards + (2 + elt) * largest_param
        }
        None => 0,
    };
    let step = match sharding {
        Sharding::None if elt == 4 => 0,
        Sharding::None => 4 * trained.largest_adamw_chunk(),
        Sharding::Optimizer if elt == 4 => gather,
        Sharding::Optimizer => gather.max(4 * owned),
        Sharding::Gradients | Sharding::Full => share + gather,
    };

    // Building: each weight is initialised whole in f32, then kept as this rank's shard in the
    // training dtype. Under full sharding the f32 masters exist first and a weight full sharding
    // gives back goes once its share is in them, so only the others accumulate; otherwise the
    // whole model's shard does (of a float8 LoRA base, its float8 copies).
    let build = match full {
        true => {
            let creating = |p: usize| {
                let typed = elt * trained.numels()[p] as u64;
                4 * trained.specs[p].numel() + if given_back(p) { typed } else { 0 }
            };
            let largest_creation = (0..trained.specs.len()).map(creating).max().unwrap_or(0);
            4 * owned + weights + largest_creation
        }
        false => match lora.as_ref().filter(|l| l.widened > 0) {
            // A float8 base takes each linear to float8 as it is created.
            Some(l) => l.base + l.largest_creation(&specs),
            None => {
                // A LoRA run builds its base in the base's dtype.
                let built_elt = lora.as_ref().map_or(elt, |l| l.activation_elt);
                let largest_creation = specs.iter().map(|s| 4 * s.numel()).max().unwrap_or(0);
                specs.iter().map(ParamSpec::local_numel).sum::<u64>() * built_elt + largest_creation
            }
        },
    };
    let during = |phase, activations, transient| PhasePeak {
        phase,
        activations,
        transient,
        total: state + activations + transient,
    };
    Ok(RankMemory {
        trained_params: params,
        weights,
        gradients,
        optimizer,
        ema,
        phases: vec![
            PhasePeak {
                phase: Phase::Build,
                activations: 0,
                transient: build,
                total: build,
            },
            during(Phase::Backward, backward_acts, backward),
            during(Phase::GradientReduction, 0, reduction),
            during(Phase::OptimizerStep, 0, step),
        ],
    })
}

/// The most samples per micro-batch (up to `limit`) whose peak fits in `budget` bytes, or `None`
/// when not even one does.
pub fn largest_micro_batch(
    run: &RunConfig,
    layout: &Layout,
    kernels: Kernels,
    budget: u64,
    limit: u64,
) -> Result<Option<u64>, ConfigError> {
    let fits = |b: u64| -> Result<bool, ConfigError> {
        let at = Layout {
            micro_batch: b,
            ..*layout
        };
        Ok(predict(run, &at, kernels)?.peak() <= budget)
    };
    if limit == 0 || !fits(1)? {
        return Ok(None);
    }
    // The peak grows with the micro-batch: bisect between one that fits and one that does not.
    let (mut lo, mut hi) = (1, limit + 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

/// Every layout of `run`'s model on `ranks` ranks worth comparing: each tensor-parallel size
/// the model allows that divides `ranks` (sequence-parallel where the model supports it and
/// the tokens split), the rest data parallel, at each sharding level the replicas allow (with
/// `run`'s HSDP group where it divides them), with and without recomputation, at `run`'s
/// micro-batch; only layouts `train` accepts ([`Layout::accepted`]).
pub fn candidate_layouts(run: &RunConfig, ranks: usize) -> Vec<Layout> {
    let model = &run.model;
    let sp_supported = model.check_sequence_parallel().is_ok();
    let mut out = Vec::new();
    for tp in (1..=ranks).filter(|&tp| ranks.is_multiple_of(tp)) {
        if model.check_tp_size(tp).is_err() {
            continue;
        }
        let dp = ranks / tp;
        let group = run.parallelism.shard_group_size as usize;
        let shard_group = if group > 1 && dp.is_multiple_of(group) && group < dp {
            group
        } else {
            0
        };
        for sharding in [
            Sharding::None,
            Sharding::Optimizer,
            Sharding::Gradients,
            Sharding::Full,
        ] {
            if sharding != Sharding::None && dp < 2 {
                continue;
            }
            for recompute in [false, true] {
                let layout = Layout {
                    tp,
                    dp,
                    shard_group: if sharding == Sharding::None {
                        0
                    } else {
                        shard_group
                    },
                    sharding,
                    sequence_parallel: tp > 1 && sp_supported,
                    recompute,
                    micro_batch: run.training.micro_batch_size,
                };
                // Sequence parallelism where the token counts split, else without it; only
                // what `train` would accept (a batch that splits, no recompute with dropout).
                let without_sp = Layout {
                    sequence_parallel: false,
                    ..layout
                };
                out.extend(
                    [layout, without_sp]
                        .into_iter()
                        .find(|l| l.accepted(run, ranks).is_ok()),
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// benches/side_by_side.toml with a global batch that splits over up to 4 replicas, and
    /// `overrides`.
    fn run(overrides: &[&str]) -> RunConfig {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../benches/side_by_side.toml");
        let overrides: Vec<String> = std::iter::once("training.global_batch_size=8")
            .chain(overrides.iter().copied())
            .map(str::to_string)
            .collect();
        RunConfig::load(std::path::Path::new(path), &overrides).unwrap()
    }

    fn at(run: &RunConfig, ranks: usize, change: impl FnOnce(&mut Layout)) -> RankMemory {
        let mut layout = Layout::of(run, ranks).unwrap();
        change(&mut layout);
        predict(run, &layout, Kernels::Composite).unwrap()
    }

    #[test]
    fn each_sharding_level_keeps_less_state_than_the_one_before() {
        let run = run(&["training.precision=\"bf16\""]);
        let states: Vec<u64> = [
            Sharding::None,
            Sharding::Optimizer,
            Sharding::Gradients,
            Sharding::Full,
        ]
        .into_iter()
        .map(|s| at(&run, 4, |l| l.sharding = s).state())
        .collect();
        assert!(states.windows(2).all(|w| w[1] < w[0]), "{states:?}");
        // Plain bf16: weights and gradients at 2 bytes, masters and moments at 12.
        let plain = at(&run, 4, |_| ());
        assert_eq!(plain.weights, plain.gradients);
        assert_eq!(plain.optimizer, 6 * plain.weights);
        // Optimizer sharding over 4 replicas keeps a quarter of it (up to the buckets' padding).
        let sharded = at(&run, 4, |l| l.sharding = Sharding::Optimizer);
        let quarter = plain.optimizer / 4;
        assert!(sharded.optimizer >= quarter && sharded.optimizer < quarter + 4096);
        // HSDP in groups of 2 keeps a half.
        let hsdp = at(&run, 4, |l| {
            l.sharding = Sharding::Optimizer;
            l.shard_group = 2;
        });
        assert!(hsdp.optimizer.abs_diff(plain.optimizer / 2) < 4096);
    }

    #[test]
    fn full_sharding_keeps_no_whole_weight_between_steps() {
        let run = run(&[]);
        let full = at(&run, 2, |l| l.sharding = Sharding::Full);
        assert_eq!(full.weights, 0);
        // Nothing stays gathered for the optimizer to write: its step only updates the share.
        let step = full.phases.iter().find(|p| p.phase == Phase::OptimizerStep);
        // The f32 gradient share: a third of the masters and moments.
        assert_eq!(step.unwrap().transient, full.optimizer / 3);
    }

    #[test]
    fn recomputation_and_sequence_parallelism_shrink_the_activations() {
        let run = run(&["parallelism.tensor_parallel_size=2"]);
        let acts = |m: &RankMemory| {
            m.phases
                .iter()
                .find(|p| p.phase == Phase::Backward)
                .unwrap()
                .activations
        };
        let kept = acts(&at(&run, 2, |_| ()));
        let recomputed = acts(&at(&run, 2, |l| l.recompute = true));
        let split = acts(&at(&run, 2, |l| l.sequence_parallel = true));
        assert!(recomputed < kept / 3, "{recomputed} vs {kept}");
        assert!(split < kept, "{split} vs {kept}");
        // Twice the micro-batch, twice the activations.
        let double = acts(&at(&run, 2, |l| l.micro_batch *= 2));
        assert_eq!(double.abs_diff(2 * kept), 0);
    }

    #[test]
    fn the_largest_micro_batch_is_the_last_that_fits() {
        let run = run(&[]);
        let layout = Layout::of(&run, 2).unwrap();
        let peak = |b: u64| {
            let l = Layout {
                micro_batch: b,
                ..layout
            };
            predict(&run, &l, Kernels::Fused).unwrap().peak()
        };
        let budget = peak(5) + 1;
        let b = largest_micro_batch(&run, &layout, Kernels::Fused, budget, 100).unwrap();
        assert_eq!(b, Some(5));
        assert!(peak(6) > budget);
        assert_eq!(
            largest_micro_batch(&run, &layout, Kernels::Fused, peak(1) - 1, 100).unwrap(),
            None
        );
        assert_eq!(
            largest_micro_batch(&run, &layout, Kernels::Fused, u64::MAX, 7).unwrap(),
            Some(7)
        );
    }

    #[test]
    fn a_lora_run_holds_its_base_in_its_dtype_and_trains_the_adapters_alone() {
        let lora = |extra: &[&str]| {
            let mut o = vec!["lora.rank=4", "lora.targets=[\"*\"]"];
            o.extend(extra);
            at(&run(&o), 1, |_| ())
        };
        let full = at(&run(&[]), 1, |_| ());
        let f32_base = lora(&[]);
        let bf16_base = lora(&["lora.base_precision=\"bf16\""]);
        let fp8_base = lora(&["lora.base_precision=\"fp8\""]);
        // The adapters train: their f32 gradients and moments, a small part of the model's.
        let adapters = f32_base.trained_params;
        assert!(adapters * 20 < full.trained_params, "{adapters}");
        assert_eq!(f32_base.gradients, 4 * adapters);
        assert_eq!(f32_base.optimizer, 8 * adapters);
        // The base as built, halved in bf16; in float8 its linears take a byte an element.
        let base = |m: &RankMemory| m.weights - 4 * adapters;
        assert_eq!(base(&f32_base), full.weights);
        assert_eq!(base(&bf16_base), full.weights / 2);
        let fp8 = base(&fp8_base) as f64 / base(&bf16_base) as f64;
        assert!((0.5..0.55).contains(&fp8), "{fp8}");
        // A frozen model saves less: no input of a linear without an adapter, no modulation's
        // or norm scale's; adapters on fewer linears save less still.
        let acts = |m: &RankMemory| {
            let backward = m.phases.iter().find(|p| p.phase == Phase::Backward);
            backward.unwrap().activations
        };
        let qkv = at(
            &run(&["lora.rank=4", "lora.targets=[\"linear_qkv\"]"]),
            1,
            |_| (),
        );
        assert!(acts(&f32_base) < acts(&full), "{f32_base:?}");
        assert!(acts(&qkv) < acts(&f32_base) * 3 / 4, "{qkv:?}");
        // Adapters on the single layers alone: the joint layers before them save nothing.
        let single = at(
            &run(&["lora.rank=4", "lora.targets=[\"linear_qkv_fc1\"]"]),
            1,
            |_| (),
        );
        assert!(acts(&single) < acts(&qkv), "{single:?}");
    }

    #[test]
    fn lora_runs_are_not_offered_fully_sharded() {
        let run = run(&["lora.rank=4", "lora.targets=[\"*\"]"]);
        let layouts = candidate_layouts(&run, 4);
        assert!(layouts.iter().any(|l| l.sharding == Sharding::Gradients));
        assert!(layouts.iter().all(|l| l.sharding != Sharding::Full));
    }

    #[test]
    fn layouts_cover_every_divisor_and_skip_sharding_without_replicas() {
        let run = run(&[]);
        let layouts = candidate_layouts(&run, 4);
        // TP 1 and 2 (the side-by-side model has 8 heads; TP 4 too): DP 4, 2 and 1.
        let tps: Vec<usize> = layouts.iter().map(|l| l.tp).collect();
        assert!(tps.contains(&1) && tps.contains(&2) && tps.contains(&4));
        assert!(layouts
            .iter()
            .filter(|l| l.dp == 1)
            .all(|l| l.sharding == Sharding::None));
        assert!(layouts.iter().all(|l| l.sequence_parallel == (l.tp > 1)));
        assert!(layouts.iter().all(|l| l.accepted(&run, 4).is_ok()));
    }

    #[test]
    fn layouts_train_would_refuse_are_not_offered() {
        // A global batch of 4 does not split over 4 replicas of 2; dropout forbids
        // recomputation.
        let run = run(&["training.global_batch_size=4", "model.hidden_dropout=0.1"]);
        let layouts = candidate_layouts(&run, 4);
        assert!(layouts.iter().any(|l| l.dp == 2), "{layouts:?}");
        assert!(
            layouts.iter().all(|l| l.dp <= 2 && !l.recompute),
            "{layouts:?}"
        );
        assert!(layouts.iter().all(|l| l.accepted(&run, 4).is_ok()));
    }
}
