//! `flux-hpc convert`: weights between native checkpoints and the external layouts the model's
//! architecture declares (FLUX.1 and FLUX.2: BFL and diffusers safetensors), one tensor
//! at a time. The key mapping comes from the architecture ([`ModelSpec::external_source`]; for
//! FLUX.1 the model crate's table, shared with the loader the parity tests use).
//!
//! Every conversion reads the source's logical native tensors in parameter order and hands each
//! to the sink, so resident memory stays a few copies of the largest tensor, not the model.

mod fp8;
mod safetensors_stream;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use flux_model::convert::{Combine, Layout};
use flux_model::tp::ParamSpec;
use flux_model::ModelSpec;

pub use safetensors_stream::{
    decode_in_memory, write_streaming, write_tensors, SafetensorsReader, TensorInfo, CRC_KEY,
};

use crate::checkpoint::{self, Reader};
use crate::dataset::StorageDtype;
use crate::error::{io, DataError};

/// A checkpoint format `convert` reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A flux-hpc checkpoint directory (`step_*/`, any tensor-parallel size) to read, or a new
    /// run directory to write a weights-only `step_000000000/` into.
    Native,
    /// An external safetensors layout: a file, or a directory holding the weights (diffusers:
    /// `diffusion_pytorch_model.safetensors` or its sharded index).
    External(Layout),
    /// The moving average of a native checkpoint's weights (its `ema` group); input only.
    NativeEma,
}

/// What a conversion wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertReport {
    /// Where it was written.
    pub output: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters written.
    pub params: u64,
}

/// External weights: one or more safetensors files and which file holds each key.
struct External {
    files: Vec<SafetensorsReader>,
    by_key: HashMap<String, usize>,
    layout: Layout,
    model: ModelSpec,
}

/// The safetensors files of `input`: a file, a diffusers directory, or a sharded index.
fn external_files(input: &Path) -> Result<Vec<PathBuf>, DataError> {
    if !input.is_dir() {
        return Ok(vec![input.to_path_buf()]);
    }
    let single = input.join("diffusion_pytorch_model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = input.join("diffusion_pytorch_model.safetensors.index.json");
    if index.exists() {
        let text = crate::files::read_to_string_limited(&index, 64 << 20)?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| DataError::format(&index, format!("not JSON: {e}")))?;
        let names: BTreeSet<&str> = json["weight_map"]
            .as_object()
            .ok_or_else(|| DataError::format(&index, "no `weight_map` object"))?
            .values()
            .filter_map(|v| v.as_str())
            .collect();
        return Ok(names.into_iter().map(|n| input.join(n)).collect());
    }
    let mut files: Vec<PathBuf> = fs::read_dir(input)
        .map_err(io(input))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DataError::format(input, "holds no .safetensors files"));
    }
    Ok(files)
}

impl External {
    fn open(input: &Path, layout: Layout, model: &ModelSpec) -> Result<Self, DataError> {
        let files = external_files(input)?
            .iter()
            .map(|p| {
                let reader = SafetensorsReader::open(p)?;
                reader.verify_checksum()?;
                Ok(reader)
            })
            .collect::<Result<Vec<_>, DataError>>()?;
        let mut by_key = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for key in f.tensors().keys() {
                if let Some(first) = by_key.insert(key.clone(), i) {
                    return Err(DataError::format(
                        f.path(),
                        format!("`{key}` is also in {}", files[first].path().display()),
                    ));
                }
            }
        }
        Ok(Self {
            files,
            by_key,
            layout,
            model: model.clone(),
        })
    }

    fn fail(&self, message: String) -> DataError {
        DataError::format(
            self.files.first().map_or(Path::new("?"), |f| f.path()),
            message,
        )
    }

    /// Check, from the headers alone, that every parameter of `specs` is found with its shape and
    /// that every tensor is used — before anything is written.
    fn check(&self, specs: &[ParamSpec]) -> Result<(), DataError> {
        let mut used = BTreeSet::new();
        for spec in specs {
            let src = self
                .model
                .external_source(&spec.name, self.layout)
                .ok_or_else(|| {
                    self.fail(format!("no {:?} name for `{}`", self.layout, spec.name))
                })?;
            let mut rows = 0;
            for key in &src.keys {
                let info = self.info(key, &spec.name)?;
                let (head, tail) = info.shape.split_first().unzip();
                let tail_ok = tail.is_some_and(|t| {
                    t.iter()
                        .map(|&d| d as i64)
                        .eq(spec.shape[1..].iter().copied())
                });
                if !tail_ok
                    || (src.combine != Combine::Stack && info.shape.len() != spec.shape.len())
                {
                    return Err(self.fail(format!(
                        "`{key}` has shape {:?}, `{}` needs {:?}",
                        info.shape, spec.name, spec.shape
                    )));
                }
                rows += head.copied().unwrap_or(0) as i64;
                used.insert(key.clone());
            }
            if rows != spec.shape[0] {
                return Err(self.fail(format!(
                    "{:?} give {rows} rows, `{}` needs {:?}",
                    src.keys, spec.name, spec.shape
                )));
            }
        }
        let unused: Vec<&String> = self.by_key.keys().filter(|k| !used.contains(*k)).collect();
        if let Some(first) = unused.iter().min() {
            return Err(self.fail(format!(
                "{} tensor(s) are not used by this config (e.g. `{first}`): is it the right config?",
                unused.len()
            )));
        }
        Ok(())
    }

    fn info(&self, key: &str, native: &str) -> Result<&TensorInfo, DataError> {
        self.by_key
            .get(key)
            .and_then(|&i| self.files[i].tensors().get(key))
            .ok_or_else(|| self.fail(format!("missing tensor `{key}` (needed for `{native}`)")))
    }

    fn read(&self, spec: &ParamSpec) -> Result<Vec<f32>, DataError> {
        let src = self
            .model
            .external_source(&spec.name, self.layout)
            .expect("checked before reading");
        let mut values = Vec::with_capacity(spec.numel() as usize);
        for key in &src.keys {
            values.extend(self.files[self.by_key[key]].read_f32(key)?);
        }
        if src.combine == Combine::SwapHalves {
            let half = values.len() / 2;
            values.rotate_left(half);
        }
        Ok(values)
    }
}

/// The external tensors of native `spec`: `(key, shape, flat range of the native values)`, the
/// halves swapped back for `SwapHalves`.
fn external_parts(
    spec: &ParamSpec,
    layout: Layout,
    model: &ModelSpec,
) -> Vec<(String, Vec<usize>, std::ops::Range<usize>)> {
    let src = model
        .external_source(&spec.name, layout)
        .expect("every native name has a row");
    let shape: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
    let row: usize = shape[1..].iter().product();
    let rows = src.rows(spec);
    let mut start = 0;
    src.keys
        .into_iter()
        .zip(rows.into_iter().map(|n| n as usize))
        .map(|(key, n)| {
            let mut part_shape = shape.clone();
            part_shape[0] = n;
            let range = start * row..(start + n) * row;
            start += n;
            (key, part_shape, range)
        })
        .collect()
}

/// Where logical native tensors are read from.
enum Source {
    /// A native checkpoint (any tensor-parallel size), its group `params` or `ema`.
    Native(Reader, PathBuf, &'static str),
    /// External safetensors.
    External(External),
}

impl Source {
    /// Open `input` and check, before anything is written, that it holds exactly the parameters
    /// of `specs` (external sources: with their shapes, from the headers).
    fn open(
        from: Format,
        input: &Path,
        model: &ModelSpec,
        specs: &[ParamSpec],
    ) -> Result<Self, DataError> {
        match from {
            Format::Native | Format::NativeEma => {
                let group = if from == Format::NativeEma {
                    "ema"
                } else {
                    "params"
                };
                let reader = Reader::open(input)?;
                if !reader.has_group(group) {
                    return Err(DataError::format(
                        input,
                        format!("holds no `{group}` group (was [training] ema_decay set?)"),
                    ));
                }
                let names: BTreeSet<String> = reader.names(group)?.into_iter().collect();
                let wanted: BTreeSet<String> = specs.iter().map(|s| s.name.clone()).collect();
                if names != wanted {
                    return Err(DataError::format(
                        input,
                        format!(
                            "parameters differ from the config: missing {:?}, unexpected {:?}",
                            wanted.difference(&names).next(),
                            names.difference(&wanted).next()
                        ),
                    ));
                }
                Ok(Self::Native(reader, input.to_path_buf(), group))
            }
            Format::External(layout) => {
                let external = External::open(input, layout, model)?;
                external.check(specs)?;
                Ok(Self::External(external))
            }
        }
    }

    /// The logical values of `spec`, row-major f32.
    fn read(&self, spec: &ParamSpec) -> Result<Vec<f32>, DataError> {
        match self {
            Self::External(external) => external.read(spec),
            Self::Native(reader, input, group) => {
                let values = reader.logical_values(group, &spec.name)?;
                if values.len() as u64 != spec.numel() {
                    return Err(DataError::format(
                        input,
                        format!(
                            "`{}` holds {} values, the config's shape {:?} needs {}",
                            spec.name,
                            values.len(),
                            spec.shape,
                            spec.numel()
                        ),
                    ));
                }
                Ok(values)
            }
        }
    }
}

/// Convert `input` in format `from` to `output` in format `to` for the model `model`
/// (`run_config` is the TOML stored in native checkpoints). External output is written in
/// `dtype`; native output is f32. Nothing is written unless the input fits the config and the
/// architecture has the external layout.
pub fn convert(
    from: Format,
    input: &Path,
    to: Format,
    output: &Path,
    model: &ModelSpec,
    run_config: &str,
    dtype: StorageDtype,
) -> Result<ConvertReport, DataError> {
    for (format, path) in [(from, input), (to, output)] {
        if let Format::External(layout) = format {
            if !model.weight_layouts().contains(&layout) {
                return Err(DataError::format(
                    path,
                    format!(
                        "architecture \"{}\" has no {layout:?} layout (it has {:?})",
                        model.architecture(),
                        model.weight_layouts()
                    ),
                ));
            }
        }
    }
    if to == Format::NativeEma {
        return Err(DataError::format(
            output,
            "the EMA is read from a native checkpoint, not written: write native weights",
        ));
    }
    let specs: Vec<ParamSpec> = model.param_specs(1);
    let source = Source::open(from, input, model, &specs)?;
    let mut read = |spec: &ParamSpec| source.read(spec);
    let params = specs.iter().map(ParamSpec::numel).sum();
    match to {
        Format::Native | Format::NativeEma => {
            let dir = checkpoint::write_weights(output, run_config, &specs, &mut read)?;
            Ok(ConvertReport {
                output: dir,
                tensors: specs.len(),
                params,
            })
        }
        Format::External(layout) => {
            let file = match layout {
                Layout::Diffusers => {
                    let json = model
                        .diffusers_config()
                        .map_err(|m| DataError::format(output, m))?;
                    fs::create_dir_all(output).map_err(io(output))?;
                    let path = output.join("config.json");
                    let text = serde_json::to_string_pretty(&json).expect("JSON serialises");
                    fs::write(&path, text + "\n").map_err(io(&path))?;
                    output.join("diffusion_pytorch_model.safetensors")
                }
                Layout::Bfl => output.to_path_buf(),
            };
            let mut plan = Vec::new();
            let mut owner = Vec::new();
            for (i, spec) in specs.iter().enumerate() {
                for (key, shape, range) in external_parts(spec, layout, model) {
                    plan.push((key, shape));
                    owner.push((i, range));
                }
            }
            let metadata = BTreeMap::from([
                ("format".to_string(), "pt".to_string()),
                ("producer".to_string(), "flux-hpc convert".to_string()),
            ]);
            let mut cached: Option<(usize, Vec<f32>)> = None;
            write_streaming(&file, dtype, &plan, &metadata, |k| {
                let (i, range) = owner[k].clone();
                if cached.as_ref().is_none_or(|(c, _)| *c != i) {
                    let mut v = read(&specs[i])?;
                    if model
                        .external_source(&specs[i].name, layout)
                        .is_some_and(|s| s.combine == Combine::SwapHalves)
                    {
                        let half = v.len() / 2;
                        v.rotate_left(half);
                    }
                    cached = Some((i, v));
                }
                Ok(cached.as_ref().expect("filled above").1[range].to_vec())
            })?;
            Ok(ConvertReport {
                output: file,
                tensors: plan.len(),
                params,
            })
        }
    }
}
