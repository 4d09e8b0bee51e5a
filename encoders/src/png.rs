//! Decoded images to PNG files.

use std::path::Path;

use tch::{Device, Kind, Tensor};

/// Write image `i` of `images` (`[B, 3, H, W]`, about [-1, 1] as the autoencoder decodes) to
/// `path` as an 8-bit RGB PNG (values mapped to [0, 255], clamped, rounded), through a temporary
/// file and a rename.
pub fn write_png(images: &Tensor, i: i64, path: &Path) -> Result<(), String> {
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
    let image = image::RgbImage::from_raw(w as u32, h as u32, bytes)
        .ok_or_else(|| "pixel buffer does not fit the image size".to_string())?;
    let tmp = path.with_extension("png.tmp");
    image
        .save_with_format(&tmp, image::ImageFormat::Png)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
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
}
