//! The image files of a folder, as `data encode` reads them: found once each (directory links
//! followed, never into a loop, and a file reached through two paths taken once), special files
//! (FIFOs, sockets, devices) skipped and listed rather than opened, and pixels turned upright as
//! their EXIF orientation says before anything measures them.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use flux_data::files::not_regular;
use image::{DynamicImage, ImageDecoder, ImageReader};

/// Image file extensions read (lower case).
pub const EXTENSIONS: [&str; 4] = ["jpg", "jpeg", "png", "webp"];

/// An image file and its path relative to the folder (`/`-separated).
pub type Image = (PathBuf, String);

/// What walking a folder found: the images in path order, and the files with an image
/// extension that were passed over (relative path, why).
#[derive(Debug, Default)]
pub struct Found {
    /// Images to read.
    pub images: Vec<Image>,
    /// Files passed over, with the reason.
    pub skipped: Vec<(String, String)>,
}

/// Every image under `dir`. Directory links are followed, but a directory (by device and inode)
/// is entered once, so a link back up the tree is no loop; a file reached again through another
/// path is listed as skipped; a special file is listed as skipped without being opened (a FIFO
/// would block the run forever).
pub fn find_images(dir: &Path) -> Result<Found, String> {
    let mut found = Found::default();
    let mut entered = HashSet::new();
    // Each image with its file's (device, inode), read once while walking.
    let mut walked = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let meta = fs::metadata(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        if !entered.insert((meta.dev(), meta.ino())) {
            continue;
        }
        for entry in fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let path = entry.map_err(|e| format!("{}: {e}", d.display()))?.path();
            let relative = path
                .strip_prefix(dir)
                .expect("found under dir")
                .to_string_lossy()
                .replace('\\', "/");
            // Following links: a dangling one is reported with the image it would be.
            let meta = fs::metadata(&path);
            if meta.as_ref().is_ok_and(|m| m.is_dir()) {
                pending.push(path);
                continue;
            }
            if !has_image_extension(&path) {
                continue;
            }
            let meta = match meta {
                Ok(meta) => meta,
                Err(e) => {
                    found.skipped.push((relative, format!("unreadable: {e}")));
                    continue;
                }
            };
            if let Some(kind) = not_regular(&meta) {
                found
                    .skipped
                    .push((relative, format!("is {kind}, not a regular file")));
                continue;
            }
            walked.push(((meta.dev(), meta.ino()), (path, relative)));
        }
    }
    walked.sort_by(|a, b| a.1 .1.cmp(&b.1 .1));
    // The first path in order keeps a file reached twice.
    let mut seen_files: HashMap<(u64, u64), String> = HashMap::new();
    for (file, (path, relative)) in walked {
        match seen_files.get(&file) {
            Some(first) => found
                .skipped
                .push((relative, format!("is the same file as {first} (a link)"))),
            None => {
                seen_files.insert(file, relative.clone());
                found.images.push((path, relative));
            }
        }
    }
    found.skipped.sort();
    Ok(found)
}

fn has_image_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

/// The upright size `(width, height)` of the image at `path`: its stored size, with the sides
/// swapped where its EXIF orientation turns it a quarter (a portrait phone photo stored
/// landscape). Reads the header only.
pub fn upright_dimensions(path: &Path) -> Result<(u32, u32), String> {
    let mut decoder = decoder(path)?;
    let (w, h) = decoder.dimensions();
    let orientation = decoder.orientation().map_err(|e| e.to_string())?;
    Ok(match quarter_turned(orientation) {
        true => (h, w),
        false => (w, h),
    })
}

/// The image at `path`, decoded and turned upright as its EXIF orientation says.
pub fn open_upright(path: &Path) -> Result<DynamicImage, String> {
    let mut decoder = decoder(path)?;
    let orientation = decoder.orientation().map_err(|e| e.to_string())?;
    let mut image = DynamicImage::from_decoder(decoder).map_err(|e| e.to_string())?;
    image.apply_orientation(orientation);
    Ok(image)
}

fn decoder(path: &Path) -> Result<impl ImageDecoder, String> {
    ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(|e| e.to_string())?
        .into_decoder()
        .map_err(|e| e.to_string())
}

/// Whether `orientation` turns the image by a quarter (its width becomes its height).
fn quarter_turned(orientation: image::metadata::Orientation) -> bool {
    use image::metadata::Orientation::*;
    matches!(
        orientation,
        Rotate90 | Rotate270 | Rotate90FlipH | Rotate270FlipH
    )
}
