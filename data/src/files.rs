//! Plain files read and written safely: inputs must be regular files (a FIFO, a device or a
//! directory given where a file belongs is refused before it is opened, so nothing blocks on it
//! or reads without end), small text files are read with a size bound, and outputs are written
//! through a temporary file, fsync and rename, with the path named in every error and no `.tmp`
//! left behind by a failed write.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{io, DataError};

/// What kind of file `path` is, in words, when it is not a regular file (symlinks followed).
pub fn not_regular(meta: &fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    match () {
        _ if t.is_file() => None,
        _ if t.is_dir() => Some("a directory"),
        _ if t.is_fifo() => Some("a FIFO (named pipe)"),
        _ if t.is_char_device() => Some("a character device"),
        _ if t.is_block_device() => Some("a block device"),
        _ if t.is_socket() => Some("a socket"),
        _ => Some("not a regular file"),
    }
}

/// Check that `path` is a regular file, without opening it (opening a FIFO would block).
pub fn require_regular(path: &Path) -> Result<(), DataError> {
    let meta = fs::metadata(path).map_err(io(path))?;
    match not_regular(&meta) {
        None => Ok(()),
        Some(kind) => Err(DataError::format(
            path,
            format!("is {kind}; a regular file is needed here"),
        )),
    }
}

/// Open the regular file `path` for reading.
pub fn open_regular(path: &Path) -> Result<fs::File, DataError> {
    require_regular(path)?;
    fs::File::open(path).map_err(io(path))
}

/// Read the regular file `path` as UTF-8 text of at most `limit` bytes.
pub fn read_to_string_limited(path: &Path, limit: u64) -> Result<String, DataError> {
    let mut text = String::new();
    open_regular(path)?
        .take(limit + 1)
        .read_to_string(&mut text)
        .map_err(io(path))?;
    if text.len() as u64 > limit {
        return Err(DataError::format(
            path,
            format!("is larger than the {limit} bytes expected of it"),
        ));
    }
    Ok(text)
}

/// The temporary name `path` is written under before its rename: `path` + `.tmp`.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Write `path` atomically: `write` fills `path.tmp`, which is fsynced and renamed over `path`,
/// then the directory is fsynced. On any failure the error names the path and the temporary
/// file is removed, so a retry starts clean and readers only ever see a complete file.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), DataError> {
    let tmp = tmp_path(path);
    let result = (|| {
        let mut file = std::io::BufWriter::new(fs::File::create(&tmp)?);
        write(&mut file)?;
        file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(io(path)(e));
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("flux-files-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn special_files_are_refused_without_being_opened() {
        let dir = scratch("special");
        let fifo = dir.join("pipe");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        // Opening the FIFO would block forever: the check must refuse it first.
        let err = read_to_string_limited(&fifo, 10).unwrap_err().to_string();
        assert!(err.contains("FIFO") && err.contains("pipe"), "{err}");
        let err = open_regular(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("character device"), "{err}");
        let err = open_regular(&dir).unwrap_err().to_string();
        assert!(err.contains("a directory"), "{err}");
    }

    #[test]
    fn reads_are_bounded() {
        let dir = scratch("bounded");
        let path = dir.join("f");
        fs::write(&path, "12345").unwrap();
        assert_eq!(read_to_string_limited(&path, 5).unwrap(), "12345");
        let err = read_to_string_limited(&path, 4).unwrap_err().to_string();
        assert!(err.contains("larger than the 4 bytes"), "{err}");
    }

    #[test]
    fn a_failed_atomic_write_names_the_path_and_leaves_no_temporary() {
        let dir = scratch("atomic");
        let path = dir.join("out.json");
        write_atomic(&path, |w| w.write_all(b"one")).unwrap();
        let err = write_atomic(&path, |w| {
            w.write_all(b"partial")?;
            Err(std::io::Error::other("disk full"))
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("out.json") && err.contains("disk full"),
            "{err}"
        );
        assert_eq!(fs::read_to_string(&path).unwrap(), "one");
        assert!(!tmp_path(&path).exists());
        let missing = dir.join("no/such/dir/out.json");
        let err = write_atomic(&missing, |w| w.write_all(b"x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no/such/dir/out.json"), "{err}");
    }
}
