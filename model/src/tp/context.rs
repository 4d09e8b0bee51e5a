//! `TpContext`: this rank's tensor-parallel group, the region boundaries of Megatron's parallel
//! layers, and counters of the collectives they issue.

use std::cell::Cell;
use std::ffi::{c_void, CStr};
use std::mem::ManuallyDrop;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;

use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

use crate::tp::{Collective, ParamSpec, Pass, SingleRank};

type ReduceFn = unsafe extern "C" fn(handle: *mut c_void, t: *mut C_tensor, kind: i32);

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
        }
    }
}

struct Group {
    comm: Box<dyn Collective>,
    counts: Cell<CollectiveCounts>,
}

impl Group {
    fn sum_in_place(&self, t: &Tensor) {
        if t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous() {
            let n = t.numel();
            // SAFETY: `t` is a contiguous f32 CPU tensor of `n` elements that only this call uses.
            let data = unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) };
            self.comm.all_reduce_sum(data);
        } else {
            let mut buf =
                Vec::<f32>::try_from(t.to_device(Device::Cpu).to_kind(Kind::Float).flatten(0, -1))
                    .expect("f32 buffer");
            self.comm.all_reduce_sum(&mut buf);
            let summed = Tensor::from_slice(&buf)
                .view(t.size().as_slice())
                .to_kind(t.kind())
                .to_device(t.device());
            tch::no_grad(|| t.shallow_clone().copy_(&summed));
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
        group.sum_in_place(&t);
    }));
    if result.is_err() {
        eprintln!("flux-hpc: tensor-parallel all-reduce panicked; aborting so no rank hangs");
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
}

impl std::fmt::Debug for TpContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpContext(rank {} of {})", self.rank(), self.size())
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
        }
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
        let data = Vec::<f32>::try_from(
            local
                .to_device(Device::Cpu)
                .to_kind(Kind::Float)
                .flatten(0, -1),
        )
        .expect("f32 buffer");
        let mut all = vec![0f32; data.len() * self.size()];
        self.collective().all_gather(&data, &mut all);
        let shards: Vec<Tensor> = all
            .chunks(data.len())
            .map(|c| Tensor::from_slice(c).view(local.size().as_slice()))
            .collect();
        spec.unshard(&shards)
            .to_kind(local.kind())
            .to_device(local.device())
    }
}
