//! Writing latent shards: one sample at a time into chunked, resizable datasets (one sample per
//! chunk), CRC-32s accumulated on the way, published by fsync and rename so a crash never leaves a
//! shard that looks finished.

use std::fs;
use std::path::{Path, PathBuf};

use hdf5::types::VarLenUnicode;
use hdf5::{Dataset, Extent, Extents, SimpleExtents};

use crate::dataset::layout::ShardLayout;
use crate::dataset::values::{StorageDtype, Values};
use crate::error::{io, DataError};
use crate::h5attr::{h5err, write_u64};

/// One sample before encoding, values row-major in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Key of the sample in its source (file stem, tar key).
    pub id: String,
    /// Latent (or posterior mean) `[C, H, W]`.
    pub latents: Vec<f32>,
    /// Posterior log-variance `[C, H, W]`, when the layout has one.
    pub logvar: Option<Vec<f32>>,
    /// Text states `[S, D_text]`.
    pub t5: Vec<f32>,
    /// Pooled embedding `[D_pooled]`.
    pub clip: Vec<f32>,
    /// Caption, when the layout has captions.
    pub caption: Option<String>,
    /// Loss weights `[H, W]` in `[0, 1]`, when the layout has masks.
    pub mask: Option<Vec<f32>>,
}

impl Sample {
    /// The numeric fields present, in the order of [`ShardLayout::numeric`].
    pub(crate) fn numeric(&self) -> Vec<&[f32]> {
        let mut out = vec![self.latents.as_slice()];
        out.extend(self.logvar.as_deref());
        out.extend([self.t5.as_slice(), self.clip.as_slice()]);
        out.extend(self.mask.as_deref());
        out
    }
}

struct Column {
    name: &'static str,
    ds: Dataset,
    shape: Vec<usize>,
    crc: crc32fast::Hasher,
}

/// Writes one shard file. Call [`ShardWriter::finish`] to publish it; dropping it unfinished
/// (an error while writing) removes its `.tmp` file and leaves nothing behind.
pub struct ShardWriter {
    path: PathBuf,
    tmp: Unfinished,
    file: hdf5::File,
    layout: ShardLayout,
    numeric: Vec<Column>,
    strings: Vec<Column>,
    rows: usize,
}

fn create_numeric(
    file: &hdf5::File,
    name: &str,
    dtype: StorageDtype,
    shape: &[usize],
    deflate: Option<u8>,
) -> hdf5::Result<Dataset> {
    let extents = Extents::Simple(SimpleExtents::from_vec(
        std::iter::once(Extent::resizable(0))
            .chain(shape.iter().map(|&d| Extent::fixed(d)))
            .collect(),
    ));
    let chunk: Vec<usize> = std::iter::once(1).chain(shape.iter().copied()).collect();
    macro_rules! build {
        ($t:ty) => {{
            // Fletcher-32 per chunk: every read during training checks the bytes it gets.
            let mut b = file
                .new_dataset::<$t>()
                .chunk(chunk)
                .shape(extents)
                .fletcher32();
            if let Some(level) = deflate {
                b = b.deflate(level);
            }
            b.create(name)
        }};
    }
    match dtype {
        StorageDtype::Bf16 => build!(u16),
        StorageDtype::F16 => build!(half::f16),
        StorageDtype::F32 => build!(f32),
    }
}

impl ShardWriter {
    /// Start `path` (written as `path.tmp` until finished) for samples of `layout`, optionally
    /// deflate-compressed at `deflate` (1–9).
    pub fn create(
        path: &Path,
        layout: &ShardLayout,
        deflate: Option<u8>,
    ) -> Result<Self, DataError> {
        let tmp = path.with_extension("h5.tmp");
        let file = hdf5::File::create(&tmp).map_err(h5err(&tmp, "create"))?;
        let guard = Unfinished(tmp.clone());
        layout.write(&file, &tmp)?;
        let numeric = layout
            .numeric()
            .into_iter()
            .map(|(name, shape)| {
                let ds = create_numeric(&file, name, layout.dtype, &shape, deflate)
                    .map_err(h5err(&tmp, name))?;
                Ok(Column {
                    name,
                    ds,
                    shape,
                    crc: crc32fast::Hasher::new(),
                })
            })
            .collect::<Result<Vec<_>, DataError>>()?;
        let strings = layout
            .strings()
            .into_iter()
            .map(|name| {
                let ds = file
                    .new_dataset::<VarLenUnicode>()
                    .chunk(256)
                    .shape(Extents::Simple(SimpleExtents::from_vec(vec![
                        Extent::resizable(0),
                    ])))
                    .create(name)
                    .map_err(h5err(&tmp, name))?;
                Ok(Column {
                    name,
                    ds,
                    shape: vec![],
                    crc: crc32fast::Hasher::new(),
                })
            })
            .collect::<Result<Vec<_>, DataError>>()?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp: guard,
            file,
            layout: layout.clone(),
            numeric,
            strings,
            rows: 0,
        })
    }

    /// Samples written so far.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// Whether no sample was written yet.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Append `sample`; fails naming the field whose size does not match the layout.
    pub fn append(&mut self, sample: &Sample) -> Result<(), DataError> {
        if sample.logvar.is_some() != self.layout.logvar
            || sample.caption.is_some() != self.layout.captions
            || sample.mask.is_some() != self.layout.mask
        {
            return Err(DataError::format(
                &self.tmp.0,
                format!(
                    "sample `{}`: log-variance/caption/loss-mask presence differs from the \
                     shard's layout",
                    sample.id
                ),
            ));
        }
        if let Some(bad) = sample
            .mask
            .iter()
            .flatten()
            .find(|v| !(0.0..=1.0).contains(*v))
        {
            return Err(DataError::format(
                &self.tmp.0,
                format!(
                    "sample `{}`: loss mask value {bad} is outside [0, 1]",
                    sample.id
                ),
            ));
        }
        let non_finite = self
            .layout
            .numeric()
            .into_iter()
            .zip(sample.numeric())
            .find_map(|((name, _), values)| {
                let bad = values.iter().filter(|v| !v.is_finite()).count();
                (bad > 0).then_some((name, bad))
            });
        if let Some((name, bad)) = non_finite {
            return Err(DataError::format(
                &self.tmp.0,
                format!(
                    "sample `{}`: `{name}` holds {bad} NaN or infinite value(s)",
                    sample.id
                ),
            ));
        }
        let row = self.rows;
        for (column, values) in self.numeric.iter_mut().zip(sample.numeric()) {
            let expected: usize = column.shape.iter().product();
            if values.len() != expected {
                return Err(DataError::format(
                    &self.tmp.0,
                    format!(
                        "sample `{}`: `{}` has {} values, the layout's {:?} needs {expected}",
                        sample.id,
                        column.name,
                        values.len(),
                        column.shape
                    ),
                ));
            }
            let encoded = Values::encode(self.layout.dtype, values);
            let shape: Vec<usize> = std::iter::once(row + 1)
                .chain(column.shape.iter().copied())
                .collect();
            column
                .ds
                .resize(shape)
                .and_then(|()| encoded.write_rows(&column.ds, row, &column.shape))
                .map_err(h5err(&self.tmp.0, column.name))?;
            column.crc.update(&encoded.le_bytes());
        }
        let texts = [Some(sample.id.as_str()), sample.caption.as_deref()];
        for (column, text) in self.strings.iter_mut().zip(texts.into_iter().flatten()) {
            let value: VarLenUnicode = text.parse().map_err(|_| {
                DataError::format(
                    &self.tmp.0,
                    format!("sample `{}`: text holds a NUL", sample.id),
                )
            })?;
            column
                .ds
                .resize([row + 1])
                .and_then(|()| {
                    column
                        .ds
                        .write_slice(ndarray::arr1(&[value]).view(), row..row + 1)
                })
                .map_err(h5err(&self.tmp.0, column.name))?;
            column.crc.update(text.as_bytes());
            column.crc.update(b"\n");
        }
        self.rows += 1;
        Ok(())
    }

    /// Record the sample count and CRC-32s, flush, fsync and rename into place. Returns the path.
    pub fn finish(self) -> Result<PathBuf, DataError> {
        let guard = self.tmp;
        let tmp = guard.0.clone();
        write_u64(&self.file, "num_samples", self.rows as u64, &tmp)?;
        for column in self.numeric.into_iter().chain(self.strings) {
            write_u64(&column.ds, "crc32", column.crc.finalize() as u64, &tmp)?;
        }
        self.file.flush().map_err(h5err(&tmp, "flush"))?;
        drop(self.file);
        fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io(&tmp))?;
        fs::rename(&tmp, &self.path).map_err(io(&self.path))?;
        std::mem::forget(guard);
        Ok(self.path)
    }
}

/// A shard's `.tmp` file while it is written: removed when dropped (forgotten once renamed).
struct Unfinished(PathBuf);

impl Drop for Unfinished {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}
