//! An MPI communicator as a [`Collective`]. MPI sums `f32`: a tensor of another dtype is
//! converted, and a CUDA tensor is handed over as a device pointer where the MPI library says it
//! takes them (OpenMPI's `MPIX_Query_cuda_support`), else copied through host memory (counted
//! in [`staging::host_staged_bytes`]; logged once). Every tensor collective is MPI's
//! non-blocking one underneath; the blocking ones wait at once.

use std::sync::OnceLock;

use flux_model::tp::{staging, Collective, Pending};
use mpi::collective::SystemOperation;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use tch::{Device, Kind, Tensor};

use crate::watchdog;

extern "C" {
    /// `MPI_IN_PLACE` of the MPI library in use (csrc/mpi_constants.c).
    fn flux_mpi_in_place() -> *mut std::os::raw::c_void;
}

/// An MPI communicator as a [`Collective`].
pub struct MpiGroup {
    pub(crate) comm: SimpleCommunicator,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiGroup(rank {} of {})",
            self.comm.rank(),
            self.comm.size()
        )
    }
}

/// Whether the MPI library takes CUDA device pointers: OpenMPI's `MPIX_Query_cuda_support()`,
/// looked up when first asked (a library without it counts as no). Logged once.
fn takes_cuda() -> bool {
    static ANSWER: OnceLock<bool> = OnceLock::new();
    *ANSWER.get_or_init(|| {
        // SAFETY: looks a symbol up by a NUL-terminated name in the loaded libraries.
        let query = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"MPIX_Query_cuda_support".as_ptr()) };
        let yes = !query.is_null() && {
            // SAFETY: OpenMPI declares it `int MPIX_Query_cuda_support(void)`.
            let query: extern "C" fn() -> i32 = unsafe { std::mem::transmute(query) };
            query() == 1
        };
        match yes {
            true => tracing::info!(
                "MPI takes CUDA device pointers: CUDA tensors go to it where they lie"
            ),
            false => tracing::warn!(
                "MPI has no CUDA support: each collective on CUDA tensors is copied through host \
                 memory (host_staged_mib); [parallelism] backend = \"nccl\" moves them on the GPU"
            ),
        }
        yes
    })
}

/// The contiguous `f32` buffer MPI reads for `t`: `t` itself where MPI can take it (host `f32`,
/// or CUDA `f32` under a CUDA-aware MPI), else a copy (on the GPU when MPI takes CUDA
/// pointers, else in host memory, counted).
fn readable(t: &Tensor) -> Tensor {
    match t.device().is_cuda() && takes_cuda() {
        true => t.to_kind(Kind::Float).contiguous().flatten(0, -1),
        false => staging::host_f32(t),
    }
}

/// The contiguous `f32` buffer MPI writes the result for `t` into: `t` itself where MPI can take
/// it, else fresh zeros where MPI can reach them.
fn writable(t: &Tensor) -> Tensor {
    match t.device().is_cuda() && takes_cuda() {
        true if t.kind() == Kind::Float && t.is_contiguous() => t.shallow_clone(),
        true => Tensor::zeros([t.numel() as i64], (Kind::Float, t.device())),
        false => staging::host_output(t),
    }
}

/// The contiguous buffer MPI reads for `t` in `t`'s own dtype: `t` itself where MPI can take
/// it, else a copy in host memory (counted).
fn readable_as_is(t: &Tensor) -> Tensor {
    match t.device() == Device::Cpu || takes_cuda() {
        true => t.contiguous().flatten(0, -1),
        false => staging::host_copy(t),
    }
}

/// The contiguous buffer MPI writes the result for `t` into, in `t`'s own dtype: `t` itself
/// where MPI can take it, else fresh zeros in host memory.
fn writable_as_is(t: &Tensor) -> Tensor {
    match (t.device() == Device::Cpu || takes_cuda()) && t.is_contiguous() {
        true => t.shallow_clone(),
        false => Tensor::zeros([t.numel() as i64], (t.kind(), Device::Cpu)),
    }
}

/// Wait for the GPU's work on `buffers` (MPI knows no CUDA stream).
fn settle(buffers: &[&Tensor]) {
    for t in buffers {
        if let Device::Cuda(index) = t.device() {
            tch::Cuda::synchronize(index as i64);
        }
    }
}

impl Collective for MpiGroup {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_reduce_sum(&self, data: &mut [f32]) {
        let send = data.to_vec();
        let _waiting = watchdog::enter(self.size());
        self.comm
            .all_reduce_into(&send[..], data, SystemOperation::sum());
    }

    fn all_gather(&self, data: &[f32], out: &mut [f32]) {
        let _waiting = watchdog::enter(self.size());
        self.comm.all_gather_into(data, out);
    }

    fn reduce_scatter_sum(&self, data: &[f32], out: &mut [f32]) {
        let _waiting = watchdog::enter(self.size());
        self.comm
            .reduce_scatter_block_into(data, out, SystemOperation::sum());
    }

    fn all_reduce(&self, t: &Tensor) {
        self.sum(t.shallow_clone()).finish();
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor) {
        self.gather(input, output.shallow_clone()).finish();
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor) {
        self.scatter(input, output.shallow_clone()).finish();
    }

    fn broadcast(&self, t: &Tensor, root: usize) {
        self.bcast(t.shallow_clone(), root).finish();
    }

    fn start_all_reduce(&self, t: Tensor) -> Box<dyn Pending + '_> {
        Box::new(self.sum(t))
    }

    fn start_all_gather(&self, input: Tensor) -> Box<dyn Pending + '_> {
        let n = input.numel() as i64 * self.size() as i64;
        let output = input.new_zeros([n], (input.kind(), input.device()));
        Box::new(self.gather(&input, output))
    }

    fn start_reduce_scatter(&self, input: Tensor) -> Box<dyn Pending + '_> {
        let n = input.numel() as i64 / self.size() as i64;
        let output = input.new_zeros([n], (input.kind(), input.device()));
        Box::new(self.scatter(&input, output))
    }

    fn start_broadcast(&self, t: Tensor, root: usize) -> Box<dyn Pending + '_> {
        Box::new(self.bcast(t, root))
    }
}

impl MpiGroup {
    /// Start summing `t` over the group, in place (MPI_IN_PLACE: no second buffer).
    fn sum(&self, t: Tensor) -> MpiPending {
        // `t` itself where MPI can take it, else a copy of it: written either way.
        let sum = readable(&t);
        settle(&[&sum]);
        // SAFETY: `sum` holds `t.numel()` f32 where MPI can reach them and moves, unused by
        // anything else, into the returned value, which completes the request first.
        let request = self.start(|comm, request| unsafe {
            ffi::MPI_Iallreduce(
                flux_mpi_in_place(),
                sum.data_ptr(),
                t.numel() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                comm,
                request,
            )
        });
        self.pending(Tensor::new(), sum, t, request)
    }

    /// Start gathering every rank's `input` into `output` (`size()` times longer).
    fn gather(&self, input: &Tensor, output: Tensor) -> MpiPending {
        // An all-gather only moves data: a tensor of another dtype than f32 (bf16 weights, float8
        // bytes) goes at its own width, as bytes.
        let f32 = input.kind() == Kind::Float;
        let (send, out) = match f32 {
            true => (readable(input), writable(&output)),
            false => (readable_as_is(input), writable_as_is(&output)),
        };
        let n = match f32 {
            true => send.numel(),
            false => send.numel() * send.kind().elt_size_in_bytes(),
        } as i32;
        settle(&[&send, &out]);
        // SAFETY: `send` (`n` f32 values, or `n` bytes) and `out` (`size()` times that) move,
        // unused by anything else, into the returned value, which completes the request first.
        let request = self.start(|comm, request| unsafe {
            let datatype = if f32 {
                ffi::RSMPI_FLOAT
            } else {
                ffi::RSMPI_UINT8_T
            };
            ffi::MPI_Iallgather(
                send.data_ptr(),
                n,
                datatype,
                out.data_ptr(),
                n,
                datatype,
                comm,
                request,
            )
        });
        self.pending(send, out, output, request)
    }

    /// Start summing `input` over the group and writing block `rank()` into `output`.
    fn scatter(&self, input: &Tensor, output: Tensor) -> MpiPending {
        let (send, out) = (readable(input), writable(&output));
        settle(&[&send, &out]);
        // SAFETY: as in `gather`, with `send` `size()` times longer than `out`.
        let request = self.start(|comm, request| unsafe {
            ffi::MPI_Ireduce_scatter_block(
                send.data_ptr(),
                out.data_ptr(),
                out.numel() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                comm,
                request,
            )
        });
        self.pending(send, out, output, request)
    }

    /// Start replacing `t` by rank `root`'s.
    fn bcast(&self, t: Tensor, root: usize) -> MpiPending {
        let data = match self.rank() == root {
            true => readable(&t),
            false => writable(&t),
        };
        settle(&[&data]);
        // SAFETY: `data` (`t.numel()` f32) moves, unused by anything else, into the returned
        // value, which completes the request first.
        let request = self.start(|comm, request| unsafe {
            ffi::MPI_Ibcast(
                data.data_ptr(),
                t.numel() as i32,
                ffi::RSMPI_FLOAT,
                root as i32,
                comm,
                request,
            )
        });
        self.pending(data.shallow_clone(), data, t, request)
    }

    /// A non-blocking collective `call` starts on this communicator: its request.
    fn start(
        &self,
        call: impl FnOnce(ffi::MPI_Comm, &mut ffi::MPI_Request) -> i32,
    ) -> ffi::MPI_Request {
        // SAFETY: a constant MPI defines.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        call(self.comm.as_raw(), &mut request);
        request
    }

    fn pending(
        &self,
        send: Tensor,
        buffer: Tensor,
        result: Tensor,
        request: ffi::MPI_Request,
    ) -> MpiPending {
        MpiPending {
            _send: send,
            buffer,
            result,
            request,
            group_size: self.size(),
        }
    }
}

/// A non-blocking MPI collective in flight, with the buffers it reads and writes and the tensor
/// its result goes to.
struct MpiPending {
    /// The buffer MPI reads, where it is not `buffer` (undefined for an in-place sum).
    _send: Tensor,
    /// The `f32` buffer MPI writes.
    buffer: Tensor,
    /// What [`Pending::wait`] returns: `buffer` itself, or the tensor it is copied into.
    result: Tensor,
    request: ffi::MPI_Request,
    group_size: usize,
}

impl Pending for MpiPending {
    fn test(&mut self) -> bool {
        let mut done = 0;
        // SAFETY: `request` is this collective's (or null once completed, which MPI_Test
        // accepts).
        unsafe { ffi::MPI_Test(&mut self.request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
        done != 0
    }

    fn wait(mut self: Box<Self>) -> Tensor {
        self.finish();
        self.result.shallow_clone()
    }
}

impl MpiPending {
    /// Wait for the collective and write its result into `result`.
    fn finish(&mut self) {
        self.complete();
        let (result, buffer) = (&self.result, &self.buffer);
        if result.data_ptr() == buffer.data_ptr() {
            return;
        }
        match buffer.device() {
            Device::Cpu => staging::copy_back(result, buffer),
            _ => {
                let values = buffer.view(result.size().as_slice()).to_kind(result.kind());
                tch::no_grad(|| result.shallow_clone().copy_(&values));
            }
        }
    }

    fn complete(&mut self) {
        let _waiting = watchdog::enter(self.group_size);
        // SAFETY: as in `test`; afterwards the request is null and the buffers free to go.
        unsafe { ffi::MPI_Wait(&mut self.request, ffi::RSMPI_STATUS_IGNORE) };
    }
}

impl Drop for MpiPending {
    /// A collective dropped unwaited still owns buffers MPI writes: wait for it first.
    fn drop(&mut self) {
        self.complete();
    }
}
