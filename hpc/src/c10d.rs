//! libtorch's c10d process groups (gloo on CPU tensors, NCCL on CUDA tensors) as
//! [`Collective`]s, through `csrc/c10d_groups.cpp`. MPI stays the launcher: world rank 0 opens
//! the rendezvous store and broadcasts its address over MPI, and every group keeps its MPI
//! communicator for what its c10d group does not take (host `f32` buffers under NCCL, tensors on
//! the other device).

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::NonNull;
use std::time::Duration;

use flux_model::tp::{staging, Collective, Pending};
use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

use crate::backend::{Backend, BackendError};
use crate::{watchdog, MpiGroup};

type Handle = c_void;

extern "C" {
    fn flux_c10d_last_error() -> *const c_char;
    fn flux_c10d_store(
        host: *const c_char,
        port: i32,
        is_server: i32,
        world: i32,
        connect_timeout_ms: i64,
        timeout_ms: i64,
        bound_port: *mut i32,
    ) -> *mut Handle;
    fn flux_c10d_store_free(store: *mut Handle);
    fn flux_c10d_group(
        store: *mut Handle,
        prefix: *const c_char,
        backend: i32,
        rank: i32,
        size: i32,
        timeout_ms: i64,
    ) -> *mut Handle;
    fn flux_c10d_group_free(group: *mut Handle);
    fn flux_c10d_all_reduce(group: *mut Handle, t: *const C_tensor) -> *mut Handle;
    fn flux_c10d_all_gather(
        group: *mut Handle,
        input: *const C_tensor,
        output: *const C_tensor,
    ) -> *mut Handle;
    fn flux_c10d_reduce_scatter(
        group: *mut Handle,
        input: *const C_tensor,
        output: *const C_tensor,
    ) -> *mut Handle;
    fn flux_c10d_broadcast(group: *mut Handle, t: *const C_tensor, root: i32) -> *mut Handle;
    fn flux_c10d_is_completed(work: *mut Handle) -> i32;
    fn flux_c10d_wait(work: *mut Handle) -> i32;
    fn flux_c10d_work_free(work: *mut Handle);
}

/// The C++ side's message for the failure this thread just saw.
fn last_error() -> String {
    // SAFETY: the C++ side keeps the message alive until its next error on this thread.
    unsafe { CStr::from_ptr(flux_c10d_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// The rendezvous of a world's c10d groups: a TCP store served by world rank 0.
pub struct Store(NonNull<Handle>);

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: allocated by `flux_c10d_store`, freed once here.
        unsafe { flux_c10d_store_free(self.0.as_ptr()) }
    }
}

/// How long a rank tries to reach the rendezvous store (an unreachable `MASTER_ADDR` fails in
/// this time, not in the collective timeout); the store's operations keep the collective timeout.
const STORE_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// The port `MASTER_PORT` names (0, any free port, when unset); an error naming the variable
/// when it is set to anything but a port number.
fn master_port() -> Result<u16, String> {
    let value = std::env::var_os("MASTER_PORT");
    port_of(value.as_ref().map(|v| v.to_string_lossy()).as_deref())
}

/// The port a `MASTER_PORT` value names (`None`: unset, any free port).
fn port_of(value: Option<&str>) -> Result<u16, String> {
    match value {
        None => Ok(0),
        Some(text) => text
            .trim()
            .parse()
            .map_err(|_| format!("MASTER_PORT = {text:?} is not a port number (0 to 65535)")),
    }
}

impl Store {
    /// Open the store on rank 0 of `world` (on `MASTER_ADDR`'s host when set, else this host's
    /// name, and `MASTER_PORT` when set, else any free port), broadcast its address over MPI and
    /// connect every rank, each within `timeout`. A failure on any rank fails every rank.
    pub fn rendezvous(
        world: &SimpleCommunicator,
        backend: Backend,
        timeout: Duration,
    ) -> Result<Self, BackendError> {
        let leader = world.rank() == 0;
        // A host name (at most 253 bytes), a colon and a port.
        let mut address = [0u8; 512];
        let mut opened = None;
        if leader {
            let host = std::env::var("MASTER_ADDR").unwrap_or_else(|_| hostname());
            let store =
                master_port().and_then(|port| Self::open(&host, port, true, world.size(), timeout));
            if let Ok((_, bound)) = &store {
                let text = format!("{host}:{bound}");
                address[..text.len()].copy_from_slice(text.as_bytes());
            }
            opened = Some(store);
        }
        world.process_at_rank(0).broadcast_into(&mut address[..]);
        let text = String::from_utf8_lossy(&address);
        let text = text.trim_end_matches('\0');
        let store = match (opened, text.rsplit_once(':')) {
            (Some(store), _) => store.map(|(s, _)| s),
            (None, Some((host, port))) => match port.parse() {
                Ok(port) => {
                    tracing::info!(
                        "connecting to rank 0's rendezvous store at {host}:{port} (for up to {} s)",
                        STORE_CONNECT_TIMEOUT.min(timeout).as_secs()
                    );
                    Self::open(host, port, false, world.size(), timeout).map(|(s, _)| s)
                }
                Err(_) => Err(format!("rank 0 sent the store address {text:?}")),
            },
            (None, None) => Err("rank 0 could not open the rendezvous store".into()),
        };
        agree(world, backend, store, "the rendezvous store")
    }

    fn open(
        host: &str,
        port: u16,
        server: bool,
        world: i32,
        timeout: Duration,
    ) -> Result<(Self, u16), String> {
        let c_host = CString::new(host).map_err(|e| e.to_string())?;
        let connect = STORE_CONNECT_TIMEOUT.min(timeout);
        let mut bound = 0;
        // SAFETY: a NUL-terminated host and an out-parameter that outlive the call.
        let store = unsafe {
            flux_c10d_store(
                c_host.as_ptr(),
                port.into(),
                server.into(),
                world,
                connect.as_millis() as i64,
                timeout.as_millis() as i64,
                &mut bound,
            )
        };
        let what = if server { "open" } else { "reach" };
        NonNull::new(store)
            .map(|s| (Self(s), bound as u16))
            .ok_or_else(|| {
                format!(
                    "could not {what} the store at {host}:{port}: {}",
                    last_error()
                )
            })
    }
}

/// Every rank's `result`, failed on all ranks when it failed on any (an MPI all-reduce of the
/// failures), so that no rank goes on to a collective the others never reach.
fn agree<T>(
    world: &SimpleCommunicator,
    backend: Backend,
    result: Result<T, String>,
    what: &str,
) -> Result<T, BackendError> {
    let mut failed = 0i32;
    world.all_reduce_into(
        &i32::from(result.is_err()),
        &mut failed,
        SystemOperation::sum(),
    );
    let setup = |message| BackendError::Setup {
        backend: backend.name(),
        message,
    };
    match result {
        Err(message) => Err(setup(format!("rank {}: {message}", world.rank()))),
        Ok(_) if failed > 0 => Err(setup(format!(
            "{failed} other rank(s) could not set up {what}; see their errors"
        ))),
        Ok(value) => Ok(value),
    }
}

fn hostname() -> String {
    let mut name = [0u8; 256];
    // SAFETY: `gethostname` writes at most `name.len()` bytes into the buffer.
    let ok = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } == 0;
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    match ok {
        true => String::from_utf8_lossy(&name[..end]).into_owned(),
        false => "localhost".into(),
    }
}

/// A c10d process group over an MPI communicator's ranks.
pub struct C10dGroup {
    group: NonNull<Handle>,
    backend: Backend,
    /// The same ranks over MPI: host `f32` buffers under NCCL, and tensors the c10d group does
    /// not take.
    host: MpiGroup,
}

impl std::fmt::Debug for C10dGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "C10dGroup({}, rank {} of {})",
            self.backend.name(),
            self.rank(),
            self.size()
        )
    }
}

impl Drop for C10dGroup {
    fn drop(&mut self) {
        // SAFETY: allocated by `flux_c10d_group`, freed once here.
        unsafe { flux_c10d_group_free(self.group.as_ptr()) }
    }
}

impl C10dGroup {
    /// The `backend` group (`Gloo` or `Nccl`) of `host`'s ranks, named `name` in `store` (unique
    /// among the groups of the world; every member passes the same). `world` agrees on failure:
    /// every rank of the world must call this for its groups in the same order.
    pub fn new(
        store: &Store,
        world: &SimpleCommunicator,
        name: &str,
        host: MpiGroup,
        backend: Backend,
        timeout: Duration,
    ) -> Result<Self, BackendError> {
        let code = match backend {
            Backend::Gloo => 0,
            Backend::Nccl => 1,
            other => panic!("{} is not a c10d backend", other.name()),
        };
        // gloo's waits block this thread, and the watchdog ends a rank that waited past
        // `timeout` naming it: gloo's own bound is set past that. NCCL's waits return at once
        // (the stream waits), so NCCL's own watchdog bounds its collectives.
        let own_timeout = match backend {
            Backend::Gloo => 2 * timeout,
            _ => timeout,
        };
        let prefix = CString::new(name).expect("group names have no NUL");
        // SAFETY: a live store and a NUL-terminated name that outlive the call.
        let group = unsafe {
            flux_c10d_group(
                store.0.as_ptr(),
                prefix.as_ptr(),
                code,
                host.rank() as i32,
                host.size() as i32,
                own_timeout.as_millis() as i64,
            )
        };
        let group = NonNull::new(group).ok_or_else(|| format!("group {name}: {}", last_error()));
        let group = agree(world, backend, group, &format!("group {name}"))?;
        Ok(Self {
            group,
            backend,
            host,
        })
    }

    /// Whether the c10d group moves `t` where it lies.
    fn takes(&self, t: &Tensor) -> bool {
        let device = match self.backend {
            Backend::Nccl => t.device().is_cuda(),
            _ => t.device() == Device::Cpu,
        };
        device && t.is_contiguous()
    }

    /// Whether the c10d group takes host `f32` buffers (gloo does, NCCL does not).
    fn takes_host(&self) -> bool {
        self.backend == Backend::Gloo
    }

    /// Start `op` on this group; its handle.
    fn start(&self, op: impl FnOnce(*mut Handle) -> *mut Handle, keep: Vec<Tensor>) -> C10dWork {
        let work = op(self.group.as_ptr());
        match NonNull::new(work) {
            Some(work) => C10dWork {
                work,
                keep,
                group: self.describe(),
                size: self.size(),
            },
            None => fail(&self.describe(), &last_error()),
        }
    }

    fn describe(&self) -> String {
        format!("{:?}", self)
    }

    fn all_reduce_now(&self, t: &Tensor) {
        // SAFETY: `t` is live for the call; c10d keeps its own reference until the work ends.
        self.start(|g| unsafe { flux_c10d_all_reduce(g, t.as_ptr()) }, vec![])
            .finish();
    }

    fn all_gather_now(&self, input: &Tensor, output: &Tensor) {
        // SAFETY: as in `all_reduce_now`.
        let op = |g| unsafe { flux_c10d_all_gather(g, input.as_ptr(), output.as_ptr()) };
        self.start(op, vec![]).finish();
    }

    fn reduce_scatter_now(&self, input: &Tensor, output: &Tensor) {
        // SAFETY: as in `all_reduce_now`.
        let op = |g| unsafe { flux_c10d_reduce_scatter(g, input.as_ptr(), output.as_ptr()) };
        self.start(op, vec![]).finish();
    }
}

/// `data` (host memory, `len` f32) as a tensor that borrows it.
///
/// # Safety
/// `data` must stay valid, and unused elsewhere, for as long as the tensor is.
unsafe fn borrowed(data: *const f32, len: usize) -> Tensor {
    // SAFETY: as the caller guarantees.
    unsafe { Tensor::from_blob(data.cast(), &[len as i64], &[], Kind::Float, Device::Cpu) }
}

impl Collective for C10dGroup {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) {
        if !self.takes_host() {
            return self.host.all_reduce_sum(data);
        }
        // SAFETY: `data` is borrowed mutably for the whole collective, which completes here.
        self.all_reduce_now(&unsafe { borrowed(data.as_ptr(), data.len()) });
    }

    fn all_gather(&self, data: &[f32], out: &mut [f32]) {
        if !self.takes_host() {
            return self.host.all_gather(data, out);
        }
        // SAFETY: `data` is only read and `out` only written, both for the whole collective,
        // which completes here.
        let (input, output) = unsafe {
            (
                borrowed(data.as_ptr(), data.len()),
                borrowed(out.as_ptr(), out.len()),
            )
        };
        self.all_gather_now(&input, &output);
    }

    fn reduce_scatter_sum(&self, data: &[f32], out: &mut [f32]) {
        if !self.takes_host() {
            return self.host.reduce_scatter_sum(data, out);
        }
        // SAFETY: as in `all_gather`.
        let (input, output) = unsafe {
            (
                borrowed(data.as_ptr(), data.len()),
                borrowed(out.as_ptr(), out.len()),
            )
        };
        self.reduce_scatter_now(&input, &output);
    }

    fn all_reduce(&self, t: &Tensor) {
        match self.takes(t) {
            true => self.all_reduce_now(t),
            false => staging::all_reduce(&self.host, t),
        }
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor) {
        match self.takes(input) && self.takes(output) {
            true => self.all_gather_now(input, output),
            false => staging::all_gather(&self.host, input, output),
        }
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor) {
        match self.takes(input) && self.takes(output) {
            true => self.reduce_scatter_now(input, output),
            false => staging::reduce_scatter(&self.host, input, output),
        }
    }

    fn broadcast(&self, t: &Tensor, root: usize) {
        if !self.takes(t) {
            return staging::broadcast(&self.host, t, root);
        }
        // SAFETY: as in `all_reduce_now`.
        let op = |g| unsafe { flux_c10d_broadcast(g, t.as_ptr(), root as i32) };
        self.start(op, vec![]).finish();
    }

    fn start_all_reduce(&self, t: Tensor) -> Box<dyn Pending + '_> {
        if !self.takes(&t) {
            return self.host.start_all_reduce(t);
        }
        // SAFETY: `t` moves into the handle, which outlives the work.
        let op = |g| unsafe { flux_c10d_all_reduce(g, t.as_ptr()) };
        let work = self.start(op, vec![t.shallow_clone()]);
        Box::new(work.resulting(t))
    }

    fn start_all_gather(&self, input: Tensor) -> Box<dyn Pending + '_> {
        if !self.takes(&input) {
            return self.host.start_all_gather(input);
        }
        let output = input.new_zeros(
            [input.numel() as i64 * self.size() as i64],
            (input.kind(), input.device()),
        );
        // SAFETY: both tensors move into the handle, which outlives the work.
        let op = |g| unsafe { flux_c10d_all_gather(g, input.as_ptr(), output.as_ptr()) };
        let work = self.start(op, vec![input.shallow_clone(), output.shallow_clone()]);
        Box::new(work.resulting(output))
    }

    fn start_reduce_scatter(&self, input: Tensor) -> Box<dyn Pending + '_> {
        if !self.takes(&input) {
            return self.host.start_reduce_scatter(input);
        }
        let output = input.new_zeros(
            [input.numel() as i64 / self.size() as i64],
            (input.kind(), input.device()),
        );
        // SAFETY: both tensors move into the handle, which outlives the work.
        let op = |g| unsafe { flux_c10d_reduce_scatter(g, input.as_ptr(), output.as_ptr()) };
        let work = self.start(op, vec![input.shallow_clone(), output.shallow_clone()]);
        Box::new(work.resulting(output))
    }

    fn start_broadcast(&self, t: Tensor, root: usize) -> Box<dyn Pending + '_> {
        if !self.takes(&t) {
            return self.host.start_broadcast(t, root);
        }
        // SAFETY: `t` moves into the handle, which outlives the work.
        let op = |g| unsafe { flux_c10d_broadcast(g, t.as_ptr(), root as i32) };
        let work = self.start(op, vec![t.shallow_clone()]);
        Box::new(work.resulting(t))
    }
}

/// A c10d collective in flight, and the tensors it reads and writes.
struct C10dWork {
    work: NonNull<Handle>,
    keep: Vec<Tensor>,
    group: String,
    size: usize,
}

impl C10dWork {
    /// Wait for the work; a failure (a peer gone, a timeout) ends this process.
    fn finish(&mut self) {
        let _waiting = watchdog::enter(self.size);
        // SAFETY: a live work handle.
        if unsafe { flux_c10d_wait(self.work.as_ptr()) } != 0 {
            fail(&self.group, &last_error());
        }
    }

    fn resulting(self, result: Tensor) -> C10dPending {
        C10dPending { work: self, result }
    }
}

impl Drop for C10dWork {
    /// A collective dropped unwaited still writes its tensors: wait for it first.
    fn drop(&mut self) {
        self.finish();
        self.keep.clear();
        // SAFETY: allocated by the collective's start, freed once here.
        unsafe { flux_c10d_work_free(self.work.as_ptr()) }
    }
}

/// [`C10dWork`] with the tensor its [`Pending::wait`] returns.
struct C10dPending {
    work: C10dWork,
    result: Tensor,
}

impl Pending for C10dPending {
    fn test(&mut self) -> bool {
        // SAFETY: a live work handle.
        match unsafe { flux_c10d_is_completed(self.work.work.as_ptr()) } {
            -1 => fail(&self.work.group, &last_error()),
            done => done == 1,
        }
    }

    fn wait(mut self: Box<Self>) -> Tensor {
        self.work.finish();
        self.result.shallow_clone()
    }
}

/// A collective failed (a peer died or timed out): end this process with the reason, as the
/// watchdog does, so that the launcher ends the job's other ranks.
fn fail(group: &str, message: &str) -> ! {
    eprintln!("error: {group}: collective failed: {message}; ending the job");
    // SAFETY: `_exit` ends the process at once (MPI's finalisation would wait for the peers).
    unsafe { libc::_exit(3) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn master_port_is_a_port_number_or_refused_naming_it() {
        assert_eq!(port_of(None), Ok(0));
        assert_eq!(port_of(Some(" 29500 ")), Ok(29500));
        for bad in ["abc", "70000", "-1", ""] {
            let err = port_of(Some(bad)).unwrap_err();
            assert!(err.contains("MASTER_PORT") && err.contains(bad), "{err}");
        }
    }
}
