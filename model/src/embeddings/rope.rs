//! `EmbedND`: multi-axis rotary position embedding (3D RoPE) and image/text position ids.

use tch::{Device, Kind, Tensor};

/// Position ids of the image tokens for a latent of `height × width` before 2×2 packing:
/// `[B, (height/2)·(width/2), 3]` f32, row `i·(width/2) + j` = `(0, i, j)`.
///
/// This is the convention of the reference pipelines: a 1024² image has a 128² VAE latent, packed
/// to 64² tokens, so `generate_image_position_ids(B, 128, 128)` gives 4096 ids.
pub fn generate_image_position_ids(batch: i64, height: i64, width: i64, device: Device) -> Tensor {
    token_grid_ids(batch, height / 2, width / 2, device)
}

/// Position ids of a `rows × cols` token grid: `[B, rows·cols, 3]` f32 with `(0, i, j)` per token.
pub fn token_grid_ids(batch: i64, rows: i64, cols: i64, device: Device) -> Tensor {
    let opts = (Kind::Float, device);
    let r = Tensor::arange(rows, opts)
        .view([rows, 1])
        .expand([rows, cols], false);
    let c = Tensor::arange(cols, opts)
        .view([1, cols])
        .expand([rows, cols], false);
    let ids =
        Tensor::stack(&[Tensor::zeros([rows, cols], opts), r, c], -1).view([1, rows * cols, 3]);
    ids.expand([batch, rows * cols, 3], false).contiguous()
}

/// Text position ids: all zeros, `[B, S, 3]` f32.
pub fn text_position_ids(batch: i64, len: i64, device: Device) -> Tensor {
    Tensor::zeros([batch, len, 3], (Kind::Float, device))
}

/// The rotation for one sequence: `cos`, `sin` each `[B, 1, L, Dh/2]` (f32, broadcast over heads).
#[derive(Debug)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

impl Clone for Rope {
    /// Shares the tables (no copy).
    fn clone(&self) -> Self {
        Self {
            cos: self.cos.shallow_clone(),
            sin: self.sin.shallow_clone(),
            interleaved: self.interleaved,
        }
    }
}

impl Rope {
    /// The `cos` and `sin` tables.
    pub fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// The same rotation over other `cos` and `sin` tables of the same shape.
    pub fn with_tables(&self, cos: Tensor, sin: Tensor) -> Rope {
        Rope {
            cos,
            sin,
            interleaved: self.interleaved,
        }
    }

    /// Rotate `x [B, H, L, Dh]`. Interleaved: each pair `(x₂ᵢ, x₂ᵢ₊₁)` turns by angle `θᵢ`; otherwise
    /// the pairs are `(xᵢ, xᵢ₊Dh/2)`. Computed in f32, returned in `x`'s dtype.
    pub fn apply(&self, x: &Tensor) -> Tensor {
        let size = x.size();
        let xf = x.to_kind(Kind::Float);
        let half = size[3] / 2;
        let rotated = if self.interleaved {
            let pairs = xf.view([size[0], size[1], size[2], half, 2]);
            let (a, b) = (pairs.select(-1, 0), pairs.select(-1, 1));
            let ra = &a * &self.cos - &b * &self.sin;
            let rb = a * &self.sin + b * &self.cos;
            Tensor::stack(&[ra, rb], -1).view(size.as_slice())
        } else {
            let (a, b) = (xf.narrow(-1, 0, half), xf.narrow(-1, half, half));
            let ra = &a * &self.cos - &b * &self.sin;
            let rb = a * &self.sin + b * &self.cos;
            Tensor::cat(&[ra, rb], -1)
        };
        rotated.to_kind(x.kind())
    }
}

/// `EmbedND`: per-axis RoPE frequencies `θ^(-2k/d_axis)` concatenated over the axes.
#[derive(Debug, Clone)]
pub struct EmbedNd {
    theta: f64,
    axes_dim: Vec<i64>,
    interleaved: bool,
}

impl EmbedNd {
    /// Frequencies for axes of widths `axes_dim` (summing to the head width) and base `theta`.
    pub fn new(theta: f64, axes_dim: &[i64], interleaved: bool) -> Self {
        Self {
            theta,
            axes_dim: axes_dim.to_vec(),
            interleaved,
        }
    }

    /// `ids [B, L, n_axes]` → the rotation for those positions (`Dh/2` angles per token).
    pub fn forward(&self, ids: &Tensor) -> Rope {
        // Angles in f64 (positions times tiny frequencies lose digits in f32), rotation in f32.
        let ids = ids.to_kind(Kind::Double);
        let angles: Vec<Tensor> = self
            .axes_dim
            .iter()
            .enumerate()
            .map(|(axis, &dim)| {
                let exponents =
                    Tensor::arange_start_step(0, dim, 2, (Kind::Double, ids.device())) / dim as f64;
                let omega = (exponents * -self.theta.ln()).exp();
                ids.select(-1, axis as i64).unsqueeze(-1) * omega
            })
            .collect();
        let angles = Tensor::cat(&angles, -1).unsqueeze(1);
        Rope {
            cos: angles.cos().to_kind(Kind::Float),
            sin: angles.sin().to_kind(Kind::Float),
            interleaved: self.interleaved,
        }
    }
}
