//! `WIDTHxHEIGHT` image resolutions and the token grid they become.

use std::str::FromStr;

use flux_model::{DiffusionBatch, InputSpec};
use tch::Device;

/// Pixels per token side: the VAE downsamples by 8 and the 2×2 packing halves again.
pub const PIXELS_PER_TOKEN: i64 = 16;

/// An image size in pixels, both sides multiples of 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolution {
    /// Pixels across.
    pub width: i64,
    /// Pixels down.
    pub height: i64,
}

impl Resolution {
    /// Token grid `(rows, cols)` of the packed latent.
    pub fn tokens(&self) -> (i64, i64) {
        (
            self.height / PIXELS_PER_TOKEN,
            self.width / PIXELS_PER_TOKEN,
        )
    }

    /// A random batch of `batch` samples at this resolution for a model taking `inputs`: latents
    /// covering the token grid (`tokens() · patch_size` latent pixels a side) and `text_len` text
    /// states, on `device` ([`DiffusionBatch::random`]).
    pub fn random_batch(
        &self,
        inputs: &InputSpec,
        batch: i64,
        text_len: i64,
        device: Device,
    ) -> DiffusionBatch {
        let (rows, cols) = self.tokens();
        let p = inputs.patch_size;
        DiffusionBatch::random(inputs, batch, rows * p, cols * p, text_len, device)
    }
}

impl FromStr for Resolution {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (w, h) = s.split_once('x').unwrap_or((s, s));
        let side = |v: &str| -> Result<i64, String> {
            let n: i64 = v
                .trim()
                .parse()
                .map_err(|_| format!("{v:?} is not a pixel count"))?;
            if n <= 0 || n % PIXELS_PER_TOKEN != 0 {
                return Err(format!(
                    "{n} is not a positive multiple of {PIXELS_PER_TOKEN} pixels"
                ));
            }
            Ok(n)
        };
        Ok(Self {
            width: side(w)?,
            height: side(h)?,
        })
    }
}

impl std::fmt::Display for Resolution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.width, self.height)
    }
}
