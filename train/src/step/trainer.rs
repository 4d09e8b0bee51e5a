//! The training loop: micro-batches with gradient accumulation, tensor- and data-parallel
//! gradient completion, clipping, AdamW, held-out evaluation.

use std::collections::HashMap;
use std::time::Instant;

use flux_data::checkpoint::{self, LoadedCheckpoint, OptimizerState, TrainingState};
use flux_data::dataset::BatchPlan;
use flux_data::DataError;
use flux_model::execution::residency::{release_storage, storage_present};
use flux_model::float8::Float8Weight;
use flux_model::lora::{export, Adapters};
use flux_model::tensor_memory;
use flux_model::tp::{creation, staging, Collective, DpGroups, ParamSpec, ShardedStore, TpContext};
use flux_model::{ConfigError, DiffusionModel};
use tch::{Device, Kind};

use crate::config::run_config::Sharding;
use crate::config::sections::{LoraConfig, NonFinitePolicy, Precision};
use crate::feed::data_source::{DataSource, DrawSettings};
use crate::feed::step_data::{step_data, NoiseLevels, StepData};
use crate::logging::metrics::peak_rss_mib;
use crate::logging::units::bytes_of;
use crate::lora::adapter_file::read_adapter_file;
use crate::lora::base_weights::BaseWeights;
use crate::optimizer::ema::Ema;
use crate::optimizer::optim::learning_rate;
use crate::parallel::data_parallel::{dp_optimizer, DpOptimizer};
use crate::parallel::grad_hooks::OverlapReport;
use crate::parallel::sharded_build::ShardedBuild;
use crate::run::resume::check_architecture;
use crate::sampling::{generate, Conditioning, OdeSettings};
use crate::scheduler::{DynamicShift, FlowMatchEulerDiscreteScheduler};
use crate::step::loss::compute_diffusion_loss;
use crate::{RunConfig, EVAL_BASE};

/// What one optimizer step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Global mean loss.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Wall time of the step, s.
    pub seconds: f64,
    /// Image plus text tokens of one of the step's samples (all share a resolution bucket).
    pub tokens_per_sample: u64,
    /// The loss or gradient norm was not finite and `[training] nonfinite = "skip"` dropped the
    /// update.
    pub skipped: bool,
    /// Under `[parallelism] overlap_grad_reduce`: how the gradient sums overlapped backward.
    pub overlap: Option<OverlapReport>,
    /// Bytes the step's collectives staged through host `f32` buffers on this rank (tensors
    /// copied off the GPU or converted for MPI; [`flux_model::tp::staging`]).
    pub host_staged_bytes: u64,
}

/// What this rank saw in a step whose loss or gradient norm was not finite.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NonFiniteReport {
    /// The step that would have been taken (1-based).
    pub step: u64,
    /// Global mean loss.
    pub loss: f64,
    /// Global gradient norm.
    pub grad_norm: f64,
    /// Where the data reader was at the start of the step.
    pub data_epoch: u64,
    /// Sample index within the epoch at the start of the step.
    pub data_index: u64,
    /// This rank's data-parallel index.
    pub dp_rank: usize,
    /// The samples this rank trained on in the step (their source keys).
    pub samples: Vec<String>,
    /// This rank's parameters whose (local) gradient holds a NaN or an infinity.
    pub nonfinite_grads: Vec<String>,
}

/// Why a step did not complete.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// Reading the step's samples failed.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The loss or gradient norm was not finite under `[training] nonfinite = "stop"`.
    #[error(
        "step {}: loss {} and gradient norm {} are not all finite; stopping before the update \
         ([training] nonfinite = \"stop\")",
        .0.step, .0.loss, .0.grad_norm
    )]
    NonFinite(Box<NonFiniteReport>),
    /// Under `[training] nonfinite = "skip"`, `max_consecutive_skips` steps in a row were skipped.
    #[error(
        "step {}: loss {} and gradient norm {} are not all finite for the {}th step in a row; \
         stopping ([training] max_consecutive_skips = {})",
        .0.step, .0.loss, .0.grad_norm, .1, .1
    )]
    TooManySkips(Box<NonFiniteReport>, u64),
}

impl StepError {
    /// What the step saw, for a non-finite stop.
    pub fn report(&self) -> Option<&NonFiniteReport> {
        match self {
            Self::NonFinite(report) | Self::TooManySkips(report, _) => Some(report),
            Self::Data(_) => None,
        }
    }
}

/// One rank's trainer.
pub struct Trainer<'a> {
    run: RunConfig,
    model: Box<dyn DiffusionModel>,
    /// Under `[lora]`: the adapters trained in place of the (frozen) model.
    adapters: Option<Adapters>,
    /// Under `[training] ema_decay > 0`: the moving average of the trained weights.
    ema: Option<Ema>,
    optimizer: Box<dyn DpOptimizer + 'a>,
    data: DataSource,
    /// Global samples consumed (the counter the next step starts at).
    consumed: u64,
    scheduler: FlowMatchEulerDiscreteScheduler,
    dp: &'a dyn Collective,
    device: Device,
    step: u64,
    /// Steps skipped in a row for a non-finite loss or gradient norm.
    consecutive_skips: u64,
    /// The most bytes of tensors alive on the device until the model was built.
    build_peak: Option<u64>,
    /// The run's identity, stamped on its checkpoints (kept from the checkpoint it resumes).
    run_id: String,
}

/// The run's model on this rank of tensor group `tp`, as training uses it: weights seeded by
/// `[training] seed` (identical on every rank before sharding), bf16 under `precision = "bf16"`
/// and `"fp8"` (the latter with the `[fp8]` linears switched to float8 GEMMs) and for a
/// `[lora] base_precision` of bf16 or fp8, layer recomputation as `[training] recompute` says.
pub fn build_model(
    run: &RunConfig,
    device: Device,
    tp: TpContext,
) -> Result<Box<dyn DiffusionModel>, ConfigError> {
    let t = &run.training;
    tch::manual_seed(t.seed as i64);
    // A LoRA run's frozen base is built in its own dtype, never wider.
    let kind = match &run.lora {
        Some(lora) if lora.base_precision != Precision::Fp32 => Kind::BFloat16,
        _ => t.precision.kind(),
    };
    let model = run.model.build_as(device, kind, tp)?;
    if let Some(settings) = run.float8() {
        let chosen = flux_model::float8::convert(model.as_ref(), &settings)?;
        let mut linears = 0;
        model.visit_linears(&mut |_| linears += 1);
        tracing::info!(
            recipe = settings.recipe.name(),
            "float8 GEMMs in {} of {linears} linears",
            chosen.len()
        );
    }
    model.set_recompute(t.recompute);
    Ok(model)
}

/// A LoRA run's frozen model on this rank of tensor group `tp`: built in the base's dtype
/// ([`build_model`]) with `[lora] base` read into each weight as it is created and, for a
/// float8 base, each linear's weight quantized and its memory given back at once, so neither the
/// checkpoint nor the bf16 base ever exists whole.
fn build_lora_base(
    run: &RunConfig,
    lora: &LoraConfig,
    device: Device,
    tp: TpContext,
) -> Result<Box<dyn DiffusionModel>, ConfigError> {
    let specs = run.model.param_specs(tp.size() as i64);
    let base = match &lora.base {
        Some(path) => Some(BaseWeights::open(path, run.model.architecture(), &specs)?),
        None => None,
    };
    let float8 = lora.base_precision == Precision::Fp8;
    let by_name: HashMap<&str, &ParamSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
    let rank = tp.rank();
    let mut held = HashMap::new();
    let mut failed = None;
    let mut model = creation::while_creating(
        |name, weight| {
            let Some(spec) = by_name.get(name) else {
                return;
            };
            if let Some(base) = &base {
                match base.logical(name) {
                    Ok(full) => {
                        let local = spec.shard_of(&full, rank);
                        tch::no_grad(|| weight.shallow_clone().copy_(&local));
                    }
                    Err(e) if failed.is_none() => failed = Some(e),
                    Err(_) => {}
                }
            }
            if float8 && spec.linear {
                held.insert(name.to_string(), Float8Weight::quantize(weight));
                release_storage(weight);
            }
        },
        || build_model(run, device, tp),
    )?;
    if let Some(e) = failed {
        return Err(e);
    }
    model.store_mut().vs.freeze();
    if float8 {
        let bytes = flux_model::float8::hold_frozen_in_float8(model.as_ref(), &mut held);
        tracing::info!("frozen base linears held in float8: {bytes} bytes");
    }
    Ok(model)
}

impl<'a> Trainer<'a> {
    /// Build the model (seeded by `[training] seed`, identical on every rank before sharding), the
    /// optimizer and the data for this rank of tensor group `tp` and data-parallel groups
    /// `groups` (the replicas, and the shard groups sharded state lives in).
    pub fn new(
        run: &RunConfig,
        device: Device,
        tp: TpContext,
        groups: DpGroups<'a>,
    ) -> Result<Self, ConfigError> {
        let dp = groups.all;
        let t = &run.training;
        let replicas = dp.size();
        run.check_batch_split(replicas)?;
        let p = run.model.inputs().patch_size;
        if t.latent_height % p != 0 || t.latent_width % p != 0 {
            return Err(ConfigError::new(
                "training.latent_height",
                format!("latent sides must be multiples of patch_size {p}"),
            ));
        }
        let sharding = run.parallelism.sharding;
        run.parallelism
            .replicas(tp.size() * replicas)
            .map_err(|e| e.within("parallelism"))?;
        // Count the tensors' bytes from the first weight on, where the device is the CPU.
        if device == Device::Cpu {
            tensor_memory::count_cpu_tensors();
        }
        // Under "full", each weight's share goes to the masters as it is created and a layer's
        // weights are given back at once, so the whole model never exists on one rank.
        let (model, built) = match sharding {
            Sharding::Full => {
                let mut build = ShardedBuild::new(
                    &run.model.param_specs(tp.size() as i64),
                    tp.size(),
                    run.parallelism.bucket_elements(),
                    (groups.shard.size(), groups.shard.rank()),
                    device,
                );
                let model = creation::while_creating(
                    |name, weight| build.take(name, weight),
                    || build_model(run, device, tp),
                )?;
                (model, Some(build.finish()))
            }
            _ => match &run.lora {
                Some(lora) => (build_lora_base(run, lora, device, tp)?, None),
                None => (build_model(run, device, tp)?, None),
            },
        };
        let build_peak = tensor_memory::tensor_bytes(device).ok().map(|b| b.peak);
        let adapters = match &run.lora {
            None => None,
            Some(lora) => {
                let mut adapters =
                    Adapters::attach(model.as_ref(), lora.settings(), &lora.targets)?;
                if let Some(init) = &lora.init {
                    let file = read_adapter_file(init, &run.model)
                        .map_err(|e| ConfigError::new("lora.init", e))?;
                    adapters.load_imported(&file, &init.display().to_string())?;
                }
                if t.precision.kind() == tch::Kind::BFloat16 {
                    adapters.store_mut().vs.bfloat16();
                }
                Some(adapters)
            }
        };
        let trained = adapters.as_ref().map_or(model.store(), Adapters::store);
        let layers = model.layers();
        let optimizer = dp_optimizer(
            trained,
            &run.optimization,
            &run.parallelism,
            groups,
            &layers,
            built,
        );
        let ema =
            (t.ema_decay > 0.0).then(|| Ema::new(t.ema_decay, t.ema_every, &optimizer.masters()));
        Ok(Self {
            run: run.clone(),
            model,
            adapters,
            ema,
            optimizer,
            data: DataSource::open(run)?,
            consumed: 0,
            scheduler: FlowMatchEulerDiscreteScheduler::new(1000, 1.0, None),
            dp,
            device,
            step: 0,
            consecutive_skips: 0,
            build_peak,
            run_id: String::new(),
        })
    }

    /// Name the run whose checkpoints this trainer writes ([`RunDir::fresh_id`] for a new run;
    /// [`Trainer::restore`] takes the checkpoint's own afterwards).
    ///
    /// [`RunDir::fresh_id`]: crate::RunDir::fresh_id
    pub fn set_run_id(&mut self, id: &str) {
        self.run_id = id.to_string();
    }

    /// The most bytes of tensors alive on the device while the model was built (what `flux-hpc
    /// plan` calls the build phase; on the CPU counted from `Trainer::new` on), where the device
    /// counts them.
    pub fn build_peak_bytes(&self) -> Option<u64> {
        self.build_peak
    }

    /// The model.
    pub fn model(&self) -> &dyn DiffusionModel {
        self.model.as_ref()
    }

    /// The LoRA adapters, under `[lora]`.
    pub fn adapters(&self) -> Option<&Adapters> {
        self.adapters.as_ref()
    }

    /// The parameters training updates and checkpoints hold: the adapters under `[lora]`, else
    /// the model's.
    pub fn trained(&self) -> &ShardedStore {
        self.adapters
            .as_ref()
            .map_or(self.model.store(), Adapters::store)
    }

    /// Bytes this rank holds for the optimizer beyond the weights and their gradients (see
    /// [`DpOptimizer::state_bytes`]).
    pub fn optimizer_state_bytes(&self) -> u64 {
        self.optimizer.state_bytes()
    }

    /// Bytes this rank holds for the model between steps: the weights whose memory is present
    /// (all but the layers `sharding = "full"` gives back; a frozen base's float8 copies),
    /// gradients, and the optimizer state.
    pub fn model_state_bytes(&self) -> u64 {
        let stores = [
            Some(self.model.store()),
            self.adapters.as_ref().map(Adapters::store),
        ];
        let variables: Vec<tch::Tensor> = stores
            .into_iter()
            .flatten()
            .flat_map(|s| s.vs.variables().into_values())
            .collect();
        let present = variables.iter().filter(|v| storage_present(v));
        let grads: Vec<tch::Tensor> = variables
            .iter()
            .map(tch::Tensor::grad)
            .filter(tch::Tensor::defined)
            .collect();
        let mut float8 = 0;
        self.model
            .visit_linears(&mut |l| float8 += l.float8_weight_bytes());
        bytes_of(present)
            + float8
            + bytes_of(&grads)
            + self.optimizer.gradient_bytes()
            + self.optimizer.state_bytes()
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    fn loss_of(&self, d: &StepData, train: bool) -> tch::Tensor {
        if let Some(adapters) = &self.adapters {
            adapters.set_training(train);
        }
        let batch = d.batch.to_kind(self.model.kind());
        let prediction = self
            .model
            .forward(&batch, train)
            .expect("inputs are built from the model's input spec");
        let target = self
            .run
            .training
            .prediction
            .target(&d.x0, &d.noise, &d.sigmas);
        compute_diffusion_loss(
            &prediction,
            &target,
            self.run.training.loss,
            d.mask.as_ref(),
        )
    }

    /// One optimizer step over the global batch: this rank's micro-batches, gradients completed
    /// across tensor and data parallelism, clipped, applied. A non-finite loss or gradient norm
    /// (the same on every rank: both are global) is handled by `[training] nonfinite`.
    pub fn train_step(&mut self) -> Result<StepStats, StepError> {
        let start = Instant::now();
        let staged_before = staging::host_staged_bytes();
        flux_model::execution::recompute::clear_pending();
        let t = self.run.training.clone();
        let (rank, replicas) = (self.dp.rank() as u64, self.dp.size() as u64);
        let plan = BatchPlan {
            next_step_start: self.consumed,
            global: t.global_batch_size,
            micro: t.micro_batch_size,
            rank,
            replicas,
        };
        let sampler = t.timestep_sampling;
        let mut local_loss = 0f64;
        let mut ids = Vec::new();
        let mut tokens_per_sample = 0;
        let mut overlap = None;
        for m in 0..plan.micro_steps() {
            let draw = DrawSettings {
                seed: t.seed,
                dropout_prob: t.cfg_dropout_prob,
            };
            let (samples, draws, sample_ids) = self.data.train_batch(plan, m, draw, self.device)?;
            ids.extend(sample_ids);
            let inputs = self.run.model.inputs();
            let size = samples.latents.size(); // [B, C, H, W]
            let image = inputs.image_tokens(size[2], size[3]);
            tokens_per_sample = (image + inputs.text_tokens(t.text_len)) as u64;
            let shift = t.resolution_shift.then(DynamicShift::default);
            let levels = NoiseLevels::Sampled(&sampler, &self.scheduler, shift);
            let d = step_data(
                samples,
                &self.run.model.inputs(),
                draws,
                levels,
                self.data.empty_prompt(),
                self.device,
            );
            // Each micro-batch's share of the global mean, so that the sum over micro-batches and
            // replicas is the loss of the whole batch.
            let loss =
                self.loss_of(&d, true) * (t.micro_batch_size as f64 / t.global_batch_size as f64);
            let last = m + 1 == plan.micro_steps();
            self.optimizer.before_backward(last);
            loss.backward();
            overlap = self.optimizer.after_backward(last).or(overlap);
            local_loss += loss.double_value(&[]);
        }
        self.trained().finish_grads();
        let trained = self
            .adapters
            .as_ref()
            .map_or(self.model.store(), Adapters::store);
        let grad_norm = self
            .optimizer
            .reduce_and_clip(trained, self.run.optimization.gradient_clip);
        let mut loss = [local_loss as f32];
        self.dp.all_reduce_sum(&mut loss);
        let loss = loss[0] as f64;
        let lr = learning_rate(&self.run.optimization, self.step, t.total_steps);
        let skipped = !(loss.is_finite() && grad_norm.is_finite());
        self.consecutive_skips = if skipped {
            self.consecutive_skips + 1
        } else {
            0
        };
        let give_up = t.nonfinite == NonFinitePolicy::Stop
            || self.consecutive_skips >= t.max_consecutive_skips;
        if skipped && give_up {
            let position = self.data.position(self.consumed);
            let report = Box::new(NonFiniteReport {
                step: self.step + 1,
                loss,
                grad_norm,
                data_epoch: position.epoch,
                data_index: position.index,
                dp_rank: self.dp.rank(),
                samples: ids,
                nonfinite_grads: self.nonfinite_grads(),
            });
            return Err(match t.nonfinite {
                NonFinitePolicy::Stop => StepError::NonFinite(report),
                NonFinitePolicy::Skip => StepError::TooManySkips(report, self.consecutive_skips),
            });
        }
        self.step += 1;
        if skipped {
            self.optimizer.zero_grad();
        } else {
            self.optimizer.step(lr);
            if let Some(ema) = &mut self.ema {
                ema.update(self.step, &self.optimizer.masters());
            }
        }
        self.consumed += t.global_batch_size;
        Ok(StepStats {
            loss,
            grad_norm,
            lr,
            seconds: start.elapsed().as_secs_f64(),
            tokens_per_sample,
            skipped,
            overlap,
            host_staged_bytes: staging::host_staged_bytes() - staged_before,
        })
    }

    /// Names of the parameters whose gradient, as far as this rank holds it, has a NaN or an
    /// infinity (under `sharding = "gradients"`: the summed parts it owns).
    fn nonfinite_grads(&self) -> Vec<String> {
        let specs = self.trained().param_specs();
        self.optimizer
            .nonfinite_grads(self.trained())
            .into_iter()
            .map(|i| specs[i].name.clone())
            .collect()
    }

    /// Latents integrated from noise `start` `[B, C, H, W]` with the current weights (adapters
    /// in eval mode), as [`generate`] does; every rank of the tensor-parallel group calls it
    /// together.
    pub fn sample(
        &self,
        start: tch::Tensor,
        cond: &Conditioning,
        negative: Option<&Conditioning>,
        settings: &OdeSettings,
    ) -> tch::Tensor {
        if let Some(adapters) = &self.adapters {
            adapters.set_training(false);
        }
        let inputs = self.run.model.inputs();
        generate(
            self.model.as_ref(),
            &inputs,
            start,
            cond,
            negative,
            settings,
        )
    }

    /// Mean flow-matching loss on the held-out set (fixed samples, fixed noise, σ = (i mod 8)/8),
    /// computed identically on every rank. Fails only when reading data fails.
    pub fn eval_loss(&self) -> Result<f64, DataError> {
        let t = &self.run.training;
        tch::no_grad(|| {
            let mut total = 0.0;
            for numbers in self.data.eval_batches(t.eval_samples, t.micro_batch_size) {
                let samples = self.data.eval_batch(&numbers, self.device)?;
                let keys: Vec<u64> = numbers.iter().map(|i| EVAL_BASE + i).collect();
                let draw = DrawSettings {
                    seed: t.seed,
                    dropout_prob: 0.0,
                };
                let draws = draw.draw(&keys, &samples.latents);
                let inputs = self.run.model.inputs();
                let levels = NoiseLevels::Equidistant;
                let d = step_data(samples, &inputs, draws, levels, None, self.device);
                total += self
                    .loss_of(&d, false)
                    .to_kind(Kind::Double)
                    .double_value(&[])
                    * numbers.len() as f64;
            }
            Ok(total / t.eval_samples as f64)
        })
    }

    /// This rank's part of a checkpoint: master weights, AdamW moments and the EMA (local
    /// shards). With `parts`, a sharded optimizer gives only the parts this rank owns, for a
    /// checkpoint every rank writes its own file of (no collective); otherwise whole shards,
    /// gathered over the data-parallel group.
    pub fn checkpoint_state(&self, parts: bool) -> TrainingState {
        let sharded = parts.then(|| self.optimizer.state_parts()).flatten();
        let mut optimizer = sharded.unwrap_or_else(|| self.optimizer.state());
        optimizer.ema = self.ema.as_ref().map(|e| match optimizer.parts {
            Some(_) => self
                .optimizer
                .parts_of(e.shadows())
                .expect("an optimizer with parts lays out the EMA as parts"),
            None => self.optimizer.per_param(e.shadows()),
        });
        TrainingState {
            step: self.step,
            config: toml::to_string(&self.run).expect("configs serialise"),
            run_id: self.run_id.clone(),
            data: self.data.position(self.consumed),
            optimizer,
        }
    }

    /// Continue from a loaded checkpoint: this rank takes its shard of every logical tensor, at
    /// whatever tensor-parallel size the checkpoint was written. The checkpoint must be of the
    /// run's architecture (checked before any weight is touched) and every tensor of it must be
    /// taken: fails naming both architectures, a missing tensor, or those the model lacks.
    pub fn restore(&mut self, checkpoint: &LoadedCheckpoint) -> Result<(), String> {
        check_architecture(checkpoint, self.run.model.architecture())?;
        let total = self.run.training.total_steps;
        if checkpoint.step > total {
            return Err(format!(
                "{} holds step {} but [training] total_steps = {total}: set total_steps to at \
                 least {} to go on from it (its weights are already trained past that)",
                checkpoint.dir.display(),
                checkpoint.step,
                checkpoint.step
            ));
        }
        if !checkpoint.run_id.is_empty() {
            self.run_id = checkpoint.run_id.clone();
        }
        let rank = self.trained().tp().rank();
        let specs = self.trained().param_specs().to_vec();
        let group = |name: &str| -> Result<Vec<tch::Tensor>, String> {
            let tensors = checkpoint
                .tensors
                .get(name)
                .ok_or_else(|| format!("{}: no `{name}` group", checkpoint.dir.display()))?;
            specs
                .iter()
                .map(|spec| {
                    let full = tensors.get(&spec.name).ok_or_else(|| {
                        format!(
                            "{}: no tensor `{name}/{}`",
                            checkpoint.dir.display(),
                            spec.name
                        )
                    })?;
                    if full.size() != spec.shape {
                        return Err(format!(
                            "{}: `{name}/{}` has shape {:?}, the model needs {:?}",
                            checkpoint.dir.display(),
                            spec.name,
                            full.size(),
                            spec.shape
                        ));
                    }
                    Ok(spec.shard_of(full, rank).to_device(self.device))
                })
                .collect()
        };
        let groups = checkpoint::GROUPS
            .iter()
            .filter_map(|g| Some((g, checkpoint.tensors.get(*g)?)));
        for (name, tensors) in groups {
            let mut unused: Vec<&str> = tensors
                .keys()
                .filter(|t| !specs.iter().any(|s| &s.name == *t))
                .map(String::as_str)
                .collect();
            unused.sort_unstable();
            if !unused.is_empty() {
                return Err(format!(
                    "{}: the checkpoint's `{name}` group holds {} tensor(s) this model does not \
                     have, so resuming would drop them: {} (is the [model] table the one \
                     the run was trained with?)",
                    checkpoint.dir.display(),
                    unused.len(),
                    unused.join(", ")
                ));
            }
        }
        let params = group("params")?;
        // A weights-only checkpoint (converted from BFL or diffusers) starts fresh moments.
        let moments = |name: &str| match checkpoint.tensors.contains_key(name) {
            true => group(name),
            false => Ok(params.iter().map(tch::Tensor::zeros_like).collect()),
        };
        let (exp_avg, exp_avg_sq) = (moments("exp_avg")?, moments("exp_avg_sq")?);
        if let Some(ema) = &mut self.ema {
            // A checkpoint written without an EMA starts the average at its weights.
            let average = match checkpoint.tensors.contains_key("ema") {
                true => group("ema")?,
                false => params.iter().map(tch::Tensor::copy).collect(),
            };
            ema.load(self.optimizer.to_local(&average));
        }
        self.optimizer.load_state(OptimizerState {
            step: checkpoint.optimizer_step,
            params,
            exp_avg,
            exp_avg_sq,
            ema: None,
            parts: None,
        });
        self.step = checkpoint.step;
        self.consumed = self.data.counter(checkpoint.data);
        Ok(())
    }

    /// What a finished run leaves in its directory: file names and their logical tensors (a
    /// collective over the tensor-parallel group). The model's weights in native names
    /// (`final.safetensors`); under `[lora]` the adapters (`final_lora.safetensors`) in
    /// diffusers' LoRA layout, which diffusers' `load_lora_weights` reads, or in native names for
    /// an architecture without one. With an EMA, its weights too (`final_ema.safetensors`,
    /// `final_lora_ema.safetensors`).
    pub fn final_weights(&self) -> Vec<(&'static str, Vec<(String, tch::Tensor)>)> {
        let trained = self.trained();
        let logical = |local: Vec<tch::Tensor>| -> HashMap<String, tch::Tensor> {
            let tp = trained.tp();
            trained
                .param_specs()
                .iter()
                .zip(local)
                .map(|(spec, t)| (spec.name.clone(), tp.gather(spec, &t)))
                .collect()
        };
        let current = logical(self.optimizer.weights(trained));
        let averaged = self
            .ema
            .as_ref()
            .map(|ema| logical(self.optimizer.per_param(ema.shadows())));
        let in_order = |logical: &HashMap<String, tch::Tensor>| -> Vec<(String, tch::Tensor)> {
            trained
                .param_specs()
                .iter()
                .map(|s| (s.name.clone(), logical[&s.name].shallow_clone()))
                .collect()
        };
        let file = |logical: HashMap<String, tch::Tensor>| match &self.adapters {
            None => in_order(&logical),
            Some(adapters) => export::diffusers_state_dict(adapters, &logical, &self.run.model)
                .unwrap_or_else(|_| in_order(&logical)),
        };
        let (plain, ema) = match self.adapters {
            None => ("final.safetensors", "final_ema.safetensors"),
            Some(_) => ("final_lora.safetensors", "final_lora_ema.safetensors"),
        };
        let mut out = vec![(plain, file(current))];
        if let Some(averaged) = averaged {
            out.push((ema, file(averaged)));
        }
        out
    }

    /// Peak resident memory of this process, MiB.
    pub fn peak_memory_mib(&self) -> f64 {
        peak_rss_mib()
    }

    /// The most bytes tensors held at once on the training device since the model was built,
    /// MiB (on the CPU and CUDA).
    pub fn peak_tensor_mib(&self) -> Option<f64> {
        tensor_memory::tensor_bytes(self.device)
            .ok()
            .map(|b| crate::logging::units::mib(b.peak))
    }
}
