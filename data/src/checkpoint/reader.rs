//! Reading checkpoints: a [`Reader`] opens every file of a `step_*` directory and reassembles one
//! logical tensor at a time (so conversion streams), and [`load`] / [`inspect`] build on it.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use flux_model::tp::ParamSpec;
use tch::Tensor;

use crate::checkpoint::h5::{read_tensor, read_values};
use crate::checkpoint::{LoadedCheckpoint, FORMAT_VERSION, GROUPS};
use crate::dataset::DataPosition;
use crate::error::{io, DataError};
use crate::h5attr::{h5err, read_str, read_u64};

/// The open files of one checkpoint, in tensor-parallel rank order.
pub struct Reader {
    dir: PathBuf,
    paths: Vec<PathBuf>,
    files: Vec<hdf5::File>,
    tp_size: usize,
}

fn open(path: &Path) -> Result<(hdf5::File, u64), DataError> {
    crate::files::require_regular(path)?;
    let file = hdf5::File::open(path).map_err(h5err(path, "open"))?;
    let version = read_u64(&file, "format_version", path)?;
    if version != FORMAT_VERSION {
        return Err(DataError::format(
            path,
            format!("format version {version}, this build reads {FORMAT_VERSION}"),
        ));
    }
    let tp_size = read_u64(&file, "tp_size", path)?;
    Ok((file, tp_size))
}

impl Reader {
    /// Open checkpoint `dir`: every `.h5` file, checking the version and that there is one file
    /// per tensor-parallel rank.
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
        let tp_size = open(first)?.1 as usize;
        if paths.len() != tp_size {
            return Err(DataError::format(
                dir,
                format!(
                    "written at tensor-parallel size {tp_size} but holds {} file(s)",
                    paths.len()
                ),
            ));
        }
        let files = paths
            .iter()
            .enumerate()
            .map(|(rank, p)| {
                let (file, size) = open(p)?;
                let file_rank = read_u64(&file, "tp_rank", p)?;
                if size as usize != tp_size || file_rank != rank as u64 {
                    return Err(DataError::format(
                        p,
                        format!(
                            "holds tensor-parallel rank {file_rank} of {size}; expected rank \
                             {rank} of {tp_size}"
                        ),
                    ));
                }
                Ok(file)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            dir: dir.to_path_buf(),
            paths,
            files,
            tp_size,
        })
    }

    /// Tensor-parallel size the checkpoint was written at.
    pub fn tp_size(&self) -> usize {
        self.tp_size
    }

    /// A root attribute (integer) of the first file.
    pub fn attr_u64(&self, name: &str) -> Result<u64, DataError> {
        read_u64(&self.files[0], name, &self.paths[0])
    }

    /// The run config the checkpoint was written with (TOML).
    pub fn config(&self) -> Result<String, DataError> {
        read_str(&self.files[0], "config", &self.paths[0])
    }

    /// Whether the checkpoint holds `group` (weights-only checkpoints hold only `params`).
    pub fn has_group(&self, group: &str) -> bool {
        self.files[0].group(group).is_ok()
    }

    /// Tensor names of `group`, sorted; every file must hold the same ones.
    pub fn names(&self, group: &str) -> Result<Vec<String>, DataError> {
        let names_in = |file: &hdf5::File, path: &Path| {
            file.group(group)
                .and_then(|g| g.member_names())
                .map_err(h5err(path, group))
        };
        let names = names_in(&self.files[0], &self.paths[0])?;
        for (file, path) in self.files.iter().zip(&self.paths).skip(1) {
            if names_in(file, path)? != names {
                return Err(DataError::format(
                    path,
                    format!(
                        "group `{group}` holds other tensors than in {}",
                        self.paths[0].display()
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
        for (file, path) in self.files.iter().zip(&self.paths) {
            let g = file.group(group).map_err(h5err(path, group))?;
            let (t, s) = read_tensor(&g, name, self.tp_size as i64, path)?;
            if spec.as_ref().is_some_and(|first| *first != s) {
                return Err(DataError::format(
                    path,
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
        if self.tp_size == 1 {
            let g = self.files[0]
                .group(group)
                .map_err(h5err(&self.paths[0], group))?;
            return Ok(read_values(&g, name, 1, &self.paths[0])?.values);
        }
        let t = self.logical(group, name)?.to_kind(tch::Kind::Float);
        Ok(Vec::<f32>::try_from(t.flatten(0, -1)).expect("an f32 tensor"))
    }

    /// One line per parameter: name, logical shape, dtype and shard layout.
    pub fn describe(&self) -> Result<Vec<String>, DataError> {
        let (file, path) = (&self.files[0], &self.paths[0]);
        let mut lines = vec![format!(
            "{}: step {}, {} file(s), tensor-parallel size {}",
            self.dir.display(),
            self.attr_u64("step")?,
            self.paths.len(),
            self.tp_size
        )];
        let g = file.group("params").map_err(h5err(path, "params"))?;
        for name in self.names("params")? {
            let (t, spec) = read_tensor(&g, &name, self.tp_size as i64, path)?;
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
