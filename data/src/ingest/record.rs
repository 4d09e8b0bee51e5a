//! Assembling one sample from the files that carry it, named WebDataset-style
//! `{key}.{field}.{ext}`: `mean`/`latents`, `logvar`, `t5`, `clip` and an optional `mask` (loss
//! weights `[H, W]` over the latent grid) as `.bytes` or `.npy` (npy content), `txt`/`caption.txt` as UTF-8 text, or one `{key}.safetensors` holding the fields as
//! named tensors. Other files (json, jpg, …) are ignored.

use crate::convert::decode_in_memory;
use crate::dataset::{Sample, ShardLayout, StorageDtype};
use crate::ingest::npy::{parse_npy, NpyArray};
use crate::vae::VaeNorm;

/// The fields of one sample found so far.
#[derive(Debug, Default)]
pub struct Record {
    latents: Option<NpyArray>,
    logvar: Option<NpyArray>,
    t5: Option<NpyArray>,
    clip: Option<NpyArray>,
    mask: Option<NpyArray>,
    caption: Option<String>,
}

/// Split a file name into `(key, rest)` at the first dot of its base name (WebDataset's rule).
pub fn split_key(name: &str) -> Option<(&str, &str)> {
    let base = name.rsplit('/').next()?;
    let dot = base.find('.')?;
    let key_len = name.len() - base.len() + dot;
    Some((&name[..key_len], &name[key_len + 1..]))
}

fn slot<'a>(record: &'a mut Record, field: &str) -> Option<&'a mut Option<NpyArray>> {
    match field {
        "mean" | "latents" | "latent" => Some(&mut record.latents),
        "logvar" => Some(&mut record.logvar),
        "t5" => Some(&mut record.t5),
        "clip" => Some(&mut record.clip),
        "mask" => Some(&mut record.mask),
        _ => None,
    }
}

impl Record {
    /// Add the file `rest` (`field.ext` after the key) with content `bytes`.
    pub fn add(&mut self, rest: &str, bytes: &[u8]) -> Result<(), String> {
        let (field, ext) = rest.rsplit_once('.').unwrap_or(("", rest));
        match ext {
            "bytes" | "npy" => {
                if let Some(slot) = slot(self, field) {
                    *slot = Some(parse_npy(bytes).map_err(|e| format!("`{rest}`: {e}"))?);
                }
            }
            "txt" if matches!(field, "" | "caption") => {
                let text = String::from_utf8(bytes.to_vec())
                    .map_err(|_| format!("`{rest}` is not UTF-8"))?;
                self.caption = Some(text.trim_end().to_string());
            }
            "safetensors" => {
                let tensors = decode_in_memory(bytes).map_err(|e| format!("`{rest}`: {e}"))?;
                for (name, shape, values) in tensors {
                    if let Some(slot) = slot(self, &name) {
                        *slot = Some(NpyArray { shape, values });
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The finished sample `key`; fails naming a missing field.
    pub fn finish(self, key: &str) -> Result<(Sample, Shapes), String> {
        let need = |a: Option<NpyArray>, what: &str| {
            a.ok_or_else(|| format!("sample `{key}` has no `{what}` field"))
        };
        let latents = need(self.latents, "mean (or latents)")?;
        let t5 = need(self.t5, "t5")?;
        let clip = need(self.clip, "clip")?;
        let shapes = Shapes {
            latent: squeeze(&latents.shape),
            text: squeeze(&t5.shape),
            pooled: squeeze(&clip.shape),
        };
        if let Some(lv) = &self.logvar {
            if squeeze(&lv.shape) != shapes.latent {
                return Err(format!(
                    "sample `{key}`: logvar shape {:?} differs from mean {:?}",
                    lv.shape, latents.shape
                ));
            }
        }
        if let Some(mask) = &self.mask {
            if squeeze(&mask.shape) != shapes.latent[shapes.latent.len().saturating_sub(2)..] {
                return Err(format!(
                    "sample `{key}`: mask shape {:?} is not the latent grid [H, W] of {:?}",
                    mask.shape, latents.shape
                ));
            }
        }
        let sample = Sample {
            id: key.rsplit('/').next().unwrap_or(key).to_string(),
            latents: latents.values,
            logvar: self.logvar.map(|a| a.values),
            t5: t5.values,
            clip: clip.values,
            caption: self.caption,
            mask: self.mask.map(|a| a.values),
        };
        Ok((sample, shapes))
    }
}

/// Shapes of one sample's fields with leading size-1 dimensions dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shapes {
    /// Latent shape (3-D for a valid sample).
    pub latent: Vec<usize>,
    /// Text states shape (2-D).
    pub text: Vec<usize>,
    /// Pooled shape (1-D).
    pub pooled: Vec<usize>,
}

fn squeeze(shape: &[usize]) -> Vec<usize> {
    let first = shape.iter().position(|&d| d != 1).unwrap_or(shape.len());
    shape[first..].to_vec()
}

/// What an ingest writes besides the samples.
#[derive(Debug, Clone)]
pub struct LayoutChoice {
    /// Storage type.
    pub dtype: StorageDtype,
    /// Latent normalisation recorded in the shards.
    pub norm: VaeNorm,
    /// Encoder names: VAE, text, pooled.
    pub encoders: [String; 3],
}

impl Shapes {
    /// The shard layout of samples with these shapes (fails unless latent is 3-D, text 2-D and
    /// pooled 1-D).
    pub fn layout(&self, sample: &Sample, choice: &LayoutChoice) -> Result<ShardLayout, String> {
        match (self.latent.as_slice(), self.text.as_slice(), self.pooled.as_slice()) {
            (&[c, h, w], &[s, d], &[p]) => Ok(ShardLayout {
                latent: [c, h, w],
                text: [s, d],
                pooled: p,
                dtype: choice.dtype,
                logvar: sample.logvar.is_some(),
                captions: sample.caption.is_some(),
                mask: sample.mask.is_some(),
                norm: choice.norm,
                encoders: choice.encoders.clone(),
            }),
            _ => Err(format!(
                "sample `{}`: shapes latent {:?}, t5 {:?}, clip {:?} are not [C, H, W], [S, D], [D]",
                sample.id, self.latent, self.text, self.pooled
            )),
        }
    }
}
