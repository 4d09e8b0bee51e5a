//! The run directory a training run owns (`[checkpoint] dir`): created and checked writable on
//! every rank before any work, locked so that a second run cannot write into it at the same time,
//! and the identity a new run stamps on every checkpoint it writes.
//!
//! The lock is an exclusive `flock` on `<dir>/run.lock`, held by world rank 0 for the whole run
//! and released by the kernel when the process ends, however it ends (a crash, SIGKILL): no stale
//! lock is ever left to remove by hand. The file names its holder (host, pid, start time) for the
//! message a second run gets.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::hash::{BuildHasher, RandomState};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use flux_model::tp::Collective;
use tch::Tensor;

/// The lock file in a run directory.
pub const LOCK_FILE: &str = "run.lock";

/// Why a run cannot have its directory.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    /// The directory cannot be created or written on some rank.
    #[error("run directory {dir} is not writable: {why}")]
    NotWritable {
        /// The run directory.
        dir: PathBuf,
        /// The OS error, or on how many ranks it failed.
        why: String,
    },
    /// Another run holds the directory.
    #[error(
        "run directory {dir} is in use by another run ({holder}): wait for it to end, or choose \
         another [checkpoint] dir"
    )]
    InUse {
        /// The run directory.
        dir: PathBuf,
        /// Who holds it, as its lock file says.
        holder: String,
    },
}

/// A run directory this run holds (the lock is released when it is dropped, or when the process
/// ends).
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    /// Rank 0's locked `run.lock` (`None` on the other ranks).
    _lock: Option<File>,
    id: String,
}

impl RunDir {
    /// Create `path`, check that every rank can write into it (a probe file each: the directory
    /// may be node-local or shared), lock it on rank 0, and agree on a new run identity. Every
    /// rank fails together, with the directory named, when any rank cannot.
    pub fn claim(path: &Path, world: &dyn Collective) -> Result<Self, RunDirError> {
        let probe = path.join(format!(".write-probe.{}", world.rank()));
        let local = fs::create_dir_all(path)
            .and_then(|()| fs::write(&probe, b""))
            .and_then(|()| fs::remove_file(&probe));
        let failed = world.count_failures(local.is_err());
        let not_writable = |why: String| RunDirError::NotWritable {
            dir: path.to_path_buf(),
            why,
        };
        if let Err(e) = local {
            return Err(not_writable(e.to_string()));
        }
        if failed > 0 {
            return Err(not_writable(format!(
                "it failed on {failed} of {} rank(s)",
                world.size()
            )));
        }
        let lock = match world.rank() {
            0 => Some(lock(path)),
            _ => None,
        };
        let failed = world.count_failures(lock.as_ref().is_some_and(Result::is_err));
        let lock = lock.transpose()?;
        if failed > 0 {
            return Err(RunDirError::InUse {
                dir: path.to_path_buf(),
                holder: format!("rank 0 names it; see its error, or {}", LOCK_FILE),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            _lock: lock,
            id: agreed_id(world),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A run identity agreed by every rank, new to this start: what a fresh run stamps on its
    /// checkpoints (a resumed run keeps its checkpoint's).
    pub fn fresh_id(&self) -> &str {
        &self.id
    }
}

/// Lock `dir`'s lock file for this process and write this process into it; fails naming the
/// holder when another process holds it.
fn lock(dir: &Path) -> Result<File, RunDirError> {
    let path = dir.join(LOCK_FILE);
    let not_writable = |e: std::io::Error| RunDirError::NotWritable {
        dir: dir.to_path_buf(),
        why: format!("{}: {e}", path.display()),
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(not_writable)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = (&file).take(4096).read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "its lock file names no holder yet".to_string(),
                text => text.to_string(),
            };
            return Err(RunDirError::InUse {
                dir: dir.to_path_buf(),
                holder,
            });
        }
        Err(TryLockError::Error(e)) => return Err(not_writable(e)),
    }
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let holder = format!(
        "host {}, pid {}, started at {since} s since the epoch",
        hostname(),
        std::process::id()
    );
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(holder.as_bytes()))
        .and_then(|()| file.sync_data())
        .map_err(not_writable)?;
    Ok(file)
}

/// This machine's host name (`?` where it cannot be read).
fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "?".to_string())
}

/// A 64-bit identity drawn on rank 0 and sent to every rank, as 16 hexadecimal digits. It
/// travels as four 16-bit pieces in f32, which hold them exactly whatever the backend.
fn agreed_id(world: &dyn Collective) -> String {
    let drawn = RandomState::new().hash_one((std::process::id(), SystemTime::now()));
    let pieces: Vec<f32> = (0..4)
        .map(|i| ((drawn >> (16 * i)) & 0xffff) as f32)
        .collect();
    let t = Tensor::from_slice(&pieces);
    world.broadcast(&t, 0);
    let pieces = Vec::<f32>::try_from(&t).expect("an f32 tensor");
    let id = pieces
        .iter()
        .enumerate()
        .fold(0u64, |id, (i, &p)| id | ((p as u64) << (16 * i)));
    format!("{id:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use flux_model::tp::SingleRank;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("flux-run-dir-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_second_claim_is_refused_naming_the_holder_until_the_first_ends() {
        let dir = temp_dir("lock");
        let first = RunDir::claim(&dir, &SingleRank).unwrap();
        assert_eq!(first.fresh_id().len(), 16);
        let err = RunDir::claim(&dir, &SingleRank).unwrap_err().to_string();
        assert!(err.contains("in use by another run"), "{err}");
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        let again = RunDir::claim(&dir, &SingleRank).unwrap();
        assert_eq!(again.path(), dir);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn identities_differ_between_starts() {
        assert_ne!(agreed_id(&SingleRank), agreed_id(&SingleRank));
    }
}
