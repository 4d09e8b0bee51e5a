//! HTTP downloads that survive a busy server: exponential backoff on 429 and 503 (honouring
//! `Retry-After`), on dropped connections and on MD5 mismatches; the body streams to disk while
//! its MD5 is computed.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use md5::{Digest, Md5};

/// How often and how patiently a download is retried.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts per file, the first included.
    pub max_attempts: u32,
    /// Delay before the first retry; doubled for each further one.
    pub base_delay: Duration,
    /// Longest delay between attempts.
    pub max_delay: Duration,
}

impl RetryPolicy {
    /// The delay before retry `retry` (1-based), at least `server_hint`.
    fn delay(&self, retry: u32, server_hint: Option<Duration>) -> Duration {
        let exp = self.base_delay.saturating_mul(1 << (retry - 1).min(16));
        exp.max(server_hint.unwrap_or_default()).min(self.max_delay)
    }
}

/// Largest manifest or MD5 list accepted (a million names fit in far less).
pub const MAX_LISTING: u64 = 64 << 20;

/// Why one attempt failed.
enum Attempt {
    /// Worth retrying (429, 503, a broken connection, a checksum mismatch).
    Retry(String, Option<Duration>),
    /// Retrying cannot help (404, a local write error).
    Fatal(String),
}

/// A client for one base URL.
pub struct Client {
    agent: ureq::Agent,
    policy: RetryPolicy,
}

impl Client {
    /// A client with `policy`; connections time out after 30 s, reads after 120 s.
    pub fn new(policy: RetryPolicy) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(30))
            .timeout_read(Duration::from_secs(120))
            .build();
        Self { agent, policy }
    }

    /// One GET of `url` into `sink`, at most `limit` bytes of body; returns the body's MD5.
    fn attempt(&self, url: &str, sink: &mut dyn Write, limit: u64) -> Result<String, Attempt> {
        let response = match self.agent.get(url).call() {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) if code == 429 || code == 503 => {
                let hint = r
                    .header("Retry-After")
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                return Err(Attempt::Retry(format!("HTTP {code}"), hint));
            }
            Err(ureq::Error::Status(code, _)) => {
                return Err(Attempt::Fatal(format!("HTTP {code}")))
            }
            Err(ureq::Error::Transport(t)) => return Err(Attempt::Retry(t.to_string(), None)),
        };
        let mut reader = response.into_reader();
        let mut md5 = Md5::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut received = 0u64;
        loop {
            let n = reader
                .read(&mut buf)
                .map_err(|e| Attempt::Retry(format!("reading the body: {e}"), None))?;
            if n == 0 {
                break;
            }
            received += n as u64;
            if received > limit {
                return Err(Attempt::Fatal(format!(
                    "the body is larger than the {limit} bytes expected"
                )));
            }
            md5.update(&buf[..n]);
            sink.write_all(&buf[..n])
                .map_err(|e| Attempt::Fatal(format!("writing: {e}")))?;
        }
        Ok(format!("{:x}", md5.finalize()))
    }

    /// Download `url` to `dest` (through `dest.part`), checking the MD5 when `md5` is given.
    /// Returns the attempts used, or the last error after `max_attempts`.
    pub fn download(
        &self,
        url: &str,
        dest: &Path,
        md5: Option<&str>,
    ) -> Result<u32, (String, u32)> {
        self.download_at_most(url, dest, md5, u64::MAX)
    }

    /// [`Client::download`] of a body of at most `limit` bytes (a larger one fails at once).
    fn download_at_most(
        &self,
        url: &str,
        dest: &Path,
        md5: Option<&str>,
        limit: u64,
    ) -> Result<u32, (String, u32)> {
        let part = dest.with_extension("part");
        let mut attempt = 1;
        loop {
            let result = fs::File::create(&part)
                .map_err(|e| Attempt::Fatal(format!("{}: {e}", part.display())))
                .and_then(|mut f| {
                    let digest = self.attempt(url, &mut f, limit)?;
                    f.sync_all()
                        .map_err(|e| Attempt::Fatal(format!("{}: {e}", part.display())))?;
                    match md5 {
                        Some(want) if !want.eq_ignore_ascii_case(&digest) => Err(Attempt::Retry(
                            format!("MD5 mismatch: got {digest}, manifest says {want}"),
                            None,
                        )),
                        _ => Ok(()),
                    }
                });
            let (message, hint) = match result {
                Ok(()) => {
                    fs::rename(&part, dest)
                        .map_err(|e| (format!("{}: {e}", dest.display()), attempt))?;
                    return Ok(attempt);
                }
                Err(Attempt::Fatal(message)) => {
                    let _ = fs::remove_file(&part);
                    return Err((message, attempt));
                }
                Err(Attempt::Retry(message, hint)) => (message, hint),
            };
            let _ = fs::remove_file(&part);
            if attempt >= self.policy.max_attempts {
                return Err((format!("{message} (after {attempt} attempts)"), attempt));
            }
            let delay = self.policy.delay(attempt, hint);
            tracing::warn!("{url}: {message}; retrying in {delay:?}");
            std::thread::sleep(delay);
            attempt += 1;
        }
    }

    /// The text at `url` (a manifest or digest list: at most [`MAX_LISTING`] bytes, so a server
    /// that never ends its answer cannot hold the ingest), with the same retries.
    pub fn text(&self, url: &str, scratch: &Path) -> Result<String, String> {
        self.download_at_most(url, scratch, None, MAX_LISTING)
            .map_err(|(e, _)| format!("{url}: {e}"))?;
        let text = fs::read_to_string(scratch).map_err(|e| format!("{url}: {e}"));
        let _ = fs::remove_file(scratch);
        text
    }
}

/// The file names of a manifest: one per line; blank lines and `#` comments skipped.
pub fn parse_manifest(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

/// An `md5sum`-style list (`<hex digest>  <name>`, an optional `*` before binary names) as a
/// map from name to lowercase digest; fails naming the first malformed line.
pub fn parse_md5_list(text: &str) -> Result<HashMap<String, String>, String> {
    let mut out = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (digest, name) = line
            .split_once(char::is_whitespace)
            .ok_or_else(|| format!("MD5 list line {}: expected `<digest>  <name>`", i + 1))?;
        if digest.len() != 32 || !digest.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!(
                "MD5 list line {}: `{digest}` is not an MD5 digest",
                i + 1
            ));
        }
        let name = name.trim().trim_start_matches('*');
        if out
            .insert(name.to_string(), digest.to_ascii_lowercase())
            .is_some()
        {
            return Err(format!("MD5 list line {}: `{name}` is listed twice", i + 1));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::net::TcpListener;

    #[test]
    fn a_body_that_never_ends_is_cut_at_its_limit() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/listing.txt", listener.local_addr().unwrap());
        // A server that answers with an endless body, until the client hangs up (bounded: it
        // stops by itself after 256 MiB).
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 2 {
                line.clear();
            }
            let mut out = stream;
            let _ = out.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n");
            let chunk = vec![b'x'; 1 << 16];
            for _ in 0..4096 {
                if out.write_all(&chunk).is_err() {
                    break;
                }
            }
        });
        let dir = std::env::temp_dir().join(format!("flux-http-endless-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let client = Client::new(RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(1),
        });
        let (err, attempts) = client
            .download_at_most(&url, &dir.join("listing.txt"), None, 1 << 20)
            .unwrap_err();
        assert!(err.contains("larger than the 1048576 bytes"), "{err}");
        assert_eq!(attempts, 1, "a too-large body is not retried");
        assert!(!dir.join("listing.part").exists());
        server.join().unwrap();
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_name_listed_twice_in_the_md5_list_is_refused() {
        let digest = "0123456789abcdef0123456789abcdef";
        let err = parse_md5_list(&format!("{digest}  a.tar\n{digest}  a.tar\n")).unwrap_err();
        assert_eq!(err, "MD5 list line 2: `a.tar` is listed twice");
    }
}
