//! Building one latent shard from an ordered stream of sample files (a tar's entries, or a
//! directory's files): files of one key are consecutive, and each key becomes one sample.

use std::path::{Path, PathBuf};

use crate::dataset::{ShardLayout, ShardWriter};
use crate::error::DataError;
use crate::ingest::record::{split_key, LayoutChoice, Record};

/// What writing one shard produced.
#[derive(Debug, Clone)]
pub struct ShardSummary {
    /// Samples written.
    pub samples: u64,
    /// The shard's layout.
    pub layout: ShardLayout,
}

/// Receives files one by one and writes their samples; the shard's layout is inferred from the
/// first sample. Dropped unfinished, it leaves nothing behind (its writer removes its temporary
/// file).
pub struct ShardBuilder<'a> {
    out: PathBuf,
    source: String,
    choice: &'a LayoutChoice,
    deflate: Option<u8>,
    expected: Option<&'a ShardLayout>,
    writer: Option<(ShardWriter, ShardLayout)>,
    current: Option<(String, Record)>,
}

impl<'a> ShardBuilder<'a> {
    /// Build the shard `out`. `source` names the input in errors; `expected` is the layout earlier
    /// shards had (a shard that differs is refused).
    pub fn new(
        out: &Path,
        source: &str,
        choice: &'a LayoutChoice,
        deflate: Option<u8>,
        expected: Option<&'a ShardLayout>,
    ) -> Self {
        Self {
            out: out.to_path_buf(),
            source: source.to_string(),
            choice,
            deflate,
            expected,
            writer: None,
            current: None,
        }
    }

    fn fail(&self, message: String) -> DataError {
        DataError::Format {
            path: self.source.clone(),
            message,
        }
    }

    fn flush(&mut self) -> Result<(), DataError> {
        let Some((key, record)) = self.current.take() else {
            return Ok(());
        };
        let (sample, shapes) = record.finish(&key).map_err(|e| self.fail(e))?;
        if self.writer.is_none() {
            let layout = shapes
                .layout(&sample, self.choice)
                .map_err(|e| self.fail(e))?;
            // Shards may differ in latent size (each is one resolution bucket), not otherwise.
            if let Some(expected) = self.expected.filter(|e| !e.same_but_bucket(&layout)) {
                return Err(self.fail(format!(
                    "layout {layout:?} differs from earlier shards' {expected:?}"
                )));
            }
            let writer = ShardWriter::create(&self.out, &layout, self.deflate)?;
            self.writer = Some((writer, layout));
        }
        let (writer, layout) = self.writer.as_mut().expect("created above");
        if shapes.latent != layout.latent {
            let message = format!(
                "sample `{key}` has latents {:?}, the shard's bucket is {:?}: a shard holds one \
                 resolution bucket, so put each size's samples in their own tar or directory",
                shapes.latent, layout.latent
            );
            return Err(self.fail(message));
        }
        writer.append(&sample)
    }

    /// Add the file `name` (`{key}.{field}.{ext}`) with content `bytes`.
    pub fn add(&mut self, name: &str, bytes: &[u8]) -> Result<(), DataError> {
        let Some((key, rest)) = split_key(name) else {
            return Ok(());
        };
        if self.current.as_ref().is_none_or(|(k, _)| k != key) {
            self.flush()?;
            self.current = Some((key.to_string(), Record::default()));
        }
        let record = &mut self.current.as_mut().expect("set above").1;
        record.add(rest, bytes).map_err(|e| DataError::Format {
            path: self.source.clone(),
            message: format!("`{name}`: {e}"),
        })
    }

    /// Write the last sample and publish the shard.
    pub fn finish(mut self) -> Result<ShardSummary, DataError> {
        self.flush()?;
        let (writer, layout) = self
            .writer
            .take()
            .ok_or_else(|| self.fail("holds no samples".into()))?;
        let samples = writer.len() as u64;
        writer.finish()?;
        Ok(ShardSummary { samples, layout })
    }
}
