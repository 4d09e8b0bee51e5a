//! What each finished shard of an output directory was made from (`sources.jsonl`): per shard,
//! the inputs it holds, each with its key (a tar's path, a sample's key, an image's path relative
//! to its folder), its size and its CRC-32. A rerun of `data ingest` or `data encode` into the
//! same directory decides from this record, by content, what is already there: an input whose
//! bytes were recorded is done wherever it now lies; a new input is added; an input that changed
//! since it was written is refused by name. Nothing is skipped because of a name alone, and
//! nothing is written twice.
//!
//! One JSON object a line, `{"shard": "a.h5", "sources": [{"key": …, "bytes": …, "crc32": …}]}`,
//! appended and synced just before each shard is published (a line cut short by a crash is
//! dropped when the record is next read, its shard never having appeared). A shard that exists
//! without a line (a directory written before this record) is opened and its sample ids are taken
//! as its keys, so its samples are neither redone nor duplicated.

use std::collections::btree_map::{BTreeMap, Entry};
use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{io, DataError};
use crate::files;

/// The record's file name in an output directory.
pub const SOURCES_FILE: &str = "sources.jsonl";

/// The largest record read.
const MAX_SOURCES_BYTES: u64 = 1 << 30;

/// One input as written into a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// What names the input: a tar's path, a sample's key, an image's relative path.
    pub key: String,
    /// Its size in bytes (all its files together); `None` when unknown (a shard found without
    /// a record).
    pub bytes: Option<u64>,
    /// The CRC-32 of its bytes (its files in the order given); `None` when unknown.
    pub crc32: Option<u32>,
}

impl Source {
    /// `key` with the size and CRC-32 of the regular files `paths`, read in that order.
    pub fn of_files(key: &str, paths: &[PathBuf]) -> Result<Self, DataError> {
        let mut crc = crc32fast::Hasher::new();
        let mut bytes = 0u64;
        let mut buffer = vec![0u8; 1 << 20];
        for path in paths {
            let mut file = files::open_regular(path)?;
            loop {
                let n = file.read(&mut buffer).map_err(io(path))?;
                if n == 0 {
                    break;
                }
                crc.update(&buffer[..n]);
                bytes += n as u64;
            }
        }
        Ok(Self {
            key: key.to_string(),
            bytes: Some(bytes),
            crc32: Some(crc.finalize()),
        })
    }

    /// Whether `self` and `other` hold the same bytes (unknown counts as the same).
    fn same_content(&self, other: &Self) -> bool {
        let same = |a: Option<u64>, b: Option<u64>| a.zip(b).is_none_or(|(a, b)| a == b);
        same(self.bytes, other.bytes) && same(self.crc32.map(u64::from), other.crc32.map(u64::from))
    }

    fn describe(&self) -> String {
        match (self.bytes, self.crc32) {
            (Some(b), Some(c)) => format!("{b} bytes, CRC-32 {c:08x}"),
            _ => "size and checksum unknown".to_string(),
        }
    }
}

/// How an input stands against the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// Not written yet.
    New,
    /// Already in this shard (by its bytes, under this key or another).
    Done(String),
}

#[derive(Serialize, Deserialize)]
struct Line {
    shard: String,
    sources: Vec<Source>,
}

/// The record of an output directory, indexed by key and by content so that each input is
/// placed in constant time however many inputs the directory holds.
#[derive(Debug)]
pub struct Sources {
    out_dir: PathBuf,
    /// Shard file name → its inputs.
    shards: BTreeMap<String, Vec<Source>>,
    /// Key → the shard holding it and its record there.
    by_key: HashMap<String, (String, Source)>,
    /// (bytes, CRC-32) → a shard holding inputs of that content.
    by_content: HashMap<(u64, u32), String>,
}

impl Sources {
    /// Read `out_dir`'s record. Lines of shards that no longer exist are dropped (their inputs
    /// are written again), as is a last line cut short by a crash (its shard was never
    /// published); shards that exist without a line are recorded from their sample ids
    /// (`ids_of(path)`), with size and checksum unknown. The record is compacted when anything
    /// was dropped or added.
    pub fn open(
        out_dir: &Path,
        ids_of: impl Fn(&Path) -> Result<Vec<String>, DataError>,
    ) -> Result<Self, DataError> {
        let path = out_dir.join(SOURCES_FILE);
        let mut shards = BTreeMap::new();
        let mut changed = false;
        if path.exists() {
            let text = files::read_to_string_limited(&path, MAX_SOURCES_BYTES)?;
            let lines: Vec<&str> = text.split_inclusive('\n').collect();
            for (n, line) in lines.iter().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let cut_short = n + 1 == lines.len() && !line.ends_with('\n');
                let line: Line = match serde_json::from_str(line) {
                    Ok(line) => line,
                    Err(_) if cut_short => {
                        changed = true;
                        continue;
                    }
                    Err(e) => return Err(DataError::format(&path, format!("line {}: {e}", n + 1))),
                };
                match out_dir.join(&line.shard).is_file() {
                    true => {
                        shards.insert(line.shard, line.sources);
                    }
                    false => changed = true,
                }
            }
        }
        for shard in shard_names(out_dir)? {
            if let Entry::Vacant(entry) = shards.entry(shard) {
                let keys = ids_of(&out_dir.join(entry.key()))?;
                let unknown = |key: String| Source {
                    key,
                    bytes: None,
                    crc32: None,
                };
                entry.insert(keys.into_iter().map(unknown).collect());
                changed = true;
            }
        }
        let mut sources = Self {
            out_dir: out_dir.to_path_buf(),
            shards: BTreeMap::new(),
            by_key: HashMap::new(),
            by_content: HashMap::new(),
        };
        for (shard, inputs) in shards {
            sources.index(&shard, &inputs);
            sources.shards.insert(shard, inputs);
        }
        if changed {
            sources.compact()?;
        }
        Ok(sources)
    }

    /// Add `inputs` of `shard` to the indexes.
    fn index(&mut self, shard: &str, inputs: &[Source]) {
        for input in inputs {
            self.by_key
                .insert(input.key.clone(), (shard.to_string(), input.clone()));
            if let (Some(bytes), Some(crc)) = (input.bytes, input.crc32) {
                self.by_content.insert((bytes, crc), shard.to_string());
            }
        }
    }

    /// Where `source` stands: done (the shard holding the same bytes, or the same key with
    /// unknown bytes) or new. An input whose key is recorded with other bytes changed since it
    /// was written, or another input has its name: an error naming it (`shown`), the shard and
    /// both sizes and checksums.
    pub fn standing(&self, source: &Source, shown: &str) -> Result<Standing, DataError> {
        if let (Some(bytes), Some(crc)) = (source.bytes, source.crc32) {
            if let Some(shard) = self.by_content.get(&(bytes, crc)) {
                return Ok(Standing::Done(shard.clone()));
            }
        }
        match self.by_key.get(&source.key) {
            None => Ok(Standing::New),
            Some((shard, recorded)) if recorded.same_content(source) => {
                Ok(Standing::Done(shard.clone()))
            }
            Some((shard, recorded)) => Err(DataError::Format {
                path: shown.to_string(),
                message: format!(
                    "`{}` is already written into {} with other bytes ({} there, {} here): it \
                     changed since, or another input has its name; delete that shard to write \
                     it again, or give this input another name",
                    source.key,
                    self.out_dir.join(shard).display(),
                    recorded.describe(),
                    source.describe()
                ),
            }),
        }
    }

    /// The inputs recorded for shard `name`.
    pub fn of_shard(&self, name: &str) -> Option<&[Source]> {
        self.shards.get(name).map(Vec::as_slice)
    }

    /// The next free index of shards named `{prefix}{index}.h5` (0 when there is none).
    pub fn next_index(&self, prefix: &str) -> usize {
        self.shards
            .keys()
            .filter_map(|s| {
                s.strip_prefix(prefix)?
                    .strip_suffix(".h5")?
                    .parse::<usize>()
                    .ok()
            })
            .map(|i| i + 1)
            .max()
            .unwrap_or(0)
    }

    /// Record that shard `name` holds `inputs`: one line appended and synced. Call it just
    /// before the shard is published: a line whose shard never appeared is dropped when the
    /// record is next opened, and a published shard always has its line.
    pub fn record(&mut self, name: &str, inputs: Vec<Source>) -> Result<(), DataError> {
        let path = self.out_dir.join(SOURCES_FILE);
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io(&path))?;
        let line = line_of(name, &inputs);
        file.write_all(line.as_bytes())
            .and_then(|()| file.sync_data())
            .map_err(io(&path))?;
        self.index(name, &inputs);
        self.shards.insert(name.to_string(), inputs);
        Ok(())
    }

    /// Rewrite the record atomically with exactly the shards held.
    fn compact(&self) -> Result<(), DataError> {
        files::write_atomic(&self.out_dir.join(SOURCES_FILE), |w| {
            for (shard, sources) in &self.shards {
                w.write_all(line_of(shard, sources).as_bytes())?;
            }
            Ok(())
        })
    }
}

/// The record's line of `shard` holding `sources`, with its newline.
fn line_of(shard: &str, sources: &[Source]) -> String {
    let line = Line {
        shard: shard.to_string(),
        sources: sources.to_vec(),
    };
    let mut text = serde_json::to_string(&line).expect("plain values serialise");
    text.push('\n');
    text
}

/// The shard files (`*.h5`) directly in `dir`, by name.
fn shard_names(dir: &Path) -> Result<Vec<String>, DataError> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".h5"))
        .collect();
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("flux-sources-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn no_ids(_: &Path) -> Result<Vec<String>, DataError> {
        Ok(Vec::new())
    }

    #[test]
    fn inputs_are_known_by_their_bytes_and_changes_are_refused() {
        let d = dir("bytes");
        let input = d.join("a.bin");
        std::fs::write(&input, b"first").unwrap();
        let a = Source::of_files("in/a.bin", std::slice::from_ref(&input)).unwrap();
        std::fs::write(d.join("s0.h5"), b"").unwrap();
        let mut sources = Sources::open(&d, no_ids).unwrap();
        assert_eq!(sources.standing(&a, "a").unwrap(), Standing::New);
        sources.record("s0.h5", vec![a.clone()]).unwrap();
        let sources = Sources::open(&d, no_ids).unwrap();
        assert_eq!(sources.of_shard("s0.h5"), Some(&[a.clone()][..]));
        assert_eq!((sources.next_index("s"), sources.next_index("t")), (1, 0));
        // The same bytes under another name (the input moved) are done.
        let moved = Source {
            key: "elsewhere/a.bin".into(),
            ..a.clone()
        };
        assert_eq!(
            sources.standing(&moved, "moved").unwrap(),
            Standing::Done("s0.h5".into())
        );
        std::fs::write(&input, b"second").unwrap();
        let changed = Source::of_files("in/a.bin", &[input]).unwrap();
        let err = sources
            .standing(&changed, "in/a.bin")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("already written into") && err.contains("s0.h5"),
            "{err}"
        );
        // A shard that is gone takes its record with it.
        std::fs::remove_file(d.join("s0.h5")).unwrap();
        let sources = Sources::open(&d, no_ids).unwrap();
        assert_eq!(sources.standing(&changed, "a").unwrap(), Standing::New);
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_line_cut_short_by_a_crash_is_dropped_and_the_record_compacted() {
        let d = dir("cut");
        std::fs::write(d.join("s0.h5"), b"").unwrap();
        let a = Source {
            key: "a".into(),
            bytes: Some(1),
            crc32: Some(2),
        };
        let mut sources = Sources::open(&d, no_ids).unwrap();
        sources.record("s0.h5", vec![a.clone()]).unwrap();
        let record = d.join(SOURCES_FILE);
        let mut text = std::fs::read_to_string(&record).unwrap();
        text.push_str("{\"shard\": \"s1.h5\", \"sour");
        std::fs::write(&record, &text).unwrap();
        let sources = Sources::open(&d, no_ids).unwrap();
        assert_eq!(sources.of_shard("s0.h5"), Some(&[a][..]));
        assert_eq!(std::fs::read_to_string(&record).unwrap().lines().count(), 1);
        // A malformed line that is not the last is an error naming the file and line.
        std::fs::write(&record, "nonsense\n{}\n").unwrap();
        let err = Sources::open(&d, no_ids).unwrap_err().to_string();
        assert!(
            err.contains(SOURCES_FILE) && err.contains("line 1"),
            "{err}"
        );
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_shard_without_a_record_is_known_by_its_ids() {
        let d = dir("ids");
        std::fs::write(d.join("old.h5"), b"").unwrap();
        let ids = |_: &Path| Ok(vec!["x.png".to_string()]);
        let sources = Sources::open(&d, ids).unwrap();
        let x = Source {
            key: "x.png".into(),
            bytes: Some(3),
            crc32: Some(7),
        };
        assert_eq!(
            sources.standing(&x, "x").unwrap(),
            Standing::Done("old.h5".into())
        );
        std::fs::remove_dir_all(d).unwrap();
    }
}
