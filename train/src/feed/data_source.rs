//! Where a run's clean samples come from: the synthetic dataset, or HDF5 latent shards read
//! ahead by a prefetch thread in this rank's share of each epoch's shuffled order.

use std::path::{Path, PathBuf};

use flux_data::dataset::EMPTY_PROMPT;
use flux_data::dataset::{
    latent_samples, BatchPlan, DataPosition, Fetched, LatentDataset, LatentDraw, Prefetcher,
    SampleOrder, ShardLayout,
};
use flux_data::{DataError, LatentSamples, SyntheticLatents, SyntheticShape};
use flux_model::{ConfigError, InputSpec};
use tch::{Device, Tensor};

use crate::config::sections::DataSourceKind;
use crate::feed::step_data::SampleDraws;
use crate::RunConfig;

/// Held-out samples are keyed from here, away from any training counter.
pub const EVAL_BASE: u64 = 1 << 62;

/// Width of the synthetic pooled vector (the latents' generating factors) for a model that takes
/// none; the factors then start its first text state.
const TEXT_FACTORS: i64 = 16;

/// The synthetic dataset a run trains on: its `[training]` seed and latent and text sizes. Text
/// states are empty (zero-width) for a model that reads no text.
pub fn synthetic_data(run: &RunConfig) -> SyntheticLatents {
    let t = &run.training;
    let inputs = run.model.inputs();
    let shape = SyntheticShape {
        channels: inputs.latent_channels,
        height: t.latent_height,
        width: t.latent_width,
        text_len: inputs.text_tokens(t.text_len),
        context_dim: inputs.text_dim.unwrap_or(0),
        vec_dim: inputs.pooled_dim.unwrap_or(TEXT_FACTORS),
        factors_in_text: inputs.pooled_dim.is_none(),
    };
    SyntheticLatents::new(t.seed, shape)
}

/// What the prefetch thread makes of a micro-batch beside reading it: its training tensors (on
/// the CPU) and random draws.
type Prepared = (LatentSamples, SampleDraws);

/// How a micro-batch's random draws are made: the run's seed and caption dropout probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawSettings {
    /// `[training] seed`.
    pub seed: u64,
    /// `[training] cfg_dropout_prob`.
    pub dropout_prob: f64,
}

impl DrawSettings {
    /// The draws of the samples keyed `ids` whose latents are `latents` `[B, …]`.
    pub fn draw(&self, ids: &[u64], latents: &Tensor) -> SampleDraws {
        let per_sample = latents.numel() / ids.len().max(1);
        SampleDraws::new(ids, self.seed, per_sample, self.dropout_prob)
    }
}

/// HDF5 shards and the reading state of one rank.
pub struct Hdf5Data {
    paths: Vec<PathBuf>,
    /// Which sample each counter reads (one bucket per step when there are several).
    order: SampleOrder,
    seed: u64,
    depth: usize,
    pack: bool,
    eval: LatentDataset,
    /// The running prefetcher and the counters of the micro-batch it delivers next.
    reading: Option<(Prefetcher<Prepared>, Vec<u64>)>,
    /// The empty caption's encodings (`empty_prompt.safetensors` beside the shards): T5 states
    /// `[L, D]` and the pooled vector `[D_pooled]`.
    empty_prompt: Option<(Tensor, Tensor)>,
}

/// The empty caption's encodings stored by `flux-hpc data encode` in the first directory of
/// `paths` that has them (`empty_prompt.safetensors`: `t5` `[L, D]`, `clip` `[D_pooled]`),
/// checked against the shards' shapes; `None` when no directory has them.
fn empty_prompt(
    paths: &[PathBuf],
    text: [usize; 2],
    pooled: usize,
) -> Result<Option<(Tensor, Tensor)>, ConfigError> {
    let Some(file) = paths
        .iter()
        .map(|p| p.join(EMPTY_PROMPT))
        .find(|f| f.exists())
    else {
        return Ok(None);
    };
    let refuse = |why: String| ConfigError::new("data.paths", format!("{}: {why}", file.display()));
    let tensors: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&file)
        .map_err(|e| refuse(e.to_string()))?
        .into_iter()
        .collect();
    let take = |name: &str, shape: Vec<i64>| {
        let t = tensors
            .get(name)
            .ok_or_else(|| refuse(format!("has no `{name}`")))?;
        if t.size() != shape {
            return Err(refuse(format!(
                "`{name}` has shape {:?}, the shards' is {shape:?}",
                t.size()
            )));
        }
        Ok(t.to_kind(tch::Kind::Float))
    };
    Ok(Some((
        take("t5", text.iter().map(|&v| v as i64).collect())?,
        take("clip", vec![pooled as i64])?,
    )))
}

/// A run's source of clean samples.
pub enum DataSource {
    /// Generated on the fly; unbounded.
    Synthetic(SyntheticLatents),
    /// Read from latent shards.
    Hdf5(Box<Hdf5Data>),
}

fn mismatch(what: &str, data: String, config: String) -> ConfigError {
    ConfigError::new(
        "data.paths",
        format!("the shards' {what} is {data}, but the config needs {config}"),
    )
}

/// Check that the samples of one resolution bucket (`layout`, first seen in `file`) fit the
/// model: the model's latent channels (or a quarter of them, packed 2×2), on a grid that packs
/// and patches evenly. Errors name `data.paths`, the shard and the sizes.
fn check_bucket(
    layout: &ShardLayout,
    file: &Path,
    pack: bool,
    m: &InputSpec,
) -> Result<(), ConfigError> {
    let [c, h, w] = layout.latent.map(|v| v as i64);
    if c != m.latent_channels && c * 4 != m.latent_channels {
        return Err(mismatch(
            "latent channel count",
            format!("{c} (in {})", file.display()),
            format!(
                "the model's {} latent channels (or a quarter of them)",
                m.latent_channels
            ),
        ));
    }
    let fold = if pack { 2 * m.patch_size } else { m.patch_size };
    if h % fold != 0 || w % fold != 0 {
        return Err(ConfigError::new(
            "data.paths",
            format!(
                "{}: latent bucket {h}×{w} is not a multiple of {fold} (the model's patch size \
                 {}{}), so it cannot be cut into tokens",
                file.display(),
                m.patch_size,
                if pack { ", after 2×2 packing" } else { "" }
            ),
        ));
    }
    Ok(())
}

impl DataSource {
    /// Open the source `[data]` names, checking that the shards fit the model and training
    /// shapes (errors name `data.paths` and both values).
    pub fn open(run: &RunConfig) -> Result<Self, ConfigError> {
        let d = &run.data;
        if d.source == DataSourceKind::Synthetic {
            return Ok(Self::Synthetic(synthetic_data(run)));
        }
        let open = |paths: &[PathBuf]| {
            LatentDataset::open(paths).map_err(|e| ConfigError::new("data.paths", e.to_string()))
        };
        let train = open(&d.paths)?;
        let eval = open(if d.eval_paths.is_empty() {
            &d.paths
        } else {
            &d.eval_paths
        })?;
        let layout = train.layout().clone();
        if !eval.layout().same_but_bucket(&layout) {
            return Err(ConfigError::new(
                "data.eval_paths",
                "held-out shards have other shapes than the training shards",
            ));
        }
        let (m, t) = (run.model.inputs(), &run.training);
        let pack = layout.latent[0] as i64 * 4 == m.latent_channels;
        let buckets = train.buckets();
        for dataset in [&train, &eval] {
            for members in dataset.buckets().values() {
                let file = dataset.file_of(members[0]);
                check_bucket(dataset.layout_of(members[0]), file, pack, &m)?;
            }
        }
        if buckets.len() == 1 {
            let [_, h, w] = layout.latent.map(|v| v as i64);
            let (h, w) = if pack { (h / 2, w / 2) } else { (h, w) };
            if (h, w) != (t.latent_height, t.latent_width) {
                return Err(mismatch(
                    "latent size (after packing)",
                    format!("{h}×{w}"),
                    format!(
                        "training.latent_height × latent_width = {}×{}",
                        t.latent_height, t.latent_width
                    ),
                ));
            }
        }
        let order = if buckets.len() == 1 {
            SampleOrder::new(t.seed, train.len(), d.shuffle)
        } else {
            let steps: Vec<String> = buckets
                .iter()
                .map(|(b, m)| format!("{}×{}: {}", b[0], b[1], m.len()))
                .collect();
            if buckets
                .values()
                .all(|m| (m.len() as u64) < t.global_batch_size)
            {
                return Err(ConfigError::new(
                    "data.paths",
                    format!(
                        "no resolution bucket holds training.global_batch_size = {} samples \
                         (every step reads one bucket); bucket sizes: {}",
                        t.global_batch_size,
                        steps.join(", ")
                    ),
                ));
            }
            SampleOrder::bucketed(
                t.seed,
                buckets.into_values().collect(),
                t.global_batch_size,
                d.shuffle,
            )
        };
        let [s, dt] = layout.text.map(|v| v as i64);
        match m.text_dim {
            Some(width) if (s, dt) != (t.text_len, width) => {
                return Err(mismatch(
                    "text states shape",
                    format!("[{s}, {dt}]"),
                    format!(
                        "[training.text_len, the model's text width] = [{}, {width}]",
                        t.text_len
                    ),
                ));
            }
            _ => {}
        }
        match m.pooled_dim {
            Some(width) if layout.pooled as i64 != width => {
                return Err(mismatch(
                    "pooled width",
                    layout.pooled.to_string(),
                    format!("the model's pooled width {width}"),
                ));
            }
            _ => {}
        }
        Ok(Self::Hdf5(Box::new(Hdf5Data {
            empty_prompt: empty_prompt(&d.paths, layout.text, layout.pooled)?,
            paths: d.paths.clone(),
            order,
            seed: t.seed,
            depth: d.prefetch,
            pack,
            eval,
            reading: None,
        })))
    }

    /// The empty caption's encodings (T5 states `[L, D]`, pooled `[D_pooled]`) that classifier-
    /// free-guidance dropout swaps in, when the data has them (`None`: zeros are used).
    pub fn empty_prompt(&self) -> Option<&(Tensor, Tensor)> {
        match self {
            Self::Synthetic(_) => None,
            Self::Hdf5(h) => h.empty_prompt.as_ref(),
        }
    }

    /// Samples per epoch (`None`: unbounded).
    pub fn epoch_len(&self) -> Option<u64> {
        match self {
            Self::Synthetic(_) => None,
            Self::Hdf5(h) => Some(h.order.len()),
        }
    }

    /// Where global sample counter `counter` is in the data (epoch 0 forever when unbounded).
    pub fn position(&self, counter: u64) -> DataPosition {
        DataPosition::of(counter, self.samples_per_epoch())
    }

    /// The global sample counter of `position` (the inverse of [`DataSource::position`]).
    pub fn counter(&self, position: DataPosition) -> u64 {
        position.counter(self.samples_per_epoch())
    }

    /// Epoch length for position arithmetic (unbounded sources never finish an epoch).
    fn samples_per_epoch(&self) -> u64 {
        self.epoch_len().unwrap_or(u64::MAX)
    }

    /// Micro-batch `m` of the step `plan` starts (`plan.next_step_start`), on `device`, its
    /// random draws as `draws` says (made with the samples by the prefetch thread when reading
    /// shards), and the samples' ids (keys from their source, or `synthetic #<counter>`), for
    /// diagnostics.
    pub fn train_batch(
        &mut self,
        plan: BatchPlan,
        m: u64,
        draws: DrawSettings,
        device: Device,
    ) -> Result<(LatentSamples, SampleDraws, Vec<String>), DataError> {
        let counters = plan.micro_batch(plan.next_step_start, m);
        let h = match self {
            Self::Synthetic(s) => {
                let ids = counters.iter().map(|c| format!("synthetic #{c}")).collect();
                let samples = s.batch(&counters, device);
                let drawn = draws.draw(&counters, &samples.latents);
                return Ok((samples, drawn, ids));
            }
            Self::Hdf5(h) => h,
        };
        if h.reading.as_ref().is_none_or(|(_, next)| *next != counters) {
            // First batch, or after a restore: read from this micro-batch on.
            let dataset = LatentDataset::open(&h.paths)?;
            let batches = plan.micro_batches().skip(m as usize);
            let (seed, pack) = (h.seed, h.pack);
            let prepare = move |f: &Fetched| -> Prepared {
                let draw = LatentDraw::Posterior { seed };
                let samples =
                    latent_samples(&f.samples, &f.counters, &f.layout, draw, pack, Device::Cpu);
                let drawn = draws.draw(&f.counters, &samples.latents);
                (samples, drawn)
            };
            let order = h.order.clone();
            h.reading = Some((
                Prefetcher::spawn_preparing(dataset, order, batches, h.depth, prepare),
                counters,
            ));
        }
        let (prefetcher, next) = h.reading.as_mut().expect("started above");
        let fetched = prefetcher.next_batch()?;
        debug_assert_eq!(fetched.counters, *next);
        *next = if m + 1 < plan.micro_steps() {
            plan.micro_batch(plan.next_step_start, m + 1)
        } else {
            plan.micro_batch(plan.next_step_start + plan.global, 0)
        };
        let (samples, drawn) = fetched.prepared;
        let ids = fetched.samples.iter().map(|s| s.id.clone()).collect();
        Ok((samples.to_device(device), drawn, ids))
    }

    /// The held-out samples `0..total` (held-out sample `i` is dataset index `i mod len`) in
    /// batches of at most `micro`: in order, or, for shards of several resolution buckets,
    /// grouped by bucket (ascending), so that each batch has one size.
    pub fn eval_batches(&self, total: u64, micro: u64) -> Vec<Vec<u64>> {
        let numbers: Vec<u64> = match self {
            Self::Synthetic(_) => (0..total).collect(),
            Self::Hdf5(h) => {
                let len = h.eval.len();
                let mut numbers: Vec<u64> = (0..total).collect();
                numbers.sort_by_key(|&i| h.eval.layout_of(i % len).bucket());
                numbers
            }
        };
        let mut batches: Vec<Vec<u64>> = Vec::new();
        for i in numbers {
            let same = |b: &Vec<u64>| b.len() < micro as usize && self.same_bucket(b[0], i);
            match batches.last_mut() {
                Some(batch) if same(batch) => batch.push(i),
                _ => batches.push(vec![i]),
            }
        }
        batches
    }

    /// Whether held-out samples `a` and `b` have one size.
    fn same_bucket(&self, a: u64, b: u64) -> bool {
        match self {
            Self::Synthetic(_) => true,
            Self::Hdf5(h) => {
                let len = h.eval.len();
                h.eval.layout_of(a % len).latent == h.eval.layout_of(b % len).latent
            }
        }
    }

    /// Held-out samples `numbers` (of one bucket, as [`DataSource::eval_batches`] groups them),
    /// keyed `EVAL_BASE + i`, posterior means.
    pub fn eval_batch(&self, numbers: &[u64], device: Device) -> Result<LatentSamples, DataError> {
        let keys: Vec<u64> = numbers.iter().map(|i| EVAL_BASE + i).collect();
        match self {
            Self::Synthetic(s) => Ok(s.batch(&keys, device)),
            Self::Hdf5(h) => {
                let len = h.eval.len();
                let samples = numbers
                    .iter()
                    .map(|i| h.eval.read(i % len))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(latent_samples(
                    &samples,
                    &keys,
                    h.eval.layout_of(numbers[0] % len),
                    LatentDraw::Mean,
                    h.pack,
                    device,
                ))
            }
        }
    }
}
