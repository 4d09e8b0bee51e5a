//! Activation recomputation: run a block without keeping its activations, and run it again in
//! the backward pass (`csrc/recompute.cpp`). Memory per block drops to its inputs; compute grows
//! by one extra forward pass.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::mem::ManuallyDrop;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

use tch::Tensor;
use torch_sys::C_tensor;

/// A block's computation: inputs → outputs. It must compute the same function both times it runs
/// (no dropout), and everything it refers to must live until the backward pass.
pub type BlockFn = Box<dyn Fn(&[Tensor]) -> Vec<Tensor>>;

type Callback =
    unsafe extern "C" fn(*mut c_void, *const *const C_tensor, i64, *mut *mut C_tensor, i64, i32);

extern "C" {
    fn flux_recompute(
        inputs: *const *const C_tensor,
        n_in: i64,
        f: Callback,
        handle: *mut c_void,
        outputs: *mut *mut C_tensor,
        n_out: i64,
    ) -> i32;
    fn flux_recompute_last_error() -> *const c_char;
}

thread_local! {
    /// Blocks whose backward pass has not run yet, by handle.
    static PENDING: RefCell<HashMap<usize, BlockFn>> = RefCell::new(HashMap::new());
    static NEXT: Cell<usize> = const { Cell::new(1) };
}

/// Called by the autograd node: run block `handle` on borrowed `inputs`, hand back owned outputs.
unsafe extern "C" fn callback(
    handle: *mut c_void,
    inputs: *const *const C_tensor,
    n_in: i64,
    outputs: *mut *mut C_tensor,
    n_out: i64,
    last: i32,
) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let id = handle as usize;
        // SAFETY: the node passes `n_in` live tensors that it keeps owning.
        let args: Vec<Tensor> = (0..n_in as usize)
            .map(|i| {
                ManuallyDrop::new(unsafe { Tensor::from_ptr(*inputs.add(i) as *mut C_tensor) })
                    .shallow_clone()
            })
            .collect();
        let block = PENDING
            .with(|p| p.borrow_mut().remove(&id))
            .expect("recomputed block is pending");
        let outs = block(&args);
        if last == 0 {
            PENDING.with(|p| p.borrow_mut().insert(id, block));
        }
        assert_eq!(
            outs.len(),
            n_out as usize,
            "block returned the wrong number of outputs"
        );
        for (i, mut t) in outs.into_iter().enumerate() {
            // SAFETY: the node takes ownership of each pointer (and deletes it).
            unsafe { *outputs.add(i) = t.as_mut_ptr() };
            std::mem::forget(t);
        }
    }));
    if result.is_err() {
        eprintln!("flux-hpc: a recomputed block panicked; aborting");
        std::process::abort();
    }
}

/// Run `block` on `inputs` through a recomputing autograd node; returns its `n_out` outputs.
/// Gradients flow to the inputs and to every parameter the block uses.
pub fn recompute(
    inputs: &[&Tensor],
    n_out: usize,
    block: impl Fn(&[Tensor]) -> Vec<Tensor> + 'static,
) -> Vec<Tensor> {
    let block: BlockFn = Box::new(block);
    let id = NEXT.with(|n| {
        let id = n.get();
        n.set(id + 1);
        id
    });
    PENDING.with(|p| p.borrow_mut().insert(id, block));
    let ptrs: Vec<*const C_tensor> = inputs.iter().map(|t| t.as_ptr()).collect();
    let mut outs = vec![std::ptr::null_mut(); n_out];
    // SAFETY: pointers are to live tensors; on success the node fills `outs` with new tensors.
    let rc = unsafe {
        flux_recompute(
            ptrs.as_ptr(),
            ptrs.len() as i64,
            callback,
            id as *mut c_void,
            outs.as_mut_ptr(),
            n_out as i64,
        )
    };
    if rc != 0 {
        PENDING.with(|p| p.borrow_mut().remove(&id));
        // SAFETY: the C++ side keeps the message alive until its next error on this thread.
        let message = unsafe { CStr::from_ptr(flux_recompute_last_error()) }.to_string_lossy();
        panic!("recomputed block failed: {message}");
    }
    // SAFETY: each pointer is a freshly allocated tensor we now own.
    outs.into_iter()
        .map(|p| unsafe { Tensor::from_ptr(p) })
        .collect()
}

/// Drop blocks of graphs that were never back-propagated; call between training steps.
pub fn clear_pending() {
    PENDING.with(|p| p.borrow_mut().clear());
}
