//! Captions of an image folder: a sidecar `{stem}.txt` beside each image, or one file of
//! `{"file": …, "caption": …}` lines (JSONL) or `file,caption` rows (CSV, a header row allowed)
//! naming images by their path relative to the folder. An image without one gets the empty
//! caption.

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
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
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

    /// The caption of `image` (its path relative to the folder is `relative`).
    pub fn of(&self, image: &Path, relative: &str) -> String {
        match self {
            Self::Sidecar => std::fs::read_to_string(sidecar(image))
                .map(|c| c.trim().to_string())
                .unwrap_or_default(),
            Self::Listed(map) => map.get(relative).cloned().unwrap_or_default(),
        }
    }
}

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
        assert_eq!(c.of(&dir.join("a.png"), "a.png"), "a cat");
        assert_eq!(c.of(&dir.join("b.png"), "b.png"), "");
        let csv = dir.join("c.csv");
        std::fs::write(&csv, "file,caption\nsub/b.jpg,\"a \"\"quoted\"\", dog\"\n").unwrap();
        let c = Captions::read(&csv).unwrap();
        assert_eq!(
            c.of(&dir.join("sub/b.jpg"), "sub/b.jpg"),
            "a \"quoted\", dog"
        );
        std::fs::write(dir.join("bad.jsonl"), "{\"file\": 1}\n").unwrap();
        let err = Captions::read(&dir.join("bad.jsonl")).unwrap_err();
        assert!(err.contains("bad.jsonl:1: no string `file`"), "{err}");
        std::fs::write(dir.join("d.txt"), " a sidecar caption\n").unwrap();
        assert_eq!(
            Captions::Sidecar.of(&dir.join("d.png"), "d.png"),
            "a sidecar caption"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
