//! Aspect-ratio buckets: each image goes to the bucket whose aspect ratio is nearest its own
//! (in log ratio), is resized (bicubic) until it covers the bucket, and is center-cropped to it.

use std::fmt;
use std::str::FromStr;

use image::imageops::{self, FilterType};
use image::RgbImage;
use serde::{Deserialize, Serialize};

/// A training resolution in pixels; `WIDTHxHEIGHT` in configs and on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Bucket {
    /// Width, pixels.
    pub width: u32,
    /// Height, pixels.
    pub height: u32,
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&format!("{}x{}", self.width, self.height))
    }
}

impl FromStr for Bucket {
    type Err = String;

    /// `WIDTHxHEIGHT`, e.g. `1024x768`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (w, h) = s
            .split_once('x')
            .ok_or_else(|| format!("bucket `{s}` is not WIDTHxHEIGHT"))?;
        let side = |v: &str| {
            v.trim()
                .parse::<u32>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| format!("bucket `{s}`: `{v}` is not a positive number of pixels"))
        };
        Ok(Self {
            width: side(w)?,
            height: side(h)?,
        })
    }
}

impl TryFrom<String> for Bucket {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Bucket> for String {
    fn from(b: Bucket) -> String {
        b.to_string()
    }
}

/// The bucket of `buckets` nearest in aspect ratio to an image of `width × height` (ties: the
/// first listed).
pub fn nearest(buckets: &[Bucket], width: u32, height: u32) -> Bucket {
    let ratio = |w: u32, h: u32| (w as f64 / h as f64).ln();
    let own = ratio(width, height);
    *buckets
        .iter()
        .min_by(|a, b| {
            let da = (ratio(a.width, a.height) - own).abs();
            let db = (ratio(b.width, b.height) - own).abs();
            da.total_cmp(&db)
        })
        .expect("at least one bucket")
}

/// `image` scaled (bicubic, Catmull-Rom) to cover `bucket` and center-cropped to it.
pub fn fit(image: &RgbImage, bucket: Bucket) -> RgbImage {
    let (w, h) = image.dimensions();
    let scale = f64::max(
        bucket.width as f64 / w as f64,
        bucket.height as f64 / h as f64,
    );
    let (sw, sh) = (
        ((w as f64 * scale).round() as u32).max(bucket.width),
        ((h as f64 * scale).round() as u32).max(bucket.height),
    );
    let scaled = imageops::resize(image, sw, sh, FilterType::CatmullRom);
    let (x, y) = ((sw - bucket.width) / 2, (sh - bucket.height) / 2);
    imageops::crop_imm(&scaled, x, y, bucket.width, bucket.height).to_image()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_read_and_write_as_strings_in_configs() {
        let list: Vec<Bucket> = serde_json::from_str(r#"["1024x768", "512x512"]"#).unwrap();
        assert_eq!(
            list[0],
            Bucket {
                width: 1024,
                height: 768
            }
        );
        assert_eq!(
            serde_json::to_string(&list).unwrap(),
            r#"["1024x768","512x512"]"#
        );
        let bad = serde_json::from_str::<Vec<Bucket>>(r#"["1024*768"]"#).unwrap_err();
        assert!(bad.to_string().contains("not WIDTHxHEIGHT"), "{bad}");
    }

    #[test]
    fn buckets_parse_and_print() {
        let b: Bucket = "1024x768".parse().unwrap();
        assert_eq!((b.width, b.height), (1024, 768));
        assert_eq!(b.to_string(), "1024x768");
        assert!("1024".parse::<Bucket>().is_err());
        assert!("0x5".parse::<Bucket>().unwrap_err().contains("positive"));
    }

    #[test]
    fn the_nearest_aspect_ratio_wins() {
        let buckets: Vec<Bucket> = ["64x64", "96x64", "64x96"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(nearest(&buckets, 300, 310), buckets[0]);
        assert_eq!(nearest(&buckets, 1600, 900), buckets[1]);
        assert_eq!(nearest(&buckets, 20, 40), buckets[2]);
    }

    #[test]
    fn fitting_covers_then_crops_the_center() {
        // 40×20, left half black, right half white, fit to 16×16: the crop is the middle.
        let image = RgbImage::from_fn(40, 20, |x, _| {
            if x < 20 {
                image::Rgb([0, 0, 0])
            } else {
                image::Rgb([255, 255, 255])
            }
        });
        let fitted = fit(
            &image,
            Bucket {
                width: 16,
                height: 16,
            },
        );
        assert_eq!(fitted.dimensions(), (16, 16));
        assert_eq!(fitted.get_pixel(0, 8).0, [0, 0, 0]);
        assert_eq!(fitted.get_pixel(15, 8).0, [255, 255, 255]);
    }
}
