//! Streaming ingest from an HTTP base URL: a manifest of tar shards and their MD5s is fetched,
//! `concurrency` threads download ahead, at most `prefetch` downloaded files sit on disk at once,
//! and the main thread converts them strictly in manifest order and deletes each after use.
//! Files that still fail after the retries, or fail to convert, are skipped and listed in
//! `failed_files.json`; shards already converted from the same URL are skipped, so re-running
//! resumes, and a shard name another source already wrote is refused ([`Sources`]).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use serde::{Deserialize, Serialize};

use crate::dataset::sample_ids;
use crate::error::{io, DataError};
use crate::ingest::http::{parse_manifest, parse_md5_list, Client, RetryPolicy};
use crate::ingest::local::{convert_tar, plan_shards};
use crate::ingest::sources::{Source, Sources};
use crate::ingest::{IngestOptions, IngestSummary, Progress};

/// Where and how to stream from.
#[derive(Debug, Clone)]
pub struct HttpSource {
    /// Base URL; file names from the manifest are appended (`{base}/{name}`).
    pub base_url: String,
    /// Manifest file name under the base URL (one tar name per line).
    pub manifest: String,
    /// MD5 list file name under the base URL (`md5sum` format), if any.
    pub md5: Option<String>,
    /// Concurrent downloads.
    pub concurrency: usize,
    /// Downloaded files allowed on disk at once (the one being converted included).
    pub prefetch: usize,
    /// Retry behaviour per file.
    pub retry: RetryPolicy,
    /// Directory for downloads in flight.
    pub work_dir: PathBuf,
}

/// One file that could not be ingested, as listed in `failed_files.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FailedFile {
    /// Name from the manifest.
    pub file: String,
    /// The last error.
    pub error: String,
    /// Download attempts made.
    pub attempts: u32,
}

/// A counting semaphore: the permits are downloaded files on disk.
struct Permits {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Permits {
    fn acquire(&self) {
        let mut free = self.free.lock().expect("no panics while held");
        while *free == 0 {
            free = self.freed.wait(free).expect("no panics while held");
        }
        *free -= 1;
    }

    fn release(&self) {
        *self.free.lock().expect("no panics while held") += 1;
        self.freed.notify_one();
    }
}

type Downloaded = Result<(PathBuf, u32), (String, u32)>;

/// Results by manifest position, filled by the download threads.
struct Results {
    done: Mutex<HashMap<usize, Downloaded>>,
    ready: Condvar,
}

fn url_of(base: &str, name: &str) -> String {
    format!("{}/{}", base.trim_end_matches('/'), name)
}

/// Ingest every tar shard of `source`'s manifest into `out_dir`.
pub fn ingest_http(
    source: &HttpSource,
    out_dir: &Path,
    options: &IngestOptions,
    progress: &dyn Progress,
) -> Result<IngestSummary, DataError> {
    fs::create_dir_all(out_dir).map_err(io(out_dir))?;
    fs::create_dir_all(&source.work_dir).map_err(io(&source.work_dir))?;
    let client = Arc::new(Client::new(source.retry));
    let fetch_text = |name: &str| {
        client
            .text(
                &url_of(&source.base_url, name),
                &source.work_dir.join(".listing"),
            )
            .map_err(|message| DataError::Format {
                path: url_of(&source.base_url, name),
                message,
            })
    };
    let names = parse_manifest(&fetch_text(&source.manifest)?);
    let inputs: Vec<(String, String)> = names.iter().map(|n| (n.clone(), n.clone())).collect();
    let planned = plan_shards(out_dir, &inputs)?;
    let md5s = match &source.md5 {
        Some(name) => {
            Some(
                parse_md5_list(&fetch_text(name)?).map_err(|message| DataError::Format {
                    path: url_of(&source.base_url, name),
                    message,
                })?,
            )
        }
        None => None,
    };
    let mut summary = IngestSummary::default();
    let mut sources = Sources::open(out_dir, sample_ids)?;
    let mut todo = Vec::new();
    let mut outs = Vec::new();
    for (name, out) in names.into_iter().zip(planned) {
        let key = url_of(&source.base_url, &name);
        let shard = out.file_name().expect("a shard file").to_string_lossy();
        match sources.of_shard(&shard) {
            None => {
                todo.push(name);
                outs.push(out);
            }
            // Written from this URL; or by a run from before the record, which named shards
            // after their files alone.
            Some(held) if held.iter().any(|s| s.key == key || s.bytes.is_none()) => {}
            Some(held) => {
                return Err(DataError::Format {
                    path: key,
                    message: format!(
                        "would be written to {}, which already holds {}: ingest it into \
                         another --out",
                        out.display(),
                        held[0].key
                    ),
                })
            }
        }
    }
    summary.skipped = (inputs.len() - todo.len()) as u64;
    progress.start(inputs.len() as u64);
    progress.skip(summary.skipped);

    let permits = Arc::new(Permits {
        free: Mutex::new(source.prefetch.max(1)),
        freed: Condvar::new(),
    });
    let results = Arc::new(Results {
        done: Mutex::new(HashMap::new()),
        ready: Condvar::new(),
    });
    let next_job = Arc::new(Mutex::new(0usize));
    let jobs = Arc::new(todo.clone());
    let workers: Vec<_> = (0..source.concurrency.max(1))
        .map(|_| {
            let (permits, results, next_job, jobs, client) = (
                permits.clone(),
                results.clone(),
                next_job.clone(),
                jobs.clone(),
                client.clone(),
            );
            let (base, work_dir, md5s) = (
                source.base_url.clone(),
                source.work_dir.clone(),
                md5s.clone(),
            );
            std::thread::spawn(move || loop {
                // Take the permit before the job: permits then always belong to the earliest
                // outstanding files, so the in-order consumer can never wait on a file that
                // cannot start.
                permits.acquire();
                let job = {
                    let mut next = next_job.lock().expect("no panics while held");
                    let job = *next;
                    *next += 1;
                    job
                };
                let Some(name) = jobs.get(job) else {
                    permits.release();
                    return;
                };
                let dest = work_dir.join(name.replace('/', "_"));
                let outcome = match md5s.as_ref().map(|m| m.get(name)) {
                    Some(None) => Err(("no entry in the MD5 list".to_string(), 0)),
                    digest => client
                        .download(
                            &url_of(&base, name),
                            &dest,
                            digest.flatten().map(|s| s.as_str()),
                        )
                        .map(|attempts| (dest, attempts)),
                };
                results
                    .done
                    .lock()
                    .expect("no panics while held")
                    .insert(job, outcome);
                results.ready.notify_all();
            })
        })
        .collect();

    let mut failed = Vec::new();
    for (job, name) in todo.iter().enumerate() {
        let downloaded = {
            let mut done = results.done.lock().expect("no panics while held");
            loop {
                if let Some(d) = done.remove(&job) {
                    break d;
                }
                done = results.ready.wait(done).expect("no panics while held");
            }
        };
        match downloaded {
            Ok((file, attempts)) => {
                let out = &outs[job];
                let shard = out.file_name().expect("a shard file").to_string_lossy();
                let key = url_of(&source.base_url, name);
                let converted = Source::of_files(&key, std::slice::from_ref(&file))
                    .and_then(|record| sources.record(&shard, vec![record]))
                    .and_then(|()| fs::File::open(&file).map_err(io(&file)))
                    .map(std::io::BufReader::new)
                    .and_then(|reader| {
                        convert_tar(reader, name, out, options, summary.layout.as_ref())
                    });
                let _ = fs::remove_file(&file);
                match converted {
                    Ok(written) => summary.add(written),
                    Err(e) => failed.push(FailedFile {
                        file: name.clone(),
                        error: e.to_string(),
                        attempts,
                    }),
                }
            }
            Err((error, attempts)) => {
                tracing::warn!("{name}: skipped: {error}");
                failed.push(FailedFile {
                    file: name.clone(),
                    error,
                    attempts,
                });
            }
        }
        permits.release();
        progress.advance(name);
    }
    for worker in workers {
        let _ = worker.join();
    }
    progress.finish();
    write_failed(out_dir, &failed)?;
    summary.failed = failed;
    Ok(summary)
}

/// The entries of `out_dir/failed_files.json` (none when it does not exist or cannot be read:
/// a listing, not state that anything depends on).
pub fn read_failed(out_dir: &Path) -> Vec<FailedFile> {
    fs::read_to_string(out_dir.join("failed_files.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

/// Write `failed_files.json` (or remove a stale one when nothing failed).
pub fn write_failed(out_dir: &Path, failed: &[FailedFile]) -> Result<(), DataError> {
    let path = out_dir.join("failed_files.json");
    if failed.is_empty() {
        if path.exists() {
            fs::remove_file(&path).map_err(io(&path))?;
        }
        return Ok(());
    }
    let json = serde_json::to_string_pretty(failed).expect("plain records serialise");
    fs::write(&path, json + "\n").map_err(io(&path))
}
