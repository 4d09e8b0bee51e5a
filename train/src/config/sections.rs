//! The `[training]`, `[optimization]`, `[data]`, `[checkpoint]` and `[lora]` tables of a run
//! config.

use std::path::PathBuf;

use flux_encoders::Bucket;
use flux_model::lora::LoraSettings;
use flux_model::ConfigError;
use serde::{Deserialize, Serialize};

use crate::step::loss::{Prediction, Reduction};
use crate::step::timesteps::TimestepSampler;

/// Numeric precision of the forward and backward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Everything in f32.
    Fp32,
    /// bf16 weights and activations; f32 master weights, gradients and optimizer state.
    Bf16,
    /// As `Bf16`, with the GEMMs of the linears `[fp8]` selects in float8 (torchao's numerics).
    Fp8,
}

impl Precision {
    /// The dtype of the weights and activations.
    pub fn kind(self) -> tch::Kind {
        match self {
            Precision::Fp32 => tch::Kind::Float,
            Precision::Bf16 | Precision::Fp8 => tch::Kind::BFloat16,
        }
    }
}

/// What a step whose loss or gradient norm is NaN or infinite does (`[training] nonfinite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NonFinitePolicy {
    /// Drop the step's gradients, leave weights and optimizer moments unchanged, log the step as
    /// skipped and go on with the next batch.
    Skip,
    /// Stop the run before the update, writing `nonfinite_step_<N>.json` (loss, norm, the
    /// parameters whose gradients are not finite, the samples of the step) into the run
    /// directory; the last checkpoint stays the one to resume from.
    Stop,
}

/// Largest accepted `total_steps` (with [`MAX_BATCH`], sample counters stay far inside u64).
const MAX_STEPS: u64 = 1 << 32;
/// Largest accepted batch size or held-out sample count.
const MAX_BATCH: u64 = 1 << 24;
/// Largest accepted latent side or text length.
const MAX_SIDE: i64 = 1 << 16;

/// `[training]`: what one run does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingConfig {
    /// Seed of weights, data, noise and timesteps.
    pub seed: u64,
    /// Optimizer steps.
    pub total_steps: u64,
    /// Samples per optimizer step over all data-parallel replicas.
    pub global_batch_size: u64,
    /// Samples per forward pass on one replica; `global / (micro × dp)` micro-batches are
    /// accumulated per step.
    pub micro_batch_size: u64,
    /// Latent height in latent pixels (`[B, C, H, W]`).
    pub latent_height: i64,
    /// Latent width in latent pixels.
    pub latent_width: i64,
    /// Text tokens per sample.
    pub text_len: i64,
    /// How training noise levels are drawn.
    pub timestep_sampling: TimestepSampler,
    /// Shift each batch's drawn noise levels by FLUX.1's resolution rule: `σ' = e^μ / (e^μ +
    /// 1/σ − 1)` with μ linear in the batch's image tokens (0.5 at 256, 1.15 at 4096), so that
    /// larger resolution buckets train at higher noise, as they are sampled.
    pub resolution_shift: bool,
    /// Probability of replacing a sample's text and pooled vector by empty (zero) encodings.
    pub cfg_dropout_prob: f64,
    /// What the model regresses.
    pub prediction: Prediction,
    /// How elementwise errors are reduced.
    pub loss: Reduction,
    /// `fp32`, `bf16` (f32 master weights) or `fp8` (bf16 with float8 GEMMs in the linears
    /// `[fp8]` selects).
    pub precision: Precision,
    /// Recompute each layer's activations during backward instead of storing them (less memory,
    /// one more forward pass). Needs the model's dropouts at 0.
    pub recompute: bool,
    /// Steps between log lines and metrics records.
    pub log_interval: u64,
    /// Steps between held-out evaluations (0: only at the start and the end).
    pub eval_interval: u64,
    /// Held-out samples (fixed noise, 8 equidistant noise levels).
    pub eval_samples: u64,
    /// `"stop"` (default) or `"skip"`: what a step with a non-finite loss or gradient norm does.
    pub nonfinite: NonFinitePolicy,
    /// Under `nonfinite = "skip"`: the run stops (with the diagnostic dump) when this many steps
    /// in a row were skipped, since the weights will not recover by themselves.
    pub max_consecutive_skips: u64,
    /// Keep an f32 exponential moving average of the trained weights with this decay
    /// (`ema ← decay · ema + (1 − decay) · weights`); 0 keeps none.
    pub ema_decay: f64,
    /// Optimizer steps between EMA updates.
    pub ema_every: u64,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            total_steps: 1000,
            global_batch_size: 8,
            micro_batch_size: 8,
            latent_height: 16,
            latent_width: 16,
            text_len: 16,
            timestep_sampling: TimestepSampler::LogitNormal {
                mean: 0.0,
                std: 1.0,
            },
            resolution_shift: false,
            cfg_dropout_prob: 0.0,
            prediction: Prediction::FlowMatching,
            loss: Reduction::Mse,
            precision: Precision::Fp32,
            recompute: false,
            log_interval: 10,
            eval_interval: 0,
            eval_samples: 16,
            nonfinite: NonFinitePolicy::Stop,
            max_consecutive_skips: 20,
            ema_decay: 0.0,
            ema_every: 1,
        }
    }
}

impl TrainingConfig {
    /// Check the table; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::check(self.total_steps > 0, "total_steps", || {
            "must be at least 1".into()
        })?;
        ConfigError::check(
            self.max_consecutive_skips > 0,
            "max_consecutive_skips",
            || "must be at least 1".into(),
        )?;
        ConfigError::check(self.micro_batch_size > 0, "micro_batch_size", || {
            "must be at least 1".into()
        })?;
        ConfigError::check(
            self.global_batch_size.is_multiple_of(self.micro_batch_size)
                && self.global_batch_size > 0,
            "global_batch_size",
            || {
                format!(
                    "{} is not a positive multiple of micro_batch_size {}",
                    self.global_batch_size, self.micro_batch_size
                )
            },
        )?;
        ConfigError::check(self.total_steps <= MAX_STEPS, "total_steps", || {
            format!("must be at most {MAX_STEPS}")
        })?;
        ConfigError::check(
            self.global_batch_size <= MAX_BATCH && self.eval_samples <= MAX_BATCH,
            "global_batch_size",
            || format!("batch sizes and eval_samples must be at most {MAX_BATCH}"),
        )?;
        for (field, side) in [
            ("latent_height", self.latent_height),
            ("latent_width", self.latent_width),
            ("text_len", self.text_len),
        ] {
            ConfigError::check(side > 0 && side <= MAX_SIDE, field, || {
                format!("must be in 1..={MAX_SIDE}, got {side}")
            })?;
        }
        let sampler_ok = match self.timestep_sampling {
            TimestepSampler::LogitNormal { mean, std } => {
                mean.is_finite() && std.is_finite() && std > 0.0
            }
            TimestepSampler::Mode { scale } => scale.is_finite(),
            TimestepSampler::Uniform | TimestepSampler::DirectUniform => true,
        };
        ConfigError::check(sampler_ok, "timestep_sampling", || {
            format!(
                "{:?}: parameters must be finite, with std > 0",
                self.timestep_sampling
            )
        })?;
        if let Reduction::Huber { delta } = self.loss {
            ConfigError::check(delta.is_finite() && delta > 0.0, "loss", || {
                format!("huber delta must be positive and finite, got {delta}")
            })?;
        }
        ConfigError::check(
            (0.0..1.0).contains(&self.cfg_dropout_prob),
            "cfg_dropout_prob",
            || format!("must be in [0, 1), got {}", self.cfg_dropout_prob),
        )?;
        ConfigError::check(self.log_interval > 0, "log_interval", || {
            "must be at least 1".into()
        })?;
        ConfigError::check(self.eval_samples > 0, "eval_samples", || {
            "must be at least 1".into()
        })?;
        ConfigError::check((0.0..1.0).contains(&self.ema_decay), "ema_decay", || {
            format!("must be in [0, 1) (0: no EMA), got {}", self.ema_decay)
        })?;
        ConfigError::check(self.ema_every > 0, "ema_every", || {
            "must be at least 1".into()
        })
    }
}

/// Learning-rate schedule shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// Linear warmup, then cosine decay to `min_lr` at `total_steps`.
    Cosine,
    /// Linear warmup, then constant.
    Constant,
}

/// `[optimization]`: AdamW and its schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizationConfig {
    /// Only `"adamw"`.
    pub optimizer: String,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Final learning rate of the cosine decay.
    pub min_learning_rate: f64,
    /// Decoupled weight decay (not applied to biases and norm scales).
    pub weight_decay: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub epsilon: f64,
    /// Largest global gradient norm (0 disables clipping).
    pub gradient_clip: f64,
    /// Schedule shape.
    pub lr_schedule: LrSchedule,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
}

impl Default for OptimizationConfig {
    fn default() -> Self {
        Self {
            optimizer: "adamw".into(),
            learning_rate: 1e-4,
            min_learning_rate: 0.0,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            gradient_clip: 1.0,
            lr_schedule: LrSchedule::Cosine,
            warmup_steps: 0,
        }
    }
}

impl OptimizationConfig {
    /// Check the table; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::check(self.optimizer == "adamw", "optimizer", || {
            format!("only \"adamw\" is supported, got {:?}", self.optimizer)
        })?;
        for (field, v) in [
            ("learning_rate", self.learning_rate),
            ("min_learning_rate", self.min_learning_rate),
            ("weight_decay", self.weight_decay),
            ("epsilon", self.epsilon),
            ("gradient_clip", self.gradient_clip),
        ] {
            ConfigError::check(v.is_finite(), field, || format!("must be finite, got {v}"))?;
        }
        ConfigError::check(self.learning_rate > 0.0, "learning_rate", || {
            format!("must be positive, got {}", self.learning_rate)
        })?;
        ConfigError::check(
            (0.0..=self.learning_rate).contains(&self.min_learning_rate),
            "min_learning_rate",
            || {
                format!(
                    "must be in [0, learning_rate], got {}",
                    self.min_learning_rate
                )
            },
        )?;
        ConfigError::check(self.weight_decay >= 0.0, "weight_decay", || {
            format!("must be non-negative, got {}", self.weight_decay)
        })?;
        for (field, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            ConfigError::check((0.0..1.0).contains(&b), field, || {
                format!("must be in [0, 1), got {b}")
            })?;
        }
        ConfigError::check(self.epsilon > 0.0, "epsilon", || {
            format!("must be positive, got {}", self.epsilon)
        })?;
        ConfigError::check(self.gradient_clip >= 0.0, "gradient_clip", || {
            format!("must be non-negative, got {}", self.gradient_clip)
        })
    }
}

/// Where training samples come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSourceKind {
    /// Latents that are a fixed function of the pooled conditioning (no files needed).
    Synthetic,
    /// Pre-encoded latent shards in HDF5 (`flux-hpc data ingest` writes them).
    Hdf5,
}

/// `[data]`: where latents come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// `synthetic` or `hdf5`.
    pub source: DataSourceKind,
    /// Training shards: `.h5` files or directories of them (`hdf5` only).
    pub paths: Vec<PathBuf>,
    /// Held-out shards; empty: the first `eval_samples` of the training shards.
    pub eval_paths: Vec<PathBuf>,
    /// Visit samples in a new seeded order every epoch (otherwise file order).
    pub shuffle: bool,
    /// Micro-batches read ahead by the prefetch thread.
    pub prefetch: usize,
    /// Aspect-ratio buckets in pixels (`"1024x1024"`, `"1152x896"`, …) that `flux-hpc data
    /// encode --config` sorts and crops images into; each becomes a resolution bucket of the
    /// shards training reads.
    pub buckets: Vec<Bucket>,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            source: DataSourceKind::Synthetic,
            paths: Vec::new(),
            eval_paths: Vec::new(),
            shuffle: true,
            prefetch: 4,
            buckets: Vec::new(),
        }
    }
}

impl DataConfig {
    /// Check the table; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::check(
            self.source == DataSourceKind::Synthetic || !self.paths.is_empty(),
            "paths",
            || "source = \"hdf5\" needs at least one shard file or directory".into(),
        )?;
        for (field, paths) in [("paths", &self.paths), ("eval_paths", &self.eval_paths)] {
            ConfigError::check(
                paths.iter().all(|p| !p.as_os_str().is_empty()),
                field,
                || "an entry is empty; name a shard file or a directory of them".into(),
            )?;
        }
        if let Some(twice) = (1..self.buckets.len()).find_map(|i| {
            self.buckets[..i]
                .contains(&self.buckets[i])
                .then_some(self.buckets[i])
        }) {
            return Err(ConfigError::new(
                "buckets",
                format!("{twice} is listed twice"),
            ));
        }
        ConfigError::check(self.prefetch >= 1, "prefetch", || {
            "must read at least 1 micro-batch ahead".into()
        })
    }
}

/// How checkpoint files are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointFormat {
    /// One file per tensor-parallel rank, written in parallel.
    Sharded,
    /// One file of logical tensors written by rank 0.
    Unified,
}

/// `[checkpoint]`: where a run writes, and how often it saves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Run directory: `step_*/` checkpoints, `latest`, metrics.jsonl, loss_curve.png, final weights.
    pub dir: PathBuf,
    /// Steps between checkpoints (0: only at the end of the run).
    pub interval: u64,
    /// Checkpoints kept (older ones are deleted after a new one is published).
    pub keep: usize,
    /// Continue from `latest` when the run directory has one.
    pub resume: bool,
    /// `sharded` or `unified`.
    pub format: CheckpointFormat,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/default"),
            interval: 0,
            keep: 3,
            resume: true,
            format: CheckpointFormat::Sharded,
        }
    }
}

impl CheckpointConfig {
    /// Check the table; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::check(!self.dir.as_os_str().is_empty(), "dir", || {
            "is empty; name the run directory".into()
        })?;
        // A filesystem root (`/`, or `/..`) is every other run's directory too.
        let root = self.dir.has_root() && !self.dir.components().any(is_named);
        ConfigError::check(!root, "dir", || {
            format!(
                "{} is a filesystem root; name a directory of the run's own",
                self.dir.display()
            )
        })?;
        ConfigError::check(self.keep >= 1, "keep", || {
            "must keep at least 1 checkpoint".into()
        })
    }
}

/// Whether a path component names a directory (not the root, `.` or `..`).
fn is_named(c: std::path::Component) -> bool {
    matches!(c, std::path::Component::Normal(_))
}

/// `[lora]`: train low-rank adapters on the selected linears while the base model stays frozen
/// (its weights from `base`); checkpoints then hold the adapters only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank `r` of each update.
    pub rank: i64,
    /// Strength `α` (the update is scaled by `α / r`); default `r`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    /// Dropout on each adapter's input while training.
    #[serde(default)]
    pub dropout: f64,
    /// Patterns over the linears' state-dict module names (`*` wildcards; a pattern also matches
    /// a dotted suffix), e.g. `["self_attention.linear_qkv", "layers.*.linear_fc2"]`.
    pub targets: Vec<String>,
    /// The frozen base weights: a native checkpoint (`step_*/`, or a run directory's `latest`;
    /// `flux-hpc convert` writes one from BFL or diffusers files). Without it the base is the
    /// seeded random initialisation (tests, smoke runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<PathBuf>,
    /// `fp32`, `bf16` or `fp8`: the frozen base's dtype. `bf16` halves its memory while the
    /// adapters keep `[training] precision` (their updates are computed in it and cast to the
    /// base's); `fp8` holds the base's linear weights in e4m3 with per-row scales (half of
    /// bf16's), widened to bf16 layer by layer as they run, the rest of the base in bf16.
    #[serde(default = "LoraConfig::default_base_precision")]
    pub base_precision: Precision,
    /// An adapter file to start from instead of fresh adapters (`A` random, `B` zero): diffusers
    /// / PEFT or kohya / ComfyUI names, or flux-hpc's own `final_lora.safetensors`, at `rank`,
    /// for modules `targets` select. Resuming reads the checkpoint, not this file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
}

impl LoraConfig {
    fn default_base_precision() -> Precision {
        Precision::Fp32
    }

    /// Rank, strength and dropout of every adapter.
    pub fn settings(&self) -> LoraSettings {
        LoraSettings {
            rank: self.rank,
            alpha: self.alpha.unwrap_or(self.rank as f64),
            dropout: self.dropout,
        }
    }

    /// Check the table; the error's field is `lora.key`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.settings().validate()?;
        ConfigError::check(!self.targets.is_empty(), "lora.targets", || {
            "names no layer pattern; list the linears to adapt, e.g. [\"linear_qkv\"]".into()
        })?;
        ConfigError::check(
            self.base.as_ref().is_none_or(|b| !b.as_os_str().is_empty()),
            "lora.base",
            || "is empty; name a native checkpoint or leave the key out".into(),
        )?;
        ConfigError::check(
            self.init.as_ref().is_none_or(|b| !b.as_os_str().is_empty()),
            "lora.init",
            || "is empty; name an adapter file or leave the key out".into(),
        )
    }
}
