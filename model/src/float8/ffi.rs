//! The float8 autograd functions of `csrc/fp8_linear.cpp`, as tch sees them.

use std::ffi::{c_void, CStr};
use std::os::raw::c_char;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::tp::AmaxFn;

extern "C" {
    pub(super) fn flux_fp8_linear(
        x: *const C_tensor,
        w: *const C_tensor,
        casts: *const i64,
        flags: i64,
        fn_: AmaxFn,
        handle: *mut c_void,
    ) -> *mut C_tensor;
    pub(super) fn flux_fp8_frozen_linear(
        x: *const C_tensor,
        data: *const C_tensor,
        scale: *const C_tensor,
    ) -> *mut C_tensor;
    fn flux_fp8_last_error() -> *const c_char;
}

/// The tensor a float8 function returned, or a panic with its error (`what` names the call).
///
/// # Safety
/// `out` must be what one of the functions above just returned on this thread.
pub(super) unsafe fn returned(out: *mut C_tensor, what: &str) -> Tensor {
    if out.is_null() {
        // SAFETY: the C++ side keeps the message alive until its next error on this thread.
        let message = unsafe { CStr::from_ptr(flux_fp8_last_error()) }.to_string_lossy();
        panic!("{what} failed: {message}");
    }
    // SAFETY: a non-null result is a freshly allocated tensor the caller now owns.
    unsafe { Tensor::from_ptr(out) }
}
