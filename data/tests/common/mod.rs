//! Helpers shared by flux-data's integration tests.

use std::path::Path;

/// A named pipe at `path`, made in-process: a spawned `mkfifo` would inherit the HDF5 files that
/// concurrent tests hold open for writing (HDF5 opens them without close-on-exec) and keep their
/// locks alive.
pub fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "mkfifo {}",
        path.display()
    );
}
