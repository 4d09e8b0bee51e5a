//! `RunLog`: where the first rank's training records go — `metrics.jsonl` always, TensorBoard
//! event files under `[logging] tensorboard`, the sample grids — and the records kept for the
//! loss curve and summary.

use std::path::{Path, PathBuf};

use image::RgbImage;

use crate::logging::metrics::{MetricsWriter, StepRecord};
use crate::logging::tensorboard::EventWriter;

/// The run directory's sub-directory of TensorBoard event files.
pub const TENSORBOARD_DIR: &str = "tensorboard";

/// The records of one run, on the rank that writes them.
pub struct RunLog {
    metrics: MetricsWriter,
    metrics_path: PathBuf,
    board: Option<EventWriter>,
    records: Vec<StepRecord>,
}

/// A write that failed, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("writing {path}: {error}")]
pub struct LogError {
    path: String,
    error: String,
}

impl LogError {
    fn new(path: &Path, error: impl ToString) -> Self {
        Self {
            path: path.display().to_string(),
            error: error.to_string(),
        }
    }
}

impl RunLog {
    /// Open the log of a run in `dir` starting after step `first_step`: a fresh
    /// `metrics.jsonl` at 0, else the existing one cut back to `first_step` (see
    /// [`MetricsWriter::resume`]); with `tensorboard`, a new event file marking the restart.
    pub fn open(dir: &Path, first_step: u64, tensorboard: bool) -> Result<Self, LogError> {
        let metrics_path = dir.join("metrics.jsonl");
        let in_metrics = |e: std::io::Error| LogError::new(&metrics_path, e);
        let (metrics, records) = match first_step {
            0 => (
                MetricsWriter::create(&metrics_path).map_err(in_metrics)?,
                Vec::new(),
            ),
            _ => MetricsWriter::resume(&metrics_path, first_step).map_err(in_metrics)?,
        };
        let board = match tensorboard {
            false => None,
            true => {
                let board_dir = dir.join(TENSORBOARD_DIR);
                let in_board = |e: std::io::Error| LogError::new(&board_dir, e);
                let mut board = EventWriter::create(&board_dir).map_err(in_board)?;
                if first_step > 0 {
                    board.restart(first_step + 1).map_err(in_board)?;
                }
                Some(board)
            }
        };
        Ok(Self {
            metrics,
            metrics_path,
            board,
            records,
        })
    }

    /// Write `record` to the metrics file and TensorBoard, and keep it.
    pub fn record(&mut self, record: StepRecord) -> Result<(), LogError> {
        self.metrics
            .write(&record)
            .map_err(|e| LogError::new(&self.metrics_path, e))?;
        if let Some(board) = &mut self.board {
            board
                .scalars(record.step, &record.scalars())
                .map_err(|e| LogError::new(board.path(), e))?;
        }
        self.records.push(record);
        Ok(())
    }

    /// Save the sample grid of `step` as `path` (a PNG) and, with TensorBoard, as image
    /// `samples` of that step.
    pub fn grid(&mut self, step: u64, image: &RgbImage, path: &Path) -> Result<(), LogError> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| LogError::new(parent, e))?;
        }
        flux_encoders::save_png(image, path).map_err(|e| LogError::new(path, e))?;
        if let Some(board) = &mut self.board {
            let png = flux_encoders::png_bytes(image);
            board
                .image(step, "samples", &png, image.width(), image.height())
                .map_err(|e| LogError::new(board.path(), e))?;
        }
        Ok(())
    }

    /// Every record of the run so far (including those kept from before a resume).
    pub fn records(&self) -> &[StepRecord] {
        &self.records
    }
}
