//! The run configuration file: a TOML document with one table per concern.
//!
//! ```toml
//! [model]          # the network: `architecture = "flux" | "flux2" | "dit"` (default flux) and its shape
//! [training]       # steps, batch sizes, resolution, timestep sampling, precision
//! [optimization]   # AdamW, learning-rate schedule, gradient clipping
//! [parallelism]    # how ranks are split: tensor × data parallel (pipeline must stay 1)
//! [data]           # where latents come from
//! [checkpoint]     # the run directory
//! [fp8]            # optional: the float8 recipe and linears under precision = "fp8"
//! [lora]           # optional: train low-rank adapters on a frozen base
//! [logging]        # optional: TensorBoard event files
//! [sampling]       # optional: PNG grids of fixed prompts and seeds while training
//! [slurm]          # optional: how `flux-hpc sbatch` submits the run
//! ```
//!
//! Unknown tables or keys are errors; `--set table.key=value` overrides are applied to the TOML
//! tree before it is read, so they are checked exactly like the file.

use std::path::Path;

use flux_cluster::slurm::SlurmConfig;
use flux_cluster::{Backend, GroupSizes, LayoutError, Transport};
use flux_model::float8::Float8Settings;
use flux_model::{ConfigError, ModelSpec};
use tch::Device;

use crate::config::monitoring::{LoggingConfig, SamplingConfig};
use crate::config::sections::{
    CheckpointConfig, DataConfig, LoraConfig, OptimizationConfig, Precision, TrainingConfig,
};
use serde::{Deserialize, Serialize};

/// What the data-parallel replicas shard among themselves instead of each holding all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    /// Every replica holds the whole training state (plain data parallelism).
    #[default]
    None,
    /// ZeRO-1 / Megatron's distributed optimizer: each replica keeps the f32 master weights and
    /// AdamW moments of its `1 / dp` of the parameters; gradients are reduce-scattered, each
    /// replica updates its part, and the updated weights are all-gathered.
    Optimizer,
    /// ZeRO-2: as `Optimizer`, and each replica keeps only the f32 sums of its part's gradients,
    /// reduce-scattered bucket by bucket while backward runs (every micro-batch), the full
    /// gradients dropped as soon as their bucket is reduced.
    Gradients,
    /// ZeRO-3 (FSDP): as `Gradients`, and each layer's weights hold memory only while the layer
    /// runs (gathered from the f32 master shares before its forward and its backward).
    Full,
}

/// How the world of ranks is divided.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelismConfig {
    /// Ranks sharing one model replica by splitting its weights (Megatron tensor parallelism).
    pub tensor_parallel_size: i64,
    /// Pipeline stages; diffusion models support only 1, as in Primus.
    pub pipeline_parallel_size: i64,
    /// What the data-parallel group shards (`"none"`, `"optimizer"`, `"gradients"`, `"full"`).
    pub sharding: Sharding,
    /// Shard within groups of this many consecutive data-parallel replicas and replicate across
    /// the groups (HSDP: e.g. the ranks of a node); 0 shards over all replicas.
    pub shard_group_size: u64,
    /// Largest bucket of gradients reduced over the data-parallel group in one collective, MiB
    /// of f32 (a larger parameter is a bucket alone). Also the largest buffer the reduction adds.
    pub bucket_mib: f64,
    /// Sum gradient buckets over the data-parallel group while backward runs (non-blocking
    /// all-reduces started as each bucket's gradients are complete) instead of after it.
    /// `sharding = "none"` only.
    pub overlap_grad_reduce: bool,
    /// Megatron sequence parallelism: between the tensor-parallel layers, norms, modulation and
    /// residuals act on each rank's slice of the sequence (`tensor_parallel_size` ≥ 2); the
    /// row-parallel all-reduces become reduce-scatters and all-gathers precede the
    /// column-parallel layers, so activations outside them take `1 / tp` of the memory.
    pub sequence_parallel: bool,
    /// Longest wait, in seconds, of any collective for its peers before the job is ended with an
    /// error naming the waiting rank (a rank that hangs or is stopped must not hold the job
    /// forever). Generous by default: a unified checkpoint of a large model is written by one
    /// rank while the others wait.
    pub collective_timeout_s: u64,
    /// What moves the collectives: `"auto"` (NCCL on CUDA, MPI on the CPU), `"mpi"` (host f32
    /// buffers; CUDA tensors staged through host memory), `"nccl"` (c10d on CUDA tensors) or
    /// `"gloo"` (c10d on CPU tensors of any dtype). Ranks are launched by MPI whichever it is.
    pub backend: Backend,
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        Self {
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            sharding: Sharding::None,
            shard_group_size: 0,
            bucket_mib: 100.0,
            overlap_grad_reduce: false,
            sequence_parallel: false,
            collective_timeout_s: 1800,
            backend: Backend::Auto,
        }
    }
}

impl ParallelismConfig {
    /// How the groups of a run on `device` communicate: the backend, refused where it cannot
    /// move that device's tensors, and the collective timeout.
    pub fn transport(&self, device: Device) -> Result<Transport, flux_cluster::BackendError> {
        let timeout = std::time::Duration::from_secs(self.collective_timeout_s);
        Transport::new(self.backend, device, timeout)
    }

    /// The sizes of the groups the world is split into.
    pub fn group_sizes(&self) -> GroupSizes {
        GroupSizes {
            tensor_parallel: self.tensor_parallel_size as usize,
            shard_group: self.shard_group_size as usize,
            sequence_parallel: self.sequence_parallel,
        }
    }

    /// The data-parallel replicas `ranks` ranks make under this table, refused as a launch on
    /// them would be: a tensor-parallel size that does not divide them, a shard group that does
    /// not divide the replicas, sharding with one replica. The error names the field within
    /// `[parallelism]`.
    pub fn replicas(&self, ranks: usize) -> Result<usize, ConfigError> {
        let (dp, _) = self.group_sizes().split(ranks).map_err(|e| {
            let field = match e {
                LayoutError::ShardGroup { .. } => "shard_group_size",
                _ => "tensor_parallel_size",
            };
            ConfigError::new(field, e.to_string())
        })?;
        if self.sharding != Sharding::None && dp == 1 {
            return Err(ConfigError::new(
                "sharding",
                format!(
                    "shards state over the data-parallel replicas, and this run has one (world \
                     {ranks} / tensor_parallel_size {}); set \"none\" or launch more ranks",
                    self.tensor_parallel_size
                ),
            ));
        }
        Ok(dp)
    }

    /// `bucket_mib` in f32 elements.
    pub fn bucket_elements(&self) -> usize {
        (self.bucket_mib * (1 << 20) as f64 / 4.0) as usize
    }

    /// Check sizes against the model; the error names the field within `[parallelism]`.
    pub fn validate(&self, model: &ModelSpec) -> Result<(), ConfigError> {
        if self.pipeline_parallel_size != 1 {
            return Err(ConfigError::new(
                "pipeline_parallel_size",
                format!(
                    "pipeline parallelism is not supported for diffusion models (must be 1, got {})",
                    self.pipeline_parallel_size
                ),
            ));
        }
        if !(self.bucket_mib.is_finite() && self.bucket_elements() >= 1) {
            return Err(ConfigError::new(
                "bucket_mib",
                format!("must hold at least one f32 value, got {}", self.bucket_mib),
            ));
        }
        if self.overlap_grad_reduce && self.sharding != Sharding::None {
            return Err(ConfigError::new(
                "overlap_grad_reduce",
                "overlaps plain data parallelism's all-reduces (sharding = \"none\"); \
                 sharding = \"optimizer\" reduces after backward, \"gradients\" and \"full\" always \
                 during it",
            ));
        }
        if self.shard_group_size > 0 && self.sharding == Sharding::None {
            return Err(ConfigError::new(
                "shard_group_size",
                "groups the replicas that shard state; set sharding = \"optimizer\" or \
                 \"gradients\" (or leave shard_group_size at 0)",
            ));
        }
        if self.shard_group_size == 1 {
            return Err(ConfigError::new(
                "shard_group_size",
                "a group of one replica shards nothing: use 0 (all replicas) or at least 2",
            ));
        }
        if self.collective_timeout_s == 0 {
            return Err(ConfigError::new(
                "collective_timeout_s",
                "must be at least 1 second",
            ));
        }
        let tp = self.tensor_parallel_size;
        if tp < 1 {
            return Err(ConfigError::new(
                "tensor_parallel_size",
                format!("must be at least 1, got {tp}"),
            ));
        }
        model.check_tp_size(tp as usize)?;
        if self.sequence_parallel {
            if tp < 2 {
                return Err(ConfigError::new(
                    "sequence_parallel",
                    "splits the sequence over the tensor-parallel group: set \
                     tensor_parallel_size to 2 or more (or sequence_parallel = false)",
                ));
            }
            model.check_sequence_parallel()?;
        }
        Ok(())
    }
}

/// A whole run configuration.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// `[model]`: the architecture and its shape.
    #[serde(default)]
    pub model: ModelSpec,
    /// `[training]`.
    #[serde(default)]
    pub training: TrainingConfig,
    /// `[optimization]`.
    #[serde(default)]
    pub optimization: OptimizationConfig,
    /// `[parallelism]`.
    #[serde(default)]
    pub parallelism: ParallelismConfig,
    /// `[data]`.
    #[serde(default)]
    pub data: DataConfig,
    /// `[checkpoint]`.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// `[slurm]`: how `flux-hpc sbatch` submits the run.
    #[serde(default)]
    pub slurm: SlurmConfig,
    /// `[fp8]`: the float8 recipe and linears (defaults under `precision = "fp8"` without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<Float8Settings>,
    /// `[lora]`: adapters to train instead of the whole model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
    /// `[logging]`: TensorBoard.
    #[serde(default)]
    pub logging: LoggingConfig,
    /// `[sampling]`: sample grids while training.
    #[serde(default)]
    pub sampling: SamplingConfig,
}

/// Why a run config could not be used; every variant names the file and, where known, the field.
#[derive(Debug, thiserror::Error)]
pub enum RunConfigError {
    /// The file could not be read (missing, not a regular file, too large); names the file.
    #[error("{0}")]
    Read(flux_data::DataError),
    /// Not valid TOML, an unknown key, or a value of the wrong type (toml names the key and line).
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message, with the offending key and position.
        message: String,
    },
    /// A `--set` override that is not `table.key=value`.
    #[error("--set {text}: {message}")]
    Override {
        /// The override as given.
        text: String,
        /// What is wrong.
        message: String,
    },
    /// A value that breaks a rule.
    #[error("{path}: {error}")]
    Invalid {
        /// The file.
        path: String,
        /// The rule and the field.
        error: ConfigError,
    },
}

impl RunConfig {
    /// The float8 settings the model is switched to, under `precision = "fp8"`.
    pub fn float8(&self) -> Option<Float8Settings> {
        (self.training.precision == Precision::Fp8).then(|| self.fp8.clone().unwrap_or_default())
    }

    /// Read `path`, apply `overrides` (`table.key=value`, value in TOML syntax; bare words are
    /// strings), deserialize strictly and validate.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, RunConfigError> {
        let display = path.display().to_string();
        let text = flux_data::files::read_to_string_limited(path, MAX_CONFIG_BYTES)
            .map_err(RunConfigError::Read)?;
        Self::parse(&text, &display, overrides)
    }

    /// As [`RunConfig::load`], from TOML text; `origin` names the source in errors.
    pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Self, RunConfigError> {
        let parse_err = |e: &dyn std::fmt::Display| RunConfigError::Parse {
            path: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        };
        let invalid = |error| RunConfigError::Invalid {
            path: origin.to_string(),
            error,
        };
        let mut tree: toml::Table = text.parse().map_err(|e: toml::de::Error| parse_err(&e))?;
        for item in overrides {
            apply_override(&mut tree, item)?;
        }
        // The [model] table first: its keys depend on its architecture, which serde's errors
        // cannot point at, so a bad key is located in the text here.
        if let Some(toml::Value::Table(model)) = tree.get("model") {
            ModelSpec::from_table(model.clone()).map_err(|error| {
                let at = key_location(text, "model", &error.field)
                    .map(|at| format!("{at}: "))
                    .unwrap_or_default();
                RunConfigError::Parse {
                    path: origin.to_string(),
                    message: format!("{at}{}", error.within("model")),
                }
            })?;
        }
        // Without overrides, read the text itself so errors carry the line and column.
        let config: RunConfig = if overrides.is_empty() {
            toml::from_str(text).map_err(|e| parse_err(&e))?
        } else {
            toml::Value::Table(tree.clone())
                .try_into()
                .map_err(|e: toml::de::Error| parse_err(&e))?
        };
        require_model(&tree).map_err(invalid)?;
        config.validate().map_err(invalid)?;
        Ok(config)
    }

    /// The global batch must split into micro-batches over `replicas` data-parallel replicas;
    /// the error names `training.global_batch_size`.
    pub fn check_batch_split(&self, replicas: usize) -> Result<(), ConfigError> {
        let t = &self.training;
        let per_step = t.micro_batch_size.saturating_mul(replicas as u64);
        ConfigError::check(
            per_step > 0 && t.global_batch_size.is_multiple_of(per_step),
            "training.global_batch_size",
            || {
                format!(
                    "{} is not a multiple of micro_batch_size {} × {replicas} data-parallel \
                     replicas",
                    t.global_batch_size, t.micro_batch_size
                )
            },
        )
    }

    /// Under sequence parallelism each stream's tokens must split evenly over the
    /// tensor-parallel group; the error names the `[training]` size that does not.
    fn check_sequence_lengths(&self) -> Result<(), ConfigError> {
        let tp = self.parallelism.tensor_parallel_size;
        let p = self.model.inputs().patch_size.max(1);
        let t = &self.training;
        let streams = [
            (
                "training.latent_height",
                (t.latent_height / p) * (t.latent_width / p),
                "image tokens",
            ),
            ("training.text_len", t.text_len, "text tokens"),
        ];
        for (field, tokens, what) in streams {
            ConfigError::check(tokens % tp == 0, field, || {
                format!(
                    "{tokens} {what} do not split over tensor_parallel_size {tp} under \
                     parallelism.sequence_parallel"
                )
            })?;
        }
        Ok(())
    }

    /// Validate every section; the error's field is `table.key`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate().map_err(|e| e.within("model"))?;
        self.training.validate().map_err(|e| e.within("training"))?;
        ConfigError::check(
            !(self.training.recompute && self.model.uses_dropout()),
            "training.recompute",
            || {
                "recomputation replays layers without their dropout masks; set model.hidden_dropout and \
             model.attention_dropout to 0 or turn recompute off"
                .into()
            },
        )?;
        self.optimization
            .validate()
            .map_err(|e| e.within("optimization"))?;
        self.parallelism
            .validate(&self.model)
            .map_err(|e| e.within("parallelism"))?;
        if self.parallelism.sequence_parallel {
            self.check_sequence_lengths()?;
        }
        ConfigError::check(
            self.fp8.is_none() || self.training.precision == Precision::Fp8,
            "fp8",
            || {
                "configures float8 training, which this run does not do: set [training] \
                 precision = \"fp8\" (or remove the table)"
                    .into()
            },
        )?;
        self.data.validate().map_err(|e| e.within("data"))?;
        self.checkpoint
            .validate()
            .map_err(|e| e.within("checkpoint"))?;
        if let Some(lora) = &self.lora {
            lora.validate()?;
            ConfigError::check(
                !(self.training.recompute && lora.dropout > 0.0),
                "training.recompute",
                || {
                    "recomputation replays layers without the adapters' dropout masks; set \
                     lora.dropout to 0 or turn recompute off"
                        .into()
                },
            )?;
            ConfigError::check(
                self.parallelism.sharding != Sharding::Full,
                "parallelism.sharding",
                || {
                    "\"full\" shards the weights a run trains, and under [lora] those are the \
                     small adapters: use \"gradients\""
                        .into()
                },
            )?;
        }
        self.sampling.validate().map_err(|e| e.within("sampling"))?;
        self.slurm.validate().map_err(|e| e.within("slurm"))
    }
}

/// Where `[table] key` is written in `text`, as `line L, column C` (1-based), when it is.
fn key_location(text: &str, table: &str, key: &str) -> Option<String> {
    let doc = toml_edit::ImDocument::parse(text).ok()?;
    let span = doc.get(table)?.as_table()?.key(key)?.span()?;
    let before = &text[..span.start];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    Some(format!("line {line}, column {column}"))
}

/// Largest config file read (a config is a few kilobytes; this bounds a wrong path).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The `[model]` table must be there and say something: a missing or empty one would otherwise
/// silently stand for FLUX.1 [dev]'s 12 B parameters.
fn require_model(tree: &toml::Table) -> Result<(), ConfigError> {
    match tree.get("model") {
        None => Err(ConfigError::new(
            "model",
            "the config has no [model] table; give the model's shape (configs/flux_12b.toml \
             spells out FLUX.1 [dev])",
        )),
        Some(toml::Value::Table(t)) if t.is_empty() => Err(ConfigError::new(
            "model",
            "the [model] table is empty; give the model's shape (configs/flux_12b.toml spells \
             out FLUX.1 [dev])",
        )),
        // An architecture alone would silently mean its largest defaults (11.9 B for FLUX.1).
        Some(toml::Value::Table(t)) if t.keys().all(|k| k == "architecture") => {
            Err(ConfigError::new(
                "model",
                "the [model] table names only its architecture; give the model's shape as well \
                 (configs/flux_12b.toml spells out FLUX.1 [dev], configs/*_tiny.toml small \
                 ones)",
            ))
        }
        Some(_) => Ok(()),
    }
}

fn apply_override(tree: &mut toml::Table, item: &str) -> Result<(), RunConfigError> {
    let bad = |message: &str| RunConfigError::Override {
        text: item.to_string(),
        message: message.to_string(),
    };
    let (key, raw) = item
        .split_once('=')
        .ok_or_else(|| bad("expected KEY=VALUE"))?;
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(bad("the key must be dotted, like model.hidden_size"));
    }
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        // Text after the value (a newline and another key) would be dropped unread.
        Ok(t) if t.len() > 1 => {
            return Err(bad(
                "holds more than one value (a newline in it?): give each key its own --set",
            ))
        }
        Ok(mut t) => t.remove("v").expect("the key just parsed"),
        Err(_) if raw.contains('\n') => {
            return Err(bad(
                "holds a newline: a multi-line value must be a TOML string (\"\"\"…\"\"\")",
            ))
        }
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let (last, parents) = path.split_last().expect("non-empty path");
    let mut table = tree;
    for part in parents {
        let entry = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()));
        table = entry
            .as_table_mut()
            .ok_or_else(|| bad(&format!("`{part}` is not a table")))?;
    }
    table.insert(last.to_string(), value);
    Ok(())
}
