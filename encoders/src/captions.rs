//! Captions of an image folder: a sidecar `{stem}.txt` beside each image, or one file of
//! `{"file": …, "caption": …}` lines (JSONL) or `file,caption` rows (CSV, a header row allowed)
//! naming images by their path relative to the folder. An image without one gets the empty
//! caption. Captions are read strictly: a caption file that is not UTF-8 text, or is not a
//! regular file (a directory, a FIFO), is an error naming it, never an empty caption.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where captions come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Captions {
    /// `{stem}.txt` beside each image.
    Sidecar,
    /// A caption per image path relative to the folder.
    Listed(HashMap<String, String>),
}

impl Captions {
    /// Read a caption file (`.jsonl` or `.csv`); fails naming the file and line.
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = flux_data::files::read_to_string_limited(path, MAX_CAPTION_FILE_BYTES)
            .map_err(|e| e.to_string())?;
        let jsonl = path.extension().is_some_and(|e| e == "jsonl");
        let mut map = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: &str| format!("{}:{}: {why}", path.display(), n + 1);
            let (file, caption) = if jsonl {
                let v: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
                let field = |k: &str| {
                    v.get(k)
                        .and_then(|s| s.as_str())
                        .map(str::to_string)
                        .ok_or_else(|| bad(&format!("no string `{k}`")))
                };
                (field("file")?, field("caption")?)
            } else {
                let (file, caption) = line
                    .split_once(',')
                    .ok_or_else(|| bad("not `file,caption`"))?;
                if n == 0 && file.trim() == "file" {
                    continue;
                }
                let caption = caption.trim();
                let caption = caption
                    .strip_prefix('"')
                    .and_then(|c| c.strip_suffix('"'))
                    .map_or(caption.to_string(), |c| c.replace("\"\"", "\""));
                (file.trim().to_string(), caption)
            };
            map.insert(file, caption);
        }
        Ok(Self::Listed(map))
    }

    /// The caption of `image` (its path relative to the folder is `relative`): empty where it
    /// has none; an error naming the sidecar that cannot be read as text.
    pub fn of(&self, image: &Path, relative: &str) -> Result<String, String> {
        match self {
            Self::Sidecar => {
                let path = sidecar(image);
                if std::fs::symlink_metadata(&path).is_err() {
                    return Ok(String::new());
                }
                flux_data::files::read_to_string_limited(&path, MAX_SIDECAR_BYTES)
                    .map(|c| c.trim().to_string())
                    .map_err(|e| format!("caption {e}"))
            }
            Self::Listed(map) => Ok(map.get(relative).cloned().unwrap_or_default()),
        }
    }
}

/// The largest caption file (`.jsonl` / `.csv`) read.
const MAX_CAPTION_FILE_BYTES: u64 = 1 << 30;

/// The largest sidecar caption read (a caption is a few hundred bytes; T5 reads 512 tokens).
const MAX_SIDECAR_BYTES: u64 = 1 << 20;

fn sidecar(image: &Path) -> PathBuf {
    image.with_extension("txt")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_csv_and_sidecar_captions() {
        let dir = std::env::temp_dir().join(format!("flux-captions-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let jsonl = dir.join("c.jsonl");
        std::fs::write(&jsonl, "{\"file\": \"a.png\", \"caption\": \"a cat\"}\n\n").unwrap();
        let c = Captions::read(&jsonl).unwrap();
        assert_eq!(c.of(&dir.join("a.png"), "a.png").unwrap(), "a cat");
        assert_eq!(c.of(&dir.join("b.png"), "b.png").unwrap(), "");
        let csv = dir.join("c.csv");
        std::fs::write(&csv, "file,caption\nsub/b.jpg,\"a \"\"quoted\"\", dog\"\n").unwrap();
        let c = Captions::read(&csv).unwrap();
        assert_eq!(
            c.of(&dir.join("sub/b.jpg"), "sub/b.jpg").unwrap(),
            "a \"quoted\", dog"
        );
        std::fs::write(dir.join("bad.jsonl"), "{\"file\": 1}\n").unwrap();
        let err = Captions::read(&dir.join("bad.jsonl")).unwrap_err();
        assert!(err.contains("bad.jsonl:1: no string `file`"), "{err}");
        std::fs::write(dir.join("d.txt"), " a sidecar caption\n").unwrap();
        assert_eq!(
            Captions::Sidecar.of(&dir.join("d.png"), "d.png").unwrap(),
            "a sidecar caption"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn sidecars_that_are_not_text_files_are_errors_naming_them() {
        let dir = std::env::temp_dir().join(format!("flux-sidecars-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("dir.txt")).unwrap();
        std::fs::write(dir.join("latin1.txt"), b"caf\xe9").unwrap();
        let fifo = dir.join("fifo.txt");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()));
        let of = |name: &str| Captions::Sidecar.of(&dir.join(name), name);
        assert_eq!(of("none.png").unwrap(), "");
        let err = of("dir.png").unwrap_err();
        assert!(
            err.contains("dir.txt") && err.contains("a directory"),
            "{err}"
        );
        let err = of("latin1.png").unwrap_err();
        assert!(err.contains("latin1.txt"), "{err}");
        // Refused before it is opened: opening a FIFO would block.
        let err = of("fifo.png").unwrap_err();
        assert!(err.contains("FIFO"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
