//! Training records: JSONL metrics and the PNG loss curve.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// One metrics line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Optimizer step (1-based: the step just taken).
    pub step: u64,
    /// Global mean training loss of the step (absent on the step-0 evaluation record).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub loss: Option<f64>,
    /// Held-out loss, when evaluated at this step.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_loss: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Samples per second (all replicas).
    pub samples_per_s: f64,
    /// Image and text tokens per second (all replicas).
    pub tokens_per_s: f64,
    /// The update was skipped for a non-finite loss or gradient norm (`[training] nonfinite`).
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub skipped: bool,
    /// Peak resident memory of this process, MiB.
    pub peak_memory_mib: f64,
    /// The most bytes this process's tensors held at once on its device (CPU or CUDA), MiB: what
    /// `flux-hpc plan` predicts ([`flux_model::tensor_memory`]).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub peak_tensor_mib: Option<f64>,
    /// Under `[parallelism] overlap_grad_reduce` or `sharding = "gradients"`: seconds between
    /// the step's last backward handing its first gradient bucket to an all-reduce (or
    /// reduce-scatter) and that backward ending (how long communication ran beside compute).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub grad_reduce_overlap_s: Option<f64>,
    /// MiB this rank's collectives staged through host memory in the step: tensors copied off
    /// the GPU, or converted to f32, for a backend that cannot move them where they lie (MPI).
    /// 0 when NCCL moves CUDA tensors, or gloo or MPI move f32 CPU tensors.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub host_staged_mib: Option<f64>,
    /// Seconds since training started.
    pub elapsed_s: f64,
}

impl StepRecord {
    /// The record as TensorBoard scalars `(tag, value)`: losses under `train/` and `eval/`,
    /// the optimizer's under `train/`, speed and memory under `perf/`. The step-0 record (an
    /// evaluation before training) gives its held-out loss only.
    pub fn scalars(&self) -> Vec<(&'static str, f64)> {
        let mut out: Vec<(&'static str, f64)> = self
            .eval_loss
            .map(|l| ("eval/loss", l))
            .into_iter()
            .collect();
        if let Some(loss) = self.loss {
            out.extend([
                ("train/loss", loss),
                ("train/lr", self.lr),
                ("train/grad_norm", self.grad_norm),
                ("perf/samples_per_s", self.samples_per_s),
                ("perf/tokens_per_s", self.tokens_per_s),
                ("perf/peak_memory_mib", self.peak_memory_mib),
            ]);
            out.extend(self.peak_tensor_mib.map(|m| ("perf/peak_tensor_mib", m)));
            out.extend(self.host_staged_mib.map(|m| ("perf/host_staged_mib", m)));
        }
        out
    }
}

/// Appends records to `metrics.jsonl`.
pub struct MetricsWriter {
    out: BufWriter<File>,
}

impl MetricsWriter {
    /// Create (truncate) `path`.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            out: BufWriter::new(File::create(path)?),
        })
    }

    /// Reopen a resumed run's log, dropping records past `step` (steps that ran after the
    /// checkpoint being resumed and will run again) and a line cut short by a crash. The kept
    /// records are rewritten through a temporary file and a rename, so a crash here loses
    /// nothing. Returns the writer and the records kept.
    pub fn resume(path: &Path, step: u64) -> std::io::Result<(Self, Vec<StepRecord>)> {
        let kept: Vec<StepRecord> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<StepRecord>(l).ok())
            .filter(|r| r.step <= step)
            .collect();
        let tmp = path.with_extension("jsonl.tmp");
        let mut rewritten = Self::create(&tmp)?;
        for r in &kept {
            rewritten.write(r)?;
        }
        rewritten.out.get_ref().sync_all()?;
        std::fs::rename(&tmp, path)?;
        let file = std::fs::OpenOptions::new().append(true).open(path)?;
        Ok((
            Self {
                out: BufWriter::new(file),
            },
            kept,
        ))
    }

    /// Write one record as a JSON line and flush it.
    pub fn write(&mut self, record: &StepRecord) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, record)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}

/// Peak resident set size of this process in MiB (`VmHWM`), or 0 where unavailable.
pub fn peak_rss_mib() -> f64 {
    proc_status_mib("VmHWM:")
}

/// Resident set size of this process now, in MiB (`VmRSS`), or 0 where unavailable.
pub fn rss_mib() -> f64 {
    proc_status_mib("VmRSS:")
}

/// A `kB` line of `/proc/self/status` in MiB, or 0 where unavailable.
fn proc_status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).map(str::to_owned))
        .and_then(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The TrueType font the curve's labels use (Debian's fonts-dejavu-core, installed by setup).
pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Draw training loss (and held-out loss, where present) against step into a PNG.
pub fn plot_loss_curve(records: &[StepRecord], path: &Path) -> Result<(), String> {
    let font =
        std::fs::read(FONT).map_err(|e| format!("{FONT}: {e} (install fonts-dejavu-core)"))?;
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| "unreadable font".to_string())?;
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let last = records.last().map_or(1, |r| r.step).max(1);
    let values = records
        .iter()
        .flat_map(|r| r.loss.into_iter().chain(r.eval_loss));
    let top = values.fold(f64::MIN, f64::max).max(1e-9) * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption("flux-hpc training loss", ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0u64..last, 0f64..top)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(
            records.iter().filter_map(|r| r.loss.map(|l| (r.step, l))),
            &BLUE,
        ))
        .map_err(|e| err(&e))?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    let eval: Vec<(u64, f64)> = records
        .iter()
        .filter_map(|r| r.eval_loss.map(|e| (r.step, e)))
        .collect();
    chart
        .draw_series(LineSeries::new(eval.iter().copied(), RED.stroke_width(2)))
        .map_err(|e| err(&e))?
        .label("held-out")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    chart
        .draw_series(eval.iter().map(|&p| Circle::new(p, 4, RED.filled())))
        .map_err(|e| err(&e))?;
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}
