//! Fixed 2D sin-cos position embedding (DiT, MAE).

use tch::{Device, Kind, Tensor};

/// 1D sin-cos features of positions `pos [N]`: `[N, dim]` = `[sin(pos·ωᵢ) | cos(pos·ωᵢ)]` with
/// `ωᵢ = 10000^(−i/(dim/2))`.
fn sincos_1d(pos: &Tensor, dim: i64) -> Tensor {
    let half = dim / 2;
    let omega = (Tensor::arange(half, (Kind::Double, pos.device()))
        * (-(10_000f64.ln()) / half as f64))
        .exp();
    let args = pos.to_kind(Kind::Double).unsqueeze(1) * omega.unsqueeze(0);
    Tensor::cat(&[args.sin(), args.cos()], 1).to_kind(Kind::Float)
}

/// Position embedding of a `rows × cols` token grid: `[rows·cols, dim]` (f32), token `i·cols + j`;
/// the first half of the channels encodes the column `j`, the second half the row `i`.
pub fn sincos_2d(rows: i64, cols: i64, dim: i64, device: Device) -> Tensor {
    let opts = (Kind::Float, device);
    let r = Tensor::arange(rows, opts)
        .view([rows, 1])
        .expand([rows, cols], false)
        .reshape([-1]);
    let c = Tensor::arange(cols, opts)
        .view([1, cols])
        .expand([rows, cols], false)
        .reshape([-1]);
    Tensor::cat(&[sincos_1d(&c, dim / 2), sincos_1d(&r, dim / 2)], 1)
}
