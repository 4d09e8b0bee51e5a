//! Training checkpoints in HDF5: `step_000000123/` directories holding one file per
//! tensor-parallel rank (sharded) or one file of logical tensors (unified), written through a
//! `.partial` directory and a rename, then published by atomically replacing `latest`.
//!
//! Every file holds the groups `params` (f32 master weights), `exp_avg` and `exp_avg_sq` (AdamW
//! moments), one dataset per parameter with its shard layout and CRC-32, and root attributes
//! `format_version`, `step`, `optimizer_step`, `tp_rank`, `tp_size`, `config` (the run's TOML),
//! `run_id` (the identity of the run that wrote it) and `data_epoch` / `data_index` (the data
//! reader's position). The files of one checkpoint must agree on step, run and config.
//! Loading reassembles logical tensors from however many files there are, so a checkpoint written
//! at one tensor-parallel size loads at any other.

mod h5;
mod reader;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use flux_model::tp::{Collective, ParamSpec, TpContext};
use tch::Tensor;

pub use h5::{crc32_f32, read_tensor, write_part, write_values};
pub use reader::{inspect, load, Reader};

use crate::dataset::DataPosition;
use crate::error::{io, DataError};
use crate::failpoint;
use crate::h5attr::{self, h5err};

/// Version written to every file; readers refuse others.
pub const FORMAT_VERSION: u64 = 2;

/// The tensor groups a checkpoint can hold, in file order (`ema` only when the run keeps an
/// exponential moving average of its weights).
pub const GROUPS: [&str; 4] = ["params", "exp_avg", "exp_avg_sq", "ema"];

/// How a checkpoint is laid out on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointLayout {
    /// One file per tensor-parallel rank, written in parallel.
    Sharded,
    /// One file of logical tensors, gathered and written by rank 0.
    Unified,
}

/// Which part of each tensor a data-parallel rank's [`OptimizerState`] holds when the state is
/// sharded over the data-parallel group: each group's tensor `i` is then 1-D, the elements of
/// parameter `i`'s (tensor-parallel-local, flattened) shard from `offsets[i]` on.
#[derive(Debug, Clone, PartialEq)]
pub struct DpParts {
    /// This rank's index in the data-parallel group.
    pub dp_rank: usize,
    /// Ranks in the data-parallel group (parts per tensor).
    pub dp_size: usize,
    /// Per parameter (spec order): where this rank's part starts.
    pub offsets: Vec<usize>,
    /// Per parameter: the shape of the shard the parts make up.
    pub local_shapes: Vec<Vec<i64>>,
    /// Whether this rank writes its parts: under hybrid sharding ranks of other shard groups
    /// hold the same parts, and only the first group's write them.
    pub writes: bool,
}

/// The file of tensor-parallel rank `tp`'s data-parallel part `dp` in a checkpoint directory.
pub fn part_file_name(tp: usize, dp: usize) -> String {
    format!("tp_{tp:02}_dp_{dp:03}.h5")
}

/// AdamW's state on one rank: one local tensor per parameter spec, in spec order, in each group.
pub struct OptimizerState {
    /// AdamW's step counter (bias correction).
    pub step: u64,
    /// f32 master weights (group `params`).
    pub params: Vec<Tensor>,
    /// First moments (group `exp_avg`).
    pub exp_avg: Vec<Tensor>,
    /// Second moments (group `exp_avg_sq`).
    pub exp_avg_sq: Vec<Tensor>,
    /// f32 exponential moving average of the weights (group `ema`), when the run keeps one.
    pub ema: Option<Vec<Tensor>>,
    /// When the tensors are this data-parallel rank's parts rather than whole shards.
    pub parts: Option<DpParts>,
}

impl OptimizerState {
    /// The groups as stored, named as in [`GROUPS`] and in that order.
    pub fn groups(&self) -> Vec<(&'static str, &[Tensor])> {
        let mut groups = vec![
            (GROUPS[0], self.params.as_slice()),
            (GROUPS[1], &self.exp_avg),
            (GROUPS[2], &self.exp_avg_sq),
        ];
        if let Some(ema) = &self.ema {
            groups.push((GROUPS[3], ema));
        }
        groups
    }

    /// The same state with every group's tensors mapped by `f(spec index, tensor)`.
    fn map(&self, f: impl Fn(usize, &Tensor) -> Tensor) -> Self {
        let each = |group: &[Tensor]| group.iter().enumerate().map(|(i, t)| f(i, t)).collect();
        Self {
            step: self.step,
            params: each(&self.params),
            exp_avg: each(&self.exp_avg),
            exp_avg_sq: each(&self.exp_avg_sq),
            ema: self.ema.as_deref().map(each),
            parts: self.parts.clone(),
        }
    }
}

/// What a rank contributes to a checkpoint.
pub struct TrainingState {
    /// Optimizer steps taken by the trainer.
    pub step: u64,
    /// The run config as TOML.
    pub config: String,
    /// The identity of the run (the same in every checkpoint it writes, across resumes).
    pub run_id: String,
    /// Where the data reader is (restored so no sample is repeated or skipped).
    pub data: DataPosition,
    /// Master weights and moments: local shards in spec order.
    pub optimizer: OptimizerState,
}

/// A loaded checkpoint: logical tensors by group and name.
pub struct LoadedCheckpoint {
    /// The directory read.
    pub dir: PathBuf,
    /// Trainer step.
    pub step: u64,
    /// AdamW step counter.
    pub optimizer_step: u64,
    /// The run config it was written with.
    pub config: String,
    /// The identity of the run that wrote it (empty for checkpoints from before run identities
    /// and for converted weights).
    pub run_id: String,
    /// Where the data reader was.
    pub data: DataPosition,
    /// Group → parameter name → logical tensor.
    pub tensors: HashMap<String, HashMap<String, Tensor>>,
}

/// The directory name of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:09}")
}

fn fsync(path: &Path) -> Result<(), DataError> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

/// Every rank reports its part's `result` (a collective over `world`): this rank's own error, or
/// `PeerFailed` when another rank failed, so all ranks stop together and none hangs.
fn settle(
    world: &dyn Collective,
    result: Result<(), DataError>,
    dir: &Path,
) -> Result<(), DataError> {
    let failed = world.count_failures(result.is_err());
    result?;
    match failed {
        0 => Ok(()),
        failed => Err(DataError::PeerFailed {
            dir: dir.display().to_string(),
            failed,
        }),
    }
}

/// Root attributes of a checkpoint file.
struct Header<'a> {
    step: u64,
    optimizer_step: u64,
    tp_rank: usize,
    tp_size: usize,
    /// Data-parallel rank and size, for a file of parts.
    dp: Option<(usize, usize)>,
    config: &'a str,
    run_id: &'a str,
    data: DataPosition,
}

/// Write `path` through `path.h5.tmp`: the header attributes, then `body`, then fsync and rename.
fn write_h5(
    path: &Path,
    header: &Header,
    body: impl FnOnce(&hdf5::File, &Path) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let tmp = path.with_extension("h5.tmp");
    {
        let file = hdf5::File::create(&tmp).map_err(h5err(&tmp, "create"))?;
        h5attr::write_u64(&file, "format_version", FORMAT_VERSION, &tmp)?;
        h5attr::write_u64(&file, "step", header.step, &tmp)?;
        h5attr::write_u64(&file, "optimizer_step", header.optimizer_step, &tmp)?;
        h5attr::write_u64(&file, "tp_rank", header.tp_rank as u64, &tmp)?;
        h5attr::write_u64(&file, "tp_size", header.tp_size as u64, &tmp)?;
        if let Some((rank, size)) = header.dp {
            h5attr::write_u64(&file, "dp_rank", rank as u64, &tmp)?;
            h5attr::write_u64(&file, "dp_size", size as u64, &tmp)?;
        }
        h5attr::write_str(&file, "config", header.config, &tmp)?;
        if !header.run_id.is_empty() {
            h5attr::write_str(&file, "run_id", header.run_id, &tmp)?;
        }
        h5attr::write_u64(&file, "data_epoch", header.data.epoch, &tmp)?;
        h5attr::write_u64(&file, "data_index", header.data.index, &tmp)?;
        body(&file, &tmp)?;
        // Flush explicitly: closing the file would swallow an error (a full disk).
        file.flush().map_err(h5err(&tmp, "flush"))?;
    }
    fsync(&tmp)?;
    fs::rename(&tmp, path).map_err(io(path))
}

fn write_file(
    path: &Path,
    state: &TrainingState,
    specs: &[ParamSpec],
    tp_rank: usize,
    tp_size: usize,
) -> Result<(), DataError> {
    let parts = state.optimizer.parts.as_ref();
    let header = Header {
        step: state.step,
        optimizer_step: state.optimizer.step,
        tp_rank,
        tp_size,
        dp: parts.map(|p| (p.dp_rank, p.dp_size)),
        config: &state.config,
        run_id: &state.run_id,
        data: state.data,
    };
    write_h5(path, &header, |file, tmp| {
        for (group, tensors) in state.optimizer.groups() {
            let g = file.create_group(group).map_err(h5err(tmp, group))?;
            for (i, (spec, t)) in specs.iter().zip(tensors).enumerate() {
                match parts {
                    None => h5::write_tensor(&g, spec, t, tmp)?,
                    Some(p) => h5::write_part(&g, spec, &p.local_shapes[i], p.offsets[i], t, tmp)?,
                }
            }
        }
        Ok(())
    })
}

/// Write a weights-only checkpoint `step_000000000/model.h5` (unified, `params` only, step 0)
/// into the new run directory `run_dir` and point `latest` at it, pulling each logical tensor
/// from `values` in `specs` order (one tensor in memory at a time), stored as f32 master weights.
/// Training started in `run_dir` begins from these weights with fresh optimizer moments. Refuses
/// a run directory that already has checkpoints.
pub fn write_weights(
    run_dir: &Path,
    config: &str,
    specs: &[ParamSpec],
    mut values: impl FnMut(&ParamSpec) -> Result<Vec<f32>, DataError>,
) -> Result<PathBuf, DataError> {
    if run_dir.join("latest").exists() || !list(run_dir)?.is_empty() {
        return Err(DataError::format(
            run_dir,
            "already holds checkpoints; convert into a new run directory",
        ));
    }
    let name = step_dir_name(0);
    let (dir, partial) = (run_dir.join(&name), run_dir.join(format!("{name}.partial")));
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial).map_err(io(&partial))?;
    let header = Header {
        step: 0,
        optimizer_step: 0,
        tp_rank: 0,
        tp_size: 1,
        dp: None,
        config,
        run_id: "",
        data: DataPosition::default(),
    };
    write_h5(&partial.join("model.h5"), &header, |file, tmp| {
        let g = file.create_group("params").map_err(h5err(tmp, "params"))?;
        for spec in specs {
            let logical = ParamSpec {
                tp_size: 1,
                ..spec.clone()
            };
            let v = values(spec)?;
            h5::write_values(&g, &logical, &spec.shape, &v, "Float", tmp)?;
        }
        Ok(())
    })?;
    publish(run_dir, &partial, &dir, &name, usize::MAX)?;
    Ok(dir)
}

/// Where and how a run writes its checkpoints. [`CheckpointWriter::save`] is a collective over
/// `world`: every rank calls it.
pub struct CheckpointWriter<'a> {
    /// The run directory.
    pub run_dir: &'a Path,
    /// One file per tensor-parallel rank, or one file of logical tensors.
    pub layout: CheckpointLayout,
    /// Checkpoints kept: older ones are deleted after a new one is published.
    pub keep: usize,
    /// This rank's tensor-parallel group.
    pub tp: &'a TpContext,
    /// This rank's data-parallel index (only index 0 of each tensor-parallel group writes whole
    /// shards; every rank writes its parts of a sharded state).
    pub dp_rank: usize,
    /// Every rank.
    pub world: &'a dyn Collective,
}

impl CheckpointWriter<'_> {
    /// Write `state` (local shards of `specs`) as checkpoint `state.step`. Sharded: data-parallel
    /// rank 0 of each tensor-parallel group writes `tp_XX.h5`, or, when `state` holds each rank's
    /// parts ([`DpParts`]), every rank writes its own `tp_XX_dp_YYY.h5`. Unified: tensors are
    /// gathered over the group and world rank 0 writes `model.h5` (whole shards only). Publishes `latest` and applies retention.
    /// On failure every rank gets an error and no `.partial` directory is left behind. Returns
    /// the checkpoint directory.
    pub fn save(&self, state: &TrainingState, specs: &[ParamSpec]) -> Result<PathBuf, DataError> {
        let name = step_dir_name(state.step);
        let partial = self.run_dir.join(format!("{name}.partial"));
        let saved = self.write(state, specs, &name, &partial);
        if saved.is_err() && self.world.rank() == 0 {
            // Leave nothing half-written behind: it would hold disk space a retry needs.
            let _ = fs::remove_dir_all(&partial);
        }
        saved.map(|()| self.run_dir.join(name))
    }

    /// The steps of [`CheckpointWriter::save`], each settled collectively.
    fn write(
        &self,
        state: &TrainingState,
        specs: &[ParamSpec],
        name: &str,
        partial: &Path,
    ) -> Result<(), DataError> {
        let (tp, world) = (self.tp, self.world);
        let dir = self.run_dir.join(name);
        let leader = world.rank() == 0;
        let prepared = if leader {
            let _ = fs::remove_dir_all(partial);
            fs::create_dir_all(partial).map_err(io(partial))
        } else {
            Ok(())
        };
        settle(world, prepared, &dir)?;

        let written = match (self.layout, &state.optimizer.parts) {
            (CheckpointLayout::Sharded, Some(parts)) if parts.writes => write_file(
                &partial.join(part_file_name(tp.rank(), parts.dp_rank)),
                state,
                specs,
                tp.rank(),
                tp.size(),
            ),
            (CheckpointLayout::Sharded, Some(_)) => Ok(()),
            (CheckpointLayout::Unified, Some(_)) => Err(DataError::format(
                partial,
                "a unified checkpoint takes whole tensors, not data-parallel parts",
            )),
            (CheckpointLayout::Sharded, None) if self.dp_rank == 0 => {
                let written = write_file(
                    &partial.join(format!("tp_{:02}.h5", tp.rank())),
                    state,
                    specs,
                    tp.rank(),
                    tp.size(),
                );
                if tp.rank() == 0 {
                    failpoint::hit("checkpoint-file", state.step);
                }
                written
            }
            (CheckpointLayout::Sharded, None) => Ok(()),
            (CheckpointLayout::Unified, None) => {
                let optimizer = state.optimizer.map(|i, t| tp.gather(&specs[i], t));
                let logical: Vec<ParamSpec> = specs
                    .iter()
                    .map(|s| ParamSpec {
                        tp_size: 1,
                        ..s.clone()
                    })
                    .collect();
                let unified = TrainingState {
                    optimizer,
                    config: state.config.clone(),
                    run_id: state.run_id.clone(),
                    ..*state
                };
                if leader {
                    write_file(&partial.join("model.h5"), &unified, &logical, 0, 1)
                } else {
                    Ok(())
                }
            }
        };
        settle(world, written, &dir)?;

        let published = if leader {
            publish(self.run_dir, partial, &dir, name, self.keep)
        } else {
            Ok(())
        };
        settle(world, published, &dir)
    }
}

fn publish(
    run_dir: &Path,
    partial: &Path,
    dir: &Path,
    name: &str,
    keep: usize,
) -> Result<(), DataError> {
    fsync(partial)?;
    if dir.exists() {
        fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    fs::rename(partial, dir).map_err(io(dir))?;
    fsync(run_dir)?;
    let (latest, tmp) = (run_dir.join("latest"), run_dir.join("latest.tmp"));
    fs::write(&tmp, format!("{name}\n")).map_err(io(&tmp))?;
    fsync(&tmp)?;
    fs::rename(&tmp, &latest).map_err(io(&latest))?;
    fsync(run_dir)?;
    for old in retired(&list(run_dir)?, dir, keep) {
        fs::remove_dir_all(old).map_err(io(old))?;
    }
    Ok(())
}

/// The checkpoints retention deletes after `published` became `latest`, from `existing` (sorted
/// by step): those older than `published` beyond the newest `keep - 1` of them. `published`
/// itself and anything newer (left by an earlier run, or passed over by a fallback) are never
/// deleted, so `latest` always names a checkpoint that exists.
fn retired<'a>(existing: &'a [PathBuf], published: &Path, keep: usize) -> &'a [PathBuf] {
    let older = existing.partition_point(|c| c.as_path() < published);
    &existing[..older.saturating_sub(keep.max(1) - 1)]
}

/// The published checkpoints of `run_dir` (directories named `step_` and digits, so no
/// `.partial`), oldest first (the names hold zero-padded step numbers).
pub fn list(run_dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    if !run_dir.exists() {
        return Ok(out);
    }
    for entry in fs::read_dir(run_dir).map_err(io(run_dir))? {
        let path = entry.map_err(io(run_dir))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() && is_step_dir_name(name) {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// The checkpoint `latest` points to, if any. `latest` must hold one checkpoint directory name
/// of this run directory (`step_000000123`, a trailing newline allowed): anything else (empty,
/// whitespace, an absolute or relative path, another name, a target that does not exist) is an
/// error naming the pointer and what it holds, never a silent "no checkpoint".
pub fn latest(run_dir: &Path) -> Result<Option<PathBuf>, DataError> {
    let pointer = run_dir.join("latest");
    if !pointer.exists() {
        return Ok(None);
    }
    let text = crate::files::read_to_string_limited(&pointer, 4096)?;
    let name = text.trim();
    if !is_step_dir_name(name) {
        return Err(DataError::format(
            &pointer,
            format!("holds {text:?}, not the name of a checkpoint directory like `step_000000123`"),
        ));
    }
    let dir = run_dir.join(name);
    if !dir.is_dir() {
        return Err(DataError::format(
            &pointer,
            format!("points to {} which does not exist", dir.display()),
        ));
    }
    Ok(Some(dir))
}

/// Whether `name` is a published checkpoint directory's name: `step_` and decimal digits.
fn is_step_dir_name(name: &str) -> bool {
    name.strip_prefix("step_")
        .is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
}

/// Delete every published checkpoint, the `latest` pointer and leftovers of interrupted saves
/// (`*.partial`, `latest.tmp`) in `run_dir`, returning what was removed: for a run started over
/// on purpose (`flux-hpc train --force` with `resume = false`).
pub fn remove_all(run_dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut removed = Vec::new();
    for entry in fs::read_dir(run_dir).map_err(io(run_dir))? {
        let path = entry.map_err(io(run_dir))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let pointer = matches!(name, "latest" | "latest.tmp");
        let step = name.strip_suffix(".partial").unwrap_or(name);
        if is_step_dir_name(step) && path.is_dir() {
            fs::remove_dir_all(&path).map_err(io(&path))?;
        } else if pointer {
            fs::remove_file(&path).map_err(io(&path))?;
        } else {
            continue;
        }
        removed.push(path);
    }
    removed.sort();
    fsync(run_dir)?;
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_step_names_are_checkpoint_names() {
        for good in ["step_000000001", "step_7"] {
            assert!(is_step_dir_name(good), "{good}");
        }
        for bad in [
            "",
            " ",
            "step_",
            "step_12.partial",
            "/abs/step_1",
            "../step_1",
            "step_1/x",
        ] {
            assert!(!is_step_dir_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn retention_never_deletes_the_published_or_newer_checkpoints() {
        let run = Path::new("/run");
        let steps =
            |s: &[u64]| -> Vec<PathBuf> { s.iter().map(|&s| run.join(step_dir_name(s))).collect() };
        let existing = steps(&[10, 20, 30, 40, 50]);
        // The usual case: the newest was just published.
        assert_eq!(retired(&existing, &existing[4], 2), steps(&[10, 20, 30]));
        // A run that restarted at 20 next to an earlier run's 30..50 keeps those and itself.
        assert_eq!(retired(&existing, &existing[1], 1), steps(&[10]));
        assert_eq!(retired(&existing, &existing[1], 5), steps(&[]));
        assert_eq!(retired(&existing, &existing[0], 1), steps(&[]));
    }
}
