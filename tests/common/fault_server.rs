//! A real HTTP/1.1 server on 127.0.0.1 for ingest tests: it serves a directory and, per path,
//! answers with a scripted sequence of faults (status codes, corrupted bodies) before serving the
//! file, logging every request.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// What the server does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this status and no body.
    Status(u16),
    /// Serve the file with one byte flipped.
    Corrupt,
}

#[derive(Default)]
struct Script {
    /// Faults to inject, in order, per path; afterwards the file is served.
    queued: HashMap<String, VecDeque<Fault>>,
    /// Faults injected on every request of a path.
    always: HashMap<String, Fault>,
    /// Requested paths, in arrival order.
    log: Vec<String>,
}

/// The running server; it stops with the test process.
pub struct FaultServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    script: Arc<Mutex<Script>>,
}

impl FaultServer {
    /// Serve `root` on a free port.
    pub fn start(root: PathBuf) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let script = Arc::new(Mutex::new(Script::default()));
        let shared = script.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (root, script) = (root.clone(), shared.clone());
                std::thread::spawn(move || serve(stream, &root, &script));
            }
        });
        Self { url, script }
    }

    /// Inject `faults` on the next requests of `path` (e.g. `/part_00000.tar`).
    pub fn queue(&self, path: &str, faults: &[Fault]) {
        let mut s = self.script.lock().unwrap();
        s.queued.entry(path.into()).or_default().extend(faults);
    }

    /// Inject `fault` on every request of `path`, or stop doing so (`None`).
    pub fn always(&self, path: &str, fault: Option<Fault>) {
        let mut s = self.script.lock().unwrap();
        match fault {
            Some(f) => s.always.insert(path.into(), f),
            None => s.always.remove(path),
        };
    }

    /// How many times `path` was requested.
    pub fn requests(&self, path: &str) -> usize {
        self.script
            .lock()
            .unwrap()
            .log
            .iter()
            .filter(|p| *p == path)
            .count()
    }
}

fn serve(mut stream: TcpStream, root: &std::path::Path, script: &Mutex<Script>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    loop {
        let mut header = String::new();
        match reader.read_line(&mut header) {
            Ok(0) | Err(_) => break,
            Ok(_) if header == "\r\n" => break,
            Ok(_) => {}
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .to_string();
    let fault = {
        let mut s = script.lock().unwrap();
        s.log.push(path.clone());
        let queued = s.queued.get_mut(&path).and_then(VecDeque::pop_front);
        queued.or_else(|| s.always.get(&path).copied())
    };
    let (status, body) = match (
        fault,
        std::fs::read(root.join(path.trim_start_matches('/'))),
    ) {
        (Some(Fault::Status(code)), _) => (code, Vec::new()),
        (_, Err(_)) => (404, Vec::new()),
        (Some(Fault::Corrupt), Ok(mut bytes)) => {
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
            (200, bytes)
        }
        (None, Ok(bytes)) => (200, bytes),
    };
    let head = format!(
        "HTTP/1.1 {status} Scripted\r\nContent-Length: {}\r\nRetry-After: 0\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(&body);
}
