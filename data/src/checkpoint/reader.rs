//! Reading checkpoints: a [`Reader`] opens every file of a `step_*` directory and reassembles one
//! logical tensor at a time (so conversion streams), and [`load`] / [`inspect`] build on it.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use flux_model::tp::ParamSpec;
use tch::Tensor;

use crate::checkpoint::h5::{read_tensor, read_values};
use crate::checkpoint::{part_file_name, LoadedCheckpoint, FORMAT_VERSION, GROUPS};
use crate::dataset::DataPosition;
use crate::error::{io, DataError};
use crate::h5attr::{h5err, read_str, read_u64};

/// The open files of one checkpoint, in tensor-parallel rank order: one per rank, or, for a
/// run whose optimizer state was sharded over data-parallel ranks, one per (tensor-parallel,
/// data-parallel) rank, each holding a part of every tensor.
pub struct Reader {
    dir: PathBuf,
    /// Per tensor-parallel rank, its files in data-parallel rank order.
    files: Vec<Vec<(PathBuf, hdf5::File)>>,
    tp_size: usize,
    /// What every file states alike (read from the first, checked against the others).
    identity: Identity,
}

/// Most part files a missing-file error names one by one.
const MAX_LISTED_PARTS: usize = 4096;

/// A checkpoint file's place: its tensor-parallel rank and size, and its data-parallel rank and
/// size (0 of 1 for a file holding whole shards).
struct Place {
    tp: (usize, usize),
    dp: (usize, usize),
}

/// What every file of one checkpoint states alike.
struct Identity {
    step: u64,
    optimizer_step: u64,
    run_id: String,
    config: String,
}

impl Identity {
    /// The root attributes of `file` (at `path`); `run_id` is empty where the file has none.
    fn read(file: &hdf5::File, path: &Path) -> Result<Self, DataError> {
        Ok(Self {
            step: read_u64(file, "step", path)?,
            optimizer_step: read_u64(file, "optimizer_step", path)?,
            run_id: match file.attr("run_id") {
                Ok(_) => read_str(file, "run_id", path)?,
                Err(_) => String::new(),
            },
            config: read_str(file, "config", path)?,
        })
    }

    /// How `self` differs from `other`, in words (`None`: it does not).
    fn differs_from(&self, other: &Self) -> Option<String> {
        let run = |id: &str| match id {
            "" => "an unnamed run".to_string(),
            id => format!("run {id}"),
        };
        if self.step != other.step || self.optimizer_step != other.optimizer_step {
            Some(format!(
                "it holds step {} (optimizer step {}), the other step {} (optimizer step {})",
                self.step, self.optimizer_step, other.step, other.optimizer_step
            ))
        } else if self.run_id != other.run_id {
            Some(format!(
                "it was written by {}, the other by {}",
                run(&self.run_id),
                run(&other.run_id)
            ))
        } else if self.config != other.config {
            Some("it was written with another run config".to_string())
        } else {
            None
        }
    }
}

/// Check that every file of checkpoint `dir` belongs to it: the step the directory's name states
/// (`step_000000012`), and the first file's step, run and config, which it returns. A part
/// copied in from another run, or from another step of the same run, is refused naming it.
fn check_belonging(
    dir: &Path,
    files: &[Vec<(PathBuf, hdf5::File)>],
) -> Result<Identity, DataError> {
    let (first_path, first) = &files[0][0];
    let expected = Identity::read(first, first_path)?;
    let named_step = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("step_"))
        .and_then(|digits| digits.parse::<u64>().ok());
    if let Some(step) = named_step.filter(|&s| s != expected.step) {
        return Err(DataError::format(
            first_path,
            format!(
                "holds step {} but lies in the checkpoint of step {step}: a file copied in \
                 from another checkpoint",
                expected.step
            ),
        ));
    }
    for (path, file) in files.iter().flatten().skip(1) {
        let this = Identity::read(file, path)?;
        if let Some(what) = this.differs_from(&expected) {
            return Err(DataError::format(
                path,
                format!(
                    "does not belong with {}: {what}; it was copied in from another \
                     checkpoint",
                    first_path.display()
                ),
            ));
        }
    }
    Ok(expected)
}

fn open(path: &Path) -> Result<(hdf5::File, Place), DataError> {
    crate::files::require_regular(path)?;
    let file = hdf5::File::open(path).map_err(h5err(path, "open"))?;
    let version = read_u64(&file, "format_version", path)?;
    if version != FORMAT_VERSION {
        return Err(DataError::format(
            path,
            format!("format version {version}, this build reads {FORMAT_VERSION}"),
        ));
    }
    let attr = |name: &str, default: u64| match file.attr(name) {
        Ok(_) => read_u64(&file, name, path),
        Err(_) => Ok(default),
    };
    let place = Place {
        tp: (
            attr("tp_rank", 0)? as usize,
            read_u64(&file, "tp_size", path)? as usize,
        ),
        dp: (attr("dp_rank", 0)? as usize, attr("dp_size", 1)? as usize),
    };
    Ok((file, place))
}

impl Reader {
    /// Open checkpoint `dir`: every `.h5` file, checking the version and that there is one file
    /// per tensor-parallel rank, or one per data-parallel part of each.
    pub fn open(dir: &Path) -> Result<Self, DataError> {
        let mut paths: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "h5"))
            .collect();
        paths.sort();
        let Some(first) = paths.first() else {
            return Err(DataError::format(dir, "holds no .h5 files"));
        };
        let Place {
            tp: (_, tp_size),
            dp: (_, dp_size),
        } = open(first)?.1;
        // The sizes are read from a file: a hostile one must not overflow or be iterated.
        let expected = tp_size.checked_mul(dp_size);
        if expected != Some(paths.len()) {
            let named = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned());
            let present: Vec<String> = paths.iter().filter_map(named).collect();
            let file_name = |i: usize| match dp_size {
                1 => format!("tp_{i:02}.h5"),
                _ => part_file_name(i / dp_size, i % dp_size),
            };
            let missing: Vec<String> = match expected {
                Some(n) if n <= MAX_LISTED_PARTS => (0..n)
                    .map(file_name)
                    .filter(|n| !present.contains(n))
                    .collect(),
                _ => Vec::new(),
            };
            let parts = match dp_size {
                1 => String::new(),
                _ => format!(" with {dp_size} data-parallel part(s) per rank"),
            };
            return Err(DataError::format(
                dir,
                format!(
                    "written at tensor-parallel size {tp_size}{parts} but holds {} file(s){}",
                    paths.len(),
                    match missing.is_empty() {
                        true => String::new(),
                        false => format!("; missing {}", missing.join(", ")),
                    }
                ),
            ));
        }
        let mut files: Vec<Vec<(PathBuf, hdf5::File)>> = (0..tp_size).map(|_| Vec::new()).collect();
        for (i, p) in paths.into_iter().enumerate() {
            let (file, place) = open(&p)?;
            let expected = Place {
                tp: (i / dp_size, tp_size),
                dp: (i % dp_size, dp_size),
            };
            if (place.tp, place.dp) != (expected.tp, expected.dp) {
                return Err(DataError::format(
                    &p,
                    format!(
                        "holds tensor-parallel rank {} of {} (data-parallel part {} of {}); \
                         expected rank {} of {tp_size} (part {} of {dp_size})",
                        place.tp.0,
                        place.tp.1,
                        place.dp.0,
                        place.dp.1,
                        expected.tp.0,
                        expected.dp.0
                    ),
                ));
            }
            files[expected.tp.0].push((p, file));
        }
        let identity = check_belonging(dir, &files)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            tp_size,
            identity,
        })
    }

    /// The first file.
    fn first(&self) -> (&Path, &hdf5::File) {
        let (path, file) = &self.files[0][0];
        (path, file)
    }

    /// The files of tensor-parallel rank `rank`.
    fn of_rank(&self, rank: usize) -> Vec<(&Path, &hdf5::File)> {
        self.files[rank]
            .iter()
            .map(|(p, f)| (p.as_path(), f))
            .collect()
    }

    /// Tensor-parallel size the checkpoint was written at.
    pub fn tp_size(&self) -> usize {
        self.tp_size
    }

    /// A root attribute (integer) of the first file.
    pub fn attr_u64(&self, name: &str) -> Result<u64, DataError> {
        let (path, file) = self.first();
        read_u64(file, name, path)
    }

    /// The run config the checkpoint was written with (TOML).
    pub fn config(&self) -> Result<String, DataError> {
        Ok(self.identity.config.clone())
    }

    /// The identity of the run that wrote the checkpoint (empty when its files name none).
    pub fn run_id(&self) -> &str {
        &self.identity.run_id
    }

    /// Whether the checkpoint holds `group` (weights-only checkpoints hold only `params`).
    pub fn has_group(&self, group: &str) -> bool {
        self.first().1.group(group).is_ok()
    }

    /// Tensor names of `group`, sorted; every file must hold the same ones.
    pub fn names(&self, group: &str) -> Result<Vec<String>, DataError> {
        let names_in = |file: &hdf5::File, path: &Path| {
            file.group(group)
                .and_then(|g| g.member_names())
                .map_err(h5err(path, group))
        };
        let (first_path, first) = self.first();
        let names = names_in(first, first_path)?;
        for (path, file) in self.files.iter().flatten().skip(1) {
            if names_in(file, path)? != names {
                return Err(DataError::format(
                    path,
                    format!(
                        "group `{group}` holds other tensors than in {}",
                        first_path.display()
                    ),
                ));
            }
        }
        Ok(names)
    }

    /// The logical tensor `group/name`, reassembled from every rank's shard (CRC-checked).
    pub fn logical(&self, group: &str, name: &str) -> Result<Tensor, DataError> {
        let mut shards = Vec::with_capacity(self.tp_size);
        let mut spec: Option<ParamSpec> = None;
        for rank in 0..self.tp_size {
            let files = self.of_rank(rank);
            let (t, s) = read_tensor(&files, group, name, self.tp_size as i64)?;
            if spec.as_ref().is_some_and(|first| *first != s) {
                return Err(DataError::format(
                    files[0].0,
                    format!("`{group}/{name}` is laid out differently than in the first file"),
                ));
            }
            shards.push(t);
            spec = Some(s);
        }
        Ok(spec.expect("at least one file").unshard(&shards))
    }

    /// The logical tensor `group/name` as row-major f32 values; a single-file checkpoint is
    /// read without an intermediate tensor.
    pub fn logical_values(&self, group: &str, name: &str) -> Result<Vec<f32>, DataError> {
        if self.tp_size == 1 && self.files[0].len() == 1 {
            let (path, file) = self.first();
            let g = file.group(group).map_err(h5err(path, group))?;
            return Ok(read_values(&g, name, 1, path)?.values);
        }
        let t = self.logical(group, name)?.to_kind(tch::Kind::Float);
        Ok(Vec::<f32>::try_from(t.flatten(0, -1)).expect("an f32 tensor"))
    }

    /// One line per parameter: name, logical shape, dtype and shard layout.
    pub fn describe(&self) -> Result<Vec<String>, DataError> {
        let mut lines = vec![format!(
            "{}: step {}, {} file(s), tensor-parallel size {}, {} data-parallel part(s) per rank",
            self.dir.display(),
            self.attr_u64("step")?,
            self.files.iter().map(Vec::len).sum::<usize>(),
            self.tp_size,
            self.files[0].len()
        )];
        for name in self.names("params")? {
            let (t, spec) = read_tensor(&self.of_rank(0), "params", &name, self.tp_size as i64)?;
            let split = match spec.split_dim {
                None => "replicated".to_string(),
                Some(d) if spec.parts.is_empty() => format!("split dim {d}"),
                Some(d) => format!(
                    "split dim {d} in parts [{}]",
                    spec.parts
                        .iter()
                        .map(|(n, s)| format!("{n}={s}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            lines.push(format!(
                "  {name:<60} {:?} {:?} (local {:?}) {split}",
                spec.shape,
                t.kind(),
                t.size()
            ));
        }
        Ok(lines)
    }
}

/// Read checkpoint `dir` and reassemble every logical tensor (checking every CRC). A
/// weights-only checkpoint (from `flux-hpc convert`) has no moment groups.
pub fn load(dir: &Path) -> Result<LoadedCheckpoint, DataError> {
    let reader = Reader::open(dir)?;
    let mut tensors = HashMap::new();
    for group in GROUPS.into_iter().filter(|g| reader.has_group(g)) {
        let by_name = reader
            .names(group)?
            .into_iter()
            .map(|name| Ok((name.clone(), reader.logical(group, &name)?)))
            .collect::<Result<HashMap<_, _>, DataError>>()?;
        tensors.insert(group.to_string(), by_name);
    }
    Ok(LoadedCheckpoint {
        dir: dir.to_path_buf(),
        step: reader.attr_u64("step")?,
        optimizer_step: reader.attr_u64("optimizer_step")?,
        config: reader.config()?,
        run_id: reader.run_id().to_string(),
        data: DataPosition {
            epoch: reader.attr_u64("data_epoch")?,
            index: reader.attr_u64("data_index")?,
        },
        tensors,
    })
}

/// One line per parameter of checkpoint `dir`: name, logical shape, dtype and shard layout.
/// Every tensor of every group is read and checked first, exactly as [`load`] reads them, so a
/// checkpoint that inspects cleanly is one that training can resume from.
pub fn inspect(dir: &Path) -> Result<Vec<String>, DataError> {
    let reader = Reader::open(dir)?;
    for group in GROUPS.into_iter().filter(|g| reader.has_group(g)) {
        for name in reader.names(group)? {
            drop(reader.logical(group, &name)?);
        }
    }
    reader.describe()
}
