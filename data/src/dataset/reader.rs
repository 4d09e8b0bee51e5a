//! Reading a dataset of many shards: every shard's structure is checked when it is opened (same
//! layout, every dataset `[num_samples, *shape]` in the stored type), so a truncated or mis-shaped
//! shard fails at start-up with the file and dataset named, never with a panic mid-run.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use hdf5::filters::Filter;
use hdf5::types::VarLenUnicode;
use hdf5::Dataset;

use crate::dataset::checksum::check_crc;
use crate::dataset::layout::{ShardLayout, CAPTIONS, IDS};
use crate::dataset::values::{StorageDtype, Values};
use crate::dataset::writer::Sample;
use crate::error::{io, DataError};
use crate::h5attr::{h5err, read_u64};

/// One opened shard.
struct Shard {
    path: PathBuf,
    layout: ShardLayout,
    numeric: Vec<Dataset>,
    strings: Vec<Dataset>,
    rows: u64,
}

/// A dataset of latent shards, indexed `0..len()` in file order. Shards may differ in latent
/// height and width (each shard is one resolution bucket), in nothing else.
pub struct LatentDataset {
    layout: ShardLayout,
    shards: Vec<Shard>,
    /// Global index of each shard's first sample.
    starts: Vec<u64>,
    len: u64,
}

/// The shard files named by `paths`: files as given, directories expanded to their `*.h5` files
/// in name order. A shard reached twice (a path listed twice, or a directory and a file in it)
/// is refused rather than read twice as often as the others; so is a path that is neither a
/// directory nor a regular file.
pub fn shard_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, DataError> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut inside: Vec<PathBuf> = fs::read_dir(path)
                .map_err(io(path))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "h5"))
                .collect();
            inside.sort();
            files.extend(inside);
        } else if path.exists() {
            files.push(path.clone());
        } else {
            return Err(DataError::format(path, "no such file or directory"));
        }
    }
    let mut seen = std::collections::HashMap::new();
    for file in &files {
        crate::files::require_regular(file)?;
        let real = fs::canonicalize(file).map_err(io(file))?;
        if let Some(first) = seen.insert(real, file) {
            return Err(DataError::format(
                file,
                format!(
                    "is listed twice among the data paths (also as {}); each shard may be named once",
                    first.display()
                ),
            ));
        }
    }
    Ok(files)
}

/// The error for `paths` that name no shard file.
pub(crate) fn no_shards(paths: &[PathBuf]) -> DataError {
    let shown: Vec<_> = paths.iter().map(|p| p.display().to_string()).collect();
    DataError::Format {
        path: shown.join(", "),
        message: "no latent shards (*.h5) found".into(),
    }
}

/// Open `path`, read its layout and check every dataset's type and shape against it. Returns the
/// layout, sample count and the datasets (numeric in layout order, then strings).
fn open_shard(path: &Path) -> Result<Shard, DataError> {
    let file = hdf5::File::open(path).map_err(h5err(path, "open"))?;
    let layout = ShardLayout::read(&file, path)?;
    let rows = read_u64(&file, "num_samples", path)?;
    let dataset = |name: &str, shape: &[usize], size: Option<usize>| {
        let ds = file.dataset(name).map_err(h5err(path, name))?;
        let expected: Vec<usize> = std::iter::once(rows as usize)
            .chain(shape.iter().copied())
            .collect();
        if ds.shape() != expected {
            return Err(DataError::format(
                path,
                format!(
                    "dataset `{name}` has shape {:?}, the shard's attributes say {expected:?}",
                    ds.shape()
                ),
            ));
        }
        if let Some(size) = size {
            let stored = ds.dtype().map_err(h5err(path, name))?.size();
            if stored != size {
                return Err(DataError::format(
                    path,
                    format!(
                        "dataset `{name}` stores {stored}-byte values, dtype {} needs {size}",
                        layout.dtype
                    ),
                ));
            }
        }
        Ok(ds)
    };
    // Reads check what `data validate` checks: HDF5 verifies a Fletcher-32 dataset chunk by chunk
    // as training reads it; any other numeric dataset, and the strings (whose bytes no filter
    // covers), are checked against their CRC-32 here, once, before training trusts them.
    let numeric = layout
        .numeric()
        .iter()
        .map(|(name, shape)| {
            let ds = dataset(name, shape, Some(layout.dtype.size()))?;
            let fletcher = ds.filters().iter().any(|f| matches!(f, Filter::Fletcher32));
            if !fletcher {
                check_crc(path, name, &ds, Some(layout.dtype))?;
            }
            Ok(ds)
        })
        .collect::<Result<Vec<_>, DataError>>()?;
    let strings = layout
        .strings()
        .iter()
        .map(|name| {
            let ds = dataset(name, &[], None)?;
            check_crc(path, name, &ds, None)?;
            Ok(ds)
        })
        .collect::<Result<Vec<_>, DataError>>()?;
    Ok(Shard {
        path: path.to_path_buf(),
        layout,
        numeric,
        strings,
        rows,
    })
}

impl LatentDataset {
    /// Open the shards named by `paths` (files, or directories of `*.h5`). Fails naming the file
    /// when a shard cannot be read, has another layout than the first (the latent height and
    /// width aside), or holds no samples.
    pub fn open(paths: &[PathBuf]) -> Result<Self, DataError> {
        let files = shard_files(paths)?;
        let Some(first) = files.first() else {
            return Err(no_shards(paths));
        };
        // Each shard is opened (and its checksums read) once; the first sets the layout.
        let first_shard = open_shard(first)?;
        let layout = first_shard.layout.clone();
        let (mut starts, mut len) = (vec![0], first_shard.rows);
        let mut shards = vec![first_shard];
        for path in &files[1..] {
            let shard = open_shard(path)?;
            if !layout.same_but_bucket(&shard.layout) {
                return Err(DataError::format(
                    path,
                    format!(
                        "layout differs from {} in more than the latent size: {:?} vs {layout:?}",
                        first.display(),
                        shard.layout
                    ),
                ));
            }
            starts.push(len);
            len += shard.rows;
            shards.push(shard);
        }
        if len == 0 {
            return Err(DataError::format(first, "the dataset holds no samples"));
        }
        Ok(Self {
            layout,
            shards,
            starts,
            len,
        })
    }

    /// The first shard's layout; every shard shares it but for its latent size.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    fn shard_of(&self, index: u64) -> usize {
        self.starts.partition_point(|&start| start <= index) - 1
    }

    /// The layout of the shard holding sample `index` (`0..len()`): its latent size is the
    /// sample's resolution bucket.
    pub fn layout_of(&self, index: u64) -> &ShardLayout {
        &self.shards[self.shard_of(index.min(self.len - 1))].layout
    }

    /// The shard file holding sample `index` (`0..len()`).
    pub fn file_of(&self, index: u64) -> &Path {
        &self.shards[self.shard_of(index.min(self.len - 1))].path
    }

    /// The sample indices of each resolution bucket `[H, W]`, buckets in ascending order and
    /// indices in file order.
    pub fn buckets(&self) -> BTreeMap<[usize; 2], Vec<u64>> {
        let mut buckets = BTreeMap::<_, Vec<u64>>::new();
        for (shard, &start) in self.shards.iter().zip(&self.starts) {
            buckets
                .entry(shard.layout.bucket())
                .or_default()
                .extend(start..start + shard.rows);
        }
        buckets
    }

    /// Samples in all shards.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether there are no samples (never true for an opened dataset).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shard files, in index order.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// Sample `index` (`0..len()`), values decoded to f32. A read failure (e.g. a shard truncated
    /// after it was opened) names the file and dataset.
    pub fn read(&self, index: u64) -> Result<Sample, DataError> {
        if index >= self.len {
            return Err(DataError::format(
                &self.shards[0].path,
                format!("sample {index} is past the dataset's {} samples", self.len),
            ));
        }
        let s = self.shard_of(index);
        let shard = &self.shards[s];
        let row = (index - self.starts[s]) as usize;
        let dtype: StorageDtype = self.layout.dtype;
        let names = self.layout.numeric();
        let mut numeric = shard
            .numeric
            .iter()
            .zip(&names)
            .map(|(ds, (name, _))| {
                Values::read_rows(dtype, ds, row..row + 1)
                    .map(|v| v.to_f32())
                    .map_err(h5err(&shard.path, name))
            })
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let mut text = shard.strings.iter().zip([IDS, CAPTIONS]).map(|(ds, name)| {
            ds.read_slice_1d::<VarLenUnicode, _>(row..row + 1)
                .map(|a| a[0].to_string())
                .map_err(h5err(&shard.path, name))
        });
        let id = text.next().expect("ids are always stored")?;
        let caption = text.next().transpose()?;
        let mut next = || numeric.next().expect("one vector per numeric dataset");
        let latents = next();
        let logvar = self.layout.logvar.then(&mut next);
        let (t5, clip) = (next(), next());
        Ok(Sample {
            id,
            latents,
            logvar,
            t5,
            clip,
            caption,
            mask: self.layout.mask.then(next),
        })
    }
}
