//! What a shard holds: per-sample shapes, storage type, encoder names and latent normalisation.
//! The same description is written as attributes by [`super::ShardWriter`] and read back by
//! [`super::LatentDataset`], which insists that every shard of a dataset agrees on all of it but
//! the latent height and width: a shard's latent size is its resolution bucket.

use std::path::Path;

use crate::dataset::values::StorageDtype;
use crate::error::DataError;
use crate::h5attr::{read_i64s, read_str, read_u64, read_u64_or, write_i64s, write_str, write_u64};
use crate::vae::VaeNorm;

/// Version written to every shard; readers refuse others.
pub const FORMAT_VERSION: u64 = 1;

/// Clean latents (or the VAE posterior mean when `latents_logvar` is present), `[N, C, H, W]`.
pub const LATENTS: &str = "latents";
/// VAE posterior log-variance, `[N, C, H, W]` (optional).
pub const LATENTS_LOGVAR: &str = "latents_logvar";
/// Text-encoder (T5) hidden states, `[N, S, D_text]`.
pub const T5: &str = "t5";
/// Pooled text embedding (CLIP), `[N, D_pooled]`.
pub const CLIP: &str = "clip";
/// Per-sample loss weights over the latent grid, `[N, H, W]` in `[0, 1]` (optional).
pub const LOSS_MASK: &str = "loss_mask";
/// Sample keys, `[N]` UTF-8 strings.
pub const IDS: &str = "ids";
/// Captions, `[N]` UTF-8 strings (optional).
pub const CAPTIONS: &str = "captions";

/// The file beside a dataset's shards holding the empty caption's encodings (`t5` `[L, D]`,
/// `clip` `[D_pooled]`), which classifier-free-guidance dropout swaps in.
pub const EMPTY_PROMPT: &str = "empty_prompt.safetensors";

/// The per-sample layout of a dataset's shards.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardLayout {
    /// Latent `[C, H, W]` of one sample; `[H, W]` is the shard's resolution bucket.
    pub latent: [usize; 3],
    /// Text states `[S, D_text]` of one sample.
    pub text: [usize; 2],
    /// Pooled embedding width `D_pooled`.
    pub pooled: usize,
    /// Storage type of the numeric datasets.
    pub dtype: StorageDtype,
    /// Whether shards hold `latents_logvar` (latents are then drawn from the posterior per step).
    pub logvar: bool,
    /// Whether shards hold captions.
    pub captions: bool,
    /// Whether shards hold a `loss_mask` `[H, W]` per sample.
    pub mask: bool,
    /// How latents are normalised before training: `scale · (z − shift)` (1 and 0 when the
    /// stored latents are already normalised).
    pub norm: VaeNorm,
    /// Names of the encoders that produced the data: `vae`, `text`, `pooled`.
    pub encoders: [String; 3],
}

impl ShardLayout {
    /// The numeric datasets and their per-sample shapes, in file order.
    pub fn numeric(&self) -> Vec<(&'static str, Vec<usize>)> {
        let mut out = vec![(LATENTS, self.latent.to_vec())];
        if self.logvar {
            out.push((LATENTS_LOGVAR, self.latent.to_vec()));
        }
        out.push((T5, self.text.to_vec()));
        out.push((CLIP, vec![self.pooled]));
        if self.mask {
            out.push((LOSS_MASK, self.latent[1..].to_vec()));
        }
        out
    }

    /// The resolution bucket `[H, W]` (latent pixels).
    pub fn bucket(&self) -> [usize; 2] {
        [self.latent[1], self.latent[2]]
    }

    /// Whether `other` describes the same data at another (or the same) resolution bucket:
    /// everything but the latent height and width agrees.
    pub fn same_but_bucket(&self, other: &Self) -> bool {
        let mut resized = other.clone();
        resized.latent[1..].copy_from_slice(&self.latent[1..]);
        *self == resized
    }

    /// The string datasets, in file order.
    pub fn strings(&self) -> Vec<&'static str> {
        if self.captions {
            vec![IDS, CAPTIONS]
        } else {
            vec![IDS]
        }
    }

    /// Write the layout as root attributes of `file`.
    pub(crate) fn write(&self, file: &hdf5::File, path: &Path) -> Result<(), DataError> {
        write_u64(file, "format_version", FORMAT_VERSION, path)?;
        write_str(file, "dtype", self.dtype.name(), path)?;
        let dims = |v: &[usize]| v.iter().map(|&d| d as i64).collect::<Vec<_>>();
        write_i64s(file, "latent_shape", &dims(&self.latent), path)?;
        write_i64s(file, "text_shape", &dims(&self.text), path)?;
        write_u64(file, "pooled_dim", self.pooled as u64, path)?;
        write_u64(file, "has_logvar", self.logvar as u64, path)?;
        write_u64(file, "has_captions", self.captions as u64, path)?;
        write_u64(file, "has_loss_mask", self.mask as u64, path)?;
        let norm = [self.norm.scaling_factor, self.norm.shift_factor];
        file.new_attr::<f64>()
            .shape([2])
            .create("latent_scale_shift")
            .and_then(|a| a.write_raw(&norm))
            .map_err(crate::h5attr::h5err(path, "latent_scale_shift"))?;
        for (key, name) in ["vae_encoder", "text_encoder", "pooled_encoder"]
            .iter()
            .zip(&self.encoders)
        {
            write_str(file, key, name, path)?;
        }
        Ok(())
    }

    /// Read the layout from `file`'s root attributes; a wrong version, a missing attribute or an
    /// impossible shape is an error naming the file.
    pub(crate) fn read(file: &hdf5::File, path: &Path) -> Result<Self, DataError> {
        let version = read_u64(file, "format_version", path)?;
        if version != FORMAT_VERSION {
            return Err(DataError::format(
                path,
                format!("latent shard format version {version}, this build reads {FORMAT_VERSION}"),
            ));
        }
        let dtype = read_str(file, "dtype", path)?
            .parse()
            .map_err(|e: String| DataError::format(path, format!("attribute `dtype`: {e}")))?;
        let dims = |name: &str, n: usize| -> Result<Vec<usize>, DataError> {
            let v = read_i64s(file, name, path)?;
            if v.len() != n || v.iter().any(|&d| d <= 0 || d > 1 << 24) {
                return Err(DataError::format(
                    path,
                    format!("attribute `{name}` must hold {n} positive sizes, got {v:?}"),
                ));
            }
            Ok(v.into_iter().map(|d| d as usize).collect())
        };
        let latent = dims("latent_shape", 3)?;
        let text = dims("text_shape", 2)?;
        let pooled = read_u64(file, "pooled_dim", path)? as usize;
        if pooled == 0 || pooled > 1 << 24 {
            return Err(DataError::format(
                path,
                format!("attribute `pooled_dim` must be positive, got {pooled}"),
            ));
        }
        let norm = file
            .attr("latent_scale_shift")
            .and_then(|a| a.read_raw::<f64>())
            .map_err(crate::h5attr::h5err(path, "latent_scale_shift"))?;
        if norm.len() != 2 || !norm.iter().all(|v| v.is_finite()) || norm[0] == 0.0 {
            return Err(DataError::format(
                path,
                format!("attribute `latent_scale_shift` must be [scale ≠ 0, shift], got {norm:?}"),
            ));
        }
        Ok(Self {
            latent: [latent[0], latent[1], latent[2]],
            text: [text[0], text[1]],
            pooled,
            dtype,
            logvar: read_u64(file, "has_logvar", path)? != 0,
            captions: read_u64(file, "has_captions", path)? != 0,
            // Shards written before masks existed have no attribute and no mask.
            mask: read_u64_or(file, "has_loss_mask", 0, path)? != 0,
            norm: VaeNorm {
                scaling_factor: norm[0],
                shift_factor: norm[1],
            },
            encoders: [
                read_str(file, "vae_encoder", path)?,
                read_str(file, "text_encoder", path)?,
                read_str(file, "pooled_encoder", path)?,
            ],
        })
    }
}
