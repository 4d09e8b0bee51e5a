//! Decoded images to PNG files, one image each or a grid of them.

use std::path::Path;

use image::RgbImage;
use tch::{Device, Kind, Tensor};

/// Image `i` of `images` (`[B, 3, H, W]`, about [-1, 1] as the autoencoder decodes) as 8-bit
/// RGB (values mapped to [0, 255], clamped, rounded).
pub fn to_rgb(images: &Tensor, i: i64) -> Result<RgbImage, String> {
    let (_, c, h, w) = images.size4().map_err(|e| e.to_string())?;
    if c != 3 {
        return Err(format!("{c} image channels, a PNG here takes 3 (RGB)"));
    }
    let pixels = ((images.get(i).to_kind(Kind::Float) + 1.0) * 127.5)
        .round()
        .clamp(0.0, 255.0)
        .permute([1, 2, 0])
        .to_kind(Kind::Uint8)
        .to_device(Device::Cpu)
        .contiguous();
    let bytes = Vec::<u8>::try_from(pixels.flatten(0, -1)).map_err(|e| e.to_string())?;
    RgbImage::from_raw(w as u32, h as u32, bytes)
        .ok_or_else(|| "pixel buffer does not fit the image size".to_string())
}

/// Write image `i` of `images` (as [`to_rgb`]) to `path` as a PNG.
pub fn write_png(images: &Tensor, i: i64, path: &Path) -> Result<(), String> {
    save_png(&to_rgb(images, i)?, path)
}

/// Save `image` to `path` as a PNG, through a temporary file and a rename.
pub fn save_png(image: &RgbImage, path: &Path) -> Result<(), String> {
    let tmp = path.with_extension("png.tmp");
    image
        .save_with_format(&tmp, image::ImageFormat::Png)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// `image` encoded as a PNG file's bytes.
pub fn png_bytes(image: &RgbImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    image
        .write_to(&mut out, image::ImageFormat::Png)
        .expect("PNG encoding into memory does not fail");
    out.into_inner()
}

/// Pixels of white between the cells of a [`grid`].
const GAP: u32 = 2;

/// `images` (`[N, 3, H, W]` as [`to_rgb`]) tiled row by row into a grid `columns` wide, the
/// cells separated by white lines [`GAP`] pixels wide.
pub fn grid(images: &Tensor, columns: usize) -> Result<RgbImage, String> {
    let (n, _, h, w) = images.size4().map_err(|e| e.to_string())?;
    let columns = columns.clamp(1, n.max(1) as usize) as u32;
    let rows = (n as u32).div_ceil(columns);
    let (h, w) = (h as u32, w as u32);
    let mut out = RgbImage::from_pixel(
        columns * (w + GAP) - GAP,
        rows * (h + GAP) - GAP,
        image::Rgb([255, 255, 255]),
    );
    for i in 0..n as u32 {
        let cell = to_rgb(images, i as i64)?;
        let (x, y) = ((i % columns) * (w + GAP), (i / columns) * (h + GAP));
        image::imageops::replace(&mut out, &cell, x as i64, y as i64);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_map_to_bytes_and_read_back() {
        let dir = std::env::temp_dir().join(format!("flux-png-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.png");
        // Red -1 → 0, green 0 → 127.5, rounded half to even: 128, blue 1 (and 2, clamped) → 255.
        let images = Tensor::from_slice(&[-1.0f32, -1.0, 0.0, 0.0, 1.0, 2.0]).view([1, 3, 1, 2]);
        write_png(&images, 0, &path).unwrap();
        let back = image::open(&path).unwrap().to_rgb8();
        assert_eq!(back.dimensions(), (2, 1));
        assert_eq!(back.get_pixel(0, 0).0, [0, 128, 255]);
        assert_eq!(back.get_pixel(1, 0).0, [0, 128, 255]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_grid_tiles_cells_row_by_row_between_white_lines() {
        // Three 1×2 images of one grey each, in two columns: 2 rows of 2×(2+2)−2 = 6 × 4 pixels.
        let levels = Tensor::from_slice(&[-1.0f32, 0.0, -0.5]).view([3, 1, 1, 1]);
        let images = levels.expand([3, 3, 1, 2], false);
        let g = grid(&images, 2).unwrap();
        assert_eq!(g.dimensions(), (6, 4));
        let at = |x, y| g.get_pixel(x, y).0[0];
        assert_eq!(
            [at(0, 0), at(1, 0), at(2, 0), at(4, 0), at(5, 0)],
            [0, 0, 255, 128, 128]
        );
        assert_eq!([at(0, 1), at(0, 3), at(1, 3), at(4, 3)], [255, 64, 64, 255]);
        let png = png_bytes(&g);
        let back = image::load_from_memory(&png).unwrap().to_rgb8();
        assert_eq!(back, g);
    }
}
