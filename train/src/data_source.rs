//! Where a run's clean samples come from: the synthetic dataset, or HDF5 latent shards read
//! ahead by a prefetch thread in this rank's share of each epoch's shuffled order.

use std::path::PathBuf;

use flux_data::dataset::{
    latent_samples, BatchPlan, DataPosition, LatentDataset, LatentDraw, Prefetcher, SampleOrder,
    ShardLayout,
};
use flux_data::{DataError, LatentSamples, SyntheticLatents, SyntheticShape};
use flux_model::ConfigError;
use tch::Device;

use crate::sections::DataSourceKind;
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

/// HDF5 shards and the reading state of one rank.
pub struct Hdf5Data {
    paths: Vec<PathBuf>,
    layout: ShardLayout,
    len: u64,
    seed: u64,
    shuffle: bool,
    depth: usize,
    pack: bool,
    eval: LatentDataset,
    /// The running prefetcher and the counters of the micro-batch it delivers next.
    reading: Option<(Prefetcher, Vec<u64>)>,
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
        if eval.layout().latent != layout.latent || eval.layout().text != layout.text {
            return Err(ConfigError::new(
                "data.eval_paths",
                "held-out shards have other shapes than the training shards",
            ));
        }
        let (m, t) = (run.model.inputs(), &run.training);
        let [c, h, w] = layout.latent.map(|v| v as i64);
        let pack = c * 4 == m.latent_channels;
        let (c, h, w) = if pack {
            (c * 4, h / 2, w / 2)
        } else {
            (c, h, w)
        };
        if c != m.latent_channels {
            return Err(mismatch(
                "latent channel count",
                c.to_string(),
                format!(
                    "the model's {} latent channels (or a quarter of them)",
                    m.latent_channels
                ),
            ));
        }
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
            paths: d.paths.clone(),
            len: train.len(),
            layout,
            seed: t.seed,
            shuffle: d.shuffle,
            depth: d.prefetch,
            pack,
            eval,
            reading: None,
        })))
    }

    /// Samples per epoch (`None`: unbounded).
    pub fn epoch_len(&self) -> Option<u64> {
        match self {
            Self::Synthetic(_) => None,
            Self::Hdf5(h) => Some(h.len),
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

    /// Micro-batch `m` of the step `plan` starts (`plan.next_step_start`), on `device`, and the
    /// samples' ids (keys from their source, or `synthetic #<counter>`), for diagnostics.
    pub fn train_batch(
        &mut self,
        plan: BatchPlan,
        m: u64,
        device: Device,
    ) -> Result<(LatentSamples, Vec<String>), DataError> {
        let counters = plan.micro_batch(plan.next_step_start, m);
        let h = match self {
            Self::Synthetic(s) => {
                let ids = counters.iter().map(|c| format!("synthetic #{c}")).collect();
                return Ok((s.batch(&counters, device), ids));
            }
            Self::Hdf5(h) => h,
        };
        if h.reading.as_ref().is_none_or(|(_, next)| *next != counters) {
            // First batch, or after a restore: read from this micro-batch on.
            let dataset = LatentDataset::open(&h.paths)?;
            let order = SampleOrder::new(h.seed, h.len, h.shuffle);
            let batches = plan.micro_batches().skip(m as usize);
            h.reading = Some((
                Prefetcher::spawn(dataset, order, batches, h.depth),
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
        let draw = LatentDraw::Posterior { seed: h.seed };
        let samples = latent_samples(
            &fetched.samples,
            &fetched.counters,
            &h.layout,
            draw,
            h.pack,
            device,
        );
        Ok((
            samples,
            fetched.samples.iter().map(|s| s.id.clone()).collect(),
        ))
    }

    /// Held-out samples `first..first + n` (keyed `EVAL_BASE + i`), posterior means.
    pub fn eval_batch(
        &self,
        first: u64,
        n: u64,
        device: Device,
    ) -> Result<LatentSamples, DataError> {
        let keys: Vec<u64> = (EVAL_BASE + first..EVAL_BASE + first + n).collect();
        match self {
            Self::Synthetic(s) => Ok(s.batch(&keys, device)),
            Self::Hdf5(h) => {
                let samples = (first..first + n)
                    .map(|i| h.eval.read(i % h.eval.len()))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(latent_samples(
                    &samples,
                    &keys,
                    h.eval.layout(),
                    LatentDraw::Mean,
                    h.pack,
                    device,
                ))
            }
        }
    }
}
