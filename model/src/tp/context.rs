//! `TpContext`: this rank's tensor-parallel group, the region boundaries of Megatron's parallel
//! layers, and counters of the collectives they issue.

use std::cell::Cell;
use std::ffi::{c_void, CStr};
use std::mem::ManuallyDrop;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::tp::{Collective, ParamSpec, Pass, SingleRank};

type ReduceFn = unsafe extern "C" fn(handle: *mut c_void, t: *mut C_tensor, kind: i32);
type SequenceFn =
    unsafe extern "C" fn(handle: *mut c_void, op: i32, input: *mut C_tensor, output: *mut C_tensor);
/// What the float8 linears (`csrc/fp8_linear.cpp`) call to take a scale's amax over the group.
pub(crate) type AmaxFn = unsafe extern "C" fn(handle: *mut c_void, amax: *mut C_tensor);

/// The operations a sequence node applies along the sequence dimension (`csrc/tp_regions.cpp`).
#[derive(Debug, Clone, Copy)]
#[repr(i64)]
enum SequenceOp {
    /// Keep this rank's slice; no communication.
    Split = 0,
    /// All-gather every rank's slice, in rank order.
    Gather = 1,
    /// Sum over the group and keep this rank's slice of the sum.
    ReduceScatter = 2,
}

extern "C" {
    fn flux_tp_copy_to_region(
        x: *const C_tensor,
        f: ReduceFn,
        handle: *mut c_void,
    ) -> *mut C_tensor;
    fn flux_tp_reduce_from_region(
        x: *const C_tensor,
        f: ReduceFn,
        handle: *mut c_void,
    ) -> *mut C_tensor;
    #[allow(clippy::too_many_arguments)]
    fn flux_tp_sequence_region(
        x: *const C_tensor,
        forward_op: i64,
        backward_op: i64,
        dim: i64,
        rank: i64,
        size: i64,
        f: SequenceFn,
        handle: *mut c_void,
    ) -> *mut C_tensor;
    fn flux_tp_last_error() -> *const c_char;
}

/// How many all-reduces a group has issued, by where they come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectiveCounts {
    /// Row-parallel outputs summed in the forward pass.
    pub forward: u64,
    /// Column-parallel input gradients summed in the backward pass.
    pub backward: u64,
    /// Buckets of partial gradients summed after backward (QK-norm scales).
    pub grad_sync: u64,
    /// All-gathers and reduce-scatters along the sequence, both passes (sequence parallelism).
    pub sequence: u64,
    /// Maxima of float8 scales' amax over the group (float8 linears split over it).
    pub amax: u64,
}

impl CollectiveCounts {
    /// The all-reduces one forward and one backward pass over a model laid out as `specs` issue
    /// on a group of more than one rank: one per layer that sums its partial outputs forward
    /// (row-parallel linears, vocab-parallel embeddings), one per column-parallel linear
    /// backward (its input's partial gradients), and one bucket of partial gradients when any
    /// parameter's gradient is summed over the group.
    pub fn expected(specs: &[ParamSpec]) -> Self {
        let layers = |pass| specs.iter().filter(|s| s.all_reduce == Some(pass)).count() as u64;
        Self {
            forward: layers(Pass::Forward),
            backward: layers(Pass::Backward),
            grad_sync: specs
                .iter()
                .any(|s| s.grad_sync == crate::tp::GradSync::SumOverGroup)
                .into(),
            sequence: 0,
            amax: 0,
        }
    }
}

struct Group {
    comm: Box<dyn Collective>,
    counts: Cell<CollectiveCounts>,
}

impl Group {
    /// Gather `input` into `output` (`op` Gather) or reduce-scatter it (`op` ReduceScatter); both
    /// contiguous, of one dtype and device.
    fn sequence_collective(&self, op: i32, input: &Tensor, output: &Tensor) {
        if op == SequenceOp::Gather as i32 {
            self.comm.all_gather_into(input, output);
        } else {
            self.comm.reduce_scatter_into(input, output);
        }
    }

    fn count(&self, f: impl FnOnce(&mut CollectiveCounts)) {
        let mut c = self.counts.get();
        f(&mut c);
        self.counts.set(c);
    }
}

/// Called by the autograd nodes in `csrc/tp_regions.cpp` with a contiguous tensor to sum.
unsafe extern "C" fn reduce_callback(handle: *mut c_void, t: *mut C_tensor, kind: i32) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `handle` is `Rc::as_ptr` of a group kept alive by the model that built the graph;
        // `t` is borrowed from the caller, so it must not be freed here.
        let group = unsafe { &*(handle as *const Group) };
        let t = ManuallyDrop::new(unsafe { Tensor::from_ptr(t) });
        group.count(|c| {
            if kind == 0 {
                c.forward += 1
            } else {
                c.backward += 1
            }
        });
        group.comm.all_reduce(&t);
    }));
    if result.is_err() {
        eprintln!("flux-hpc: tensor-parallel all-reduce panicked; aborting so no rank hangs");
        std::process::abort();
    }
}

/// Called by the sequence nodes in `csrc/tp_regions.cpp` to gather or reduce-scatter.
unsafe extern "C" fn sequence_callback(
    handle: *mut c_void,
    op: i32,
    input: *mut C_tensor,
    output: *mut C_tensor,
) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as in `reduce_callback`; both tensors are borrowed from the caller.
        let group = unsafe { &*(handle as *const Group) };
        let input = ManuallyDrop::new(unsafe { Tensor::from_ptr(input) });
        let output = ManuallyDrop::new(unsafe { Tensor::from_ptr(output) });
        group.count(|c| c.sequence += 1);
        group.sequence_collective(op, &input, &output);
    }));
    if result.is_err() {
        eprintln!("flux-hpc: sequence-parallel collective panicked; aborting so no rank hangs");
        std::process::abort();
    }
}

/// Called by the float8 linears in `csrc/fp8_linear.cpp` with a contiguous amax to replace by
/// its maximum over the group.
unsafe extern "C" fn amax_callback(handle: *mut c_void, amax: *mut C_tensor) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as in `reduce_callback`.
        let group = unsafe { &*(handle as *const Group) };
        let amax = ManuallyDrop::new(unsafe { Tensor::from_ptr(amax) });
        group.count(|c| c.amax += 1);
        group.comm.all_reduce_max(&amax);
    }));
    if result.is_err() {
        eprintln!("flux-hpc: float8 amax reduction panicked; aborting so no rank hangs");
        std::process::abort();
    }
}

/// This rank's tensor-parallel group. Cheap to clone (shared).
///
/// The model must outlive any backward pass through its regions: the autograd nodes refer to the
/// group by address.
#[derive(Clone)]
pub struct TpContext {
    group: Rc<Group>,
    /// Whether activations between the parallel layers are split along the sequence
    /// (Megatron's sequence parallelism).
    sequence_parallel: bool,
}

impl std::fmt::Debug for TpContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpContext(rank {} of {}", self.rank(), self.size())?;
        if self.sequence_parallel {
            write!(f, ", sequence-parallel")?;
        }
        write!(f, ")")
    }
}

impl Default for TpContext {
    fn default() -> Self {
        Self::single()
    }
}

impl TpContext {
    /// A group of one rank: no sharding, no communication.
    pub fn single() -> Self {
        Self::new(Box::new(SingleRank))
    }

    /// The group `comm` connects.
    pub fn new(comm: Box<dyn Collective>) -> Self {
        Self {
            group: Rc::new(Group {
                comm,
                counts: Cell::default(),
            }),
            sequence_parallel: false,
        }
    }

    /// This group with sequence parallelism on or off. On, the layers outside the parallel
    /// linears (norms, modulation, residuals) act on this rank's slice of the sequence: a
    /// column-parallel linear all-gathers its input along the sequence first and a row-parallel
    /// one reduce-scatters its output, where without it they copy and all-reduce. A group of one
    /// rank ignores it.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on && self.size() > 1;
        self
    }

    /// Whether activations between the parallel layers are split along the sequence.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.comm.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.group.comm.size()
    }

    /// The group's communicator.
    pub fn collective(&self) -> &dyn Collective {
        self.group.comm.as_ref()
    }

    /// Collectives issued so far.
    pub fn counts(&self) -> CollectiveCounts {
        self.group.counts.get()
    }

    /// The callback and handle a float8 linear takes its amax maxima through; valid while this
    /// group lives (the model keeps it alive through any backward pass).
    pub(crate) fn amax_hook(&self) -> (AmaxFn, *mut c_void) {
        (amax_callback, Rc::as_ptr(&self.group) as *mut c_void)
    }

    fn region(
        &self,
        x: &Tensor,
        f: unsafe extern "C" fn(*const C_tensor, ReduceFn, *mut c_void) -> *mut C_tensor,
    ) -> Tensor {
        if self.size() == 1 {
            return x.shallow_clone();
        }
        let handle = Rc::as_ptr(&self.group) as *mut c_void;
        // SAFETY: `x` is a live tensor; the returned pointer is a new tensor we take ownership of.
        let out = unsafe { f(x.as_ptr(), reduce_callback, handle) };
        if out.is_null() {
            // SAFETY: the C++ side keeps the message alive until its next error on this thread.
            let message = unsafe { CStr::from_ptr(flux_tp_last_error()) }.to_string_lossy();
            panic!("tensor-parallel region failed: {message}");
        }
        // SAFETY: non-null pointers from the region functions are freshly allocated tensors.
        unsafe { Tensor::from_ptr(out) }
    }

    /// Entry of a column-parallel region: identity forward, all-reduce of the gradient backward.
    pub fn copy_to_region(&self, x: &Tensor) -> Tensor {
        self.region(x, flux_tp_copy_to_region)
    }

    /// Exit of a row-parallel region: all-reduce forward, identity backward.
    pub fn reduce_from_region(&self, x: &Tensor) -> Tensor {
        self.region(x, flux_tp_reduce_from_region)
    }

    fn sequence_region(&self, x: &Tensor, forward: SequenceOp, backward: SequenceOp) -> Tensor {
        // Tokens are the second-to-last dimension of every activation, `[B, L, D]`.
        let dim = x.dim() as i64 - 2;
        assert!(
            dim >= 0,
            "a sequence region needs [.., L, D], got {:?}",
            x.size()
        );
        let handle = Rc::as_ptr(&self.group) as *mut c_void;
        // SAFETY: as in `region`.
        let out = unsafe {
            flux_tp_sequence_region(
                x.as_ptr(),
                forward as i64,
                backward as i64,
                dim,
                self.rank() as i64,
                self.size() as i64,
                sequence_callback,
                handle,
            )
        };
        if out.is_null() {
            // SAFETY: as in `region`.
            let message = unsafe { CStr::from_ptr(flux_tp_last_error()) }.to_string_lossy();
            panic!("sequence-parallel region failed: {message}");
        }
        // SAFETY: as in `region`.
        unsafe { Tensor::from_ptr(out) }
    }

    /// Input `x [B, L, D]` of a column-parallel linear: all-gathered along the sequence from
    /// `[B, L/tp, D]` slices under sequence parallelism (backward: reduce-scatter of the
    /// gradient), otherwise [`TpContext::copy_to_region`].
    pub fn column_input(&self, x: &Tensor) -> Tensor {
        if self.sequence_parallel {
            self.sequence_region(x, SequenceOp::Gather, SequenceOp::ReduceScatter)
        } else {
            self.copy_to_region(x)
        }
    }

    /// Output of a row-parallel linear from this rank's partial sum `x [B, L, D]`:
    /// reduce-scattered to this rank's `[B, L/tp, D]` slice under sequence parallelism
    /// (backward: all-gather of the gradient), otherwise [`TpContext::reduce_from_region`].
    pub fn row_output(&self, x: &Tensor) -> Tensor {
        if self.sequence_parallel {
            self.sequence_region(x, SequenceOp::ReduceScatter, SequenceOp::Gather)
        } else {
            self.reduce_from_region(x)
        }
    }

    /// A replicated tensor (modulation from `[B, D]`, a row-parallel bias) applied to every
    /// rank's slice of the sequence: identity forward; under sequence parallelism the gradient,
    /// which each rank has summed over its own tokens only, is summed over the group backward.
    pub fn broadcast_over_sequence(&self, x: &Tensor) -> Tensor {
        if self.sequence_parallel {
            self.copy_to_region(x)
        } else {
            x.shallow_clone()
        }
    }

    /// This rank's slice `[B, L/tp, D]` of the sequence `x [B, L, D]`, where layers start
    /// working on slices (backward: all-gather); `x` itself without sequence parallelism.
    pub fn scatter_sequence(&self, x: &Tensor) -> Tensor {
        if self.sequence_parallel {
            self.sequence_region(x, SequenceOp::Split, SequenceOp::Gather)
        } else {
            x.shallow_clone()
        }
    }

    /// The whole sequence `[B, L, D]` from every rank's slice `x [B, L/tp, D]`, where layers
    /// stop working on slices (backward: this rank's slice of the gradient); `x` itself without
    /// sequence parallelism.
    pub fn gather_sequence(&self, x: &Tensor) -> Tensor {
        if self.sequence_parallel {
            self.sequence_region(x, SequenceOp::Gather, SequenceOp::Split)
        } else {
            x.shallow_clone()
        }
    }

    /// The streams `[B, Li, D]` joined along the sequence, in order: under sequence parallelism
    /// each is this rank's slice, and the result is this rank's slice of the joined sequence
    /// (each stream gathered, joined and split anew: slices joined as they are would interleave
    /// the streams).
    pub fn join_sequences(&self, streams: &[&Tensor]) -> Tensor {
        let whole: Vec<Tensor> = streams.iter().map(|s| self.gather_sequence(s)).collect();
        self.scatter_sequence(&Tensor::cat(&whole, -2))
    }

    /// Whether a sequence of `len` tokens splits evenly over the group (always, without
    /// sequence parallelism).
    pub fn divides_sequence(&self, len: i64) -> bool {
        !self.sequence_parallel || len % self.size() as i64 == 0
    }

    /// Sum the gradients of `params` over the group (one all-reduce per bucket), for replicated
    /// parameters whose gradients are partial on each rank.
    pub fn sum_grads(&self, params: &[Tensor]) {
        if self.size() > 1 {
            let buckets = crate::tp::all_reduce_grads(
                params,
                self.collective(),
                1.0,
                crate::tp::BUCKET_ELEMENTS,
            );
            self.group.count(|c| c.grad_sync += buckets);
        }
    }

    /// The logical tensor of `spec` assembled from every rank's `local` shard (a collective).
    pub fn gather(&self, spec: &ParamSpec, local: &Tensor) -> Tensor {
        if spec.split_dim.is_none() || self.size() == 1 {
            return local.shallow_clone();
        }
        let local = local.contiguous();
        let all = local.new_zeros(
            [local.numel() as i64 * self.size() as i64],
            (local.kind(), local.device()),
        );
        self.collective()
            .all_gather_into(&local.flatten(0, -1), &all);
        let shards: Vec<Tensor> = all
            .chunk(self.size() as i64, 0)
            .iter()
            .map(|c| c.view(local.size().as_slice()))
            .collect();
        spec.unshard(&shards)
    }
}
