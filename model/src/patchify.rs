//! Latent grid ⇄ token sequence: fold `p × p` patches of a `[B, C, H, W]` latent into tokens.

use tch::Tensor;

/// `[B, C, H, W]` → `[B, (H/p)·(W/p), C·p²]`, token `i·(W/p) + j` holding patch `(i, j)` with
/// features ordered `(c, ph, pw)` (the packing FLUX.1's pipelines apply to 16-channel latents).
pub fn patchify(img: &Tensor, p: i64) -> Tensor {
    let (b, c, h, w) = img.size4().expect("patchify needs [B, C, H, W]");
    img.view([b, c, h / p, p, w / p, p])
        .permute([0, 2, 4, 1, 3, 5])
        .reshape([b, (h / p) * (w / p), c * p * p])
}

/// Inverse of [`patchify`]: `[B, rows·cols, C·p²]` → `[B, C, rows·p, cols·p]`.
pub fn unpatchify(tokens: &Tensor, p: i64, rows: i64, cols: i64) -> Tensor {
    let (b, _, width) = tokens.size3().expect("unpatchify needs [B, L, C·p²]");
    let c = width / (p * p);
    tokens
        .view([b, rows, cols, c, p, p])
        .permute([0, 3, 1, 4, 2, 5])
        .reshape([b, c, rows * p, cols * p])
}
