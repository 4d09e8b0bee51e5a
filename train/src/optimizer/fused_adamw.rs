//! The Rust side of `csrc/fused_adamw.cpp`: one call updates many tensors with libtorch's fused
//! AdamW kernel (one pass over each tensor per step, on CPU and CUDA alike).

use std::ffi::CStr;
use std::os::raw::c_char;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::config::sections::OptimizationConfig;

extern "C" {
    fn flux_fused_adamw(
        params: *const *const C_tensor,
        grads: *const *const C_tensor,
        exp_avgs: *const *const C_tensor,
        exp_avg_sqs: *const *const C_tensor,
        steps: *const *const C_tensor,
        n: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> i32;
    fn flux_fused_adamw_error() -> *const c_char;
}

/// AdamW's hyper-parameters for one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hyper {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Decoupled weight decay (0 for biases and norm scales).
    pub weight_decay: f64,
    /// Added to the denominator.
    pub eps: f64,
}

impl Hyper {
    /// The hyper-parameters `config` sets at learning rate `lr`, with weight decay only for
    /// parameters that `decay` (weights, not biases or norm scales).
    pub(crate) fn adamw(config: &OptimizationConfig, lr: f64, decay: bool) -> Self {
        Self {
            lr,
            beta1: config.beta1,
            beta2: config.beta2,
            weight_decay: if decay { config.weight_decay } else { 0.0 },
            eps: config.epsilon,
        }
    }
}

/// Update every `params[i]` (f32) in place from `grads[i]` (f32, same shape and device) and its
/// moments, at optimizer step `step` (a scalar f32 tensor on the same device, already counting
/// this step): `p ← p·(1 − lr·wd) − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`.
///
/// Panics with libtorch's message when the tensors do not fit together (a bug, not bad input).
pub(crate) fn fused_adamw(
    params: &[&Tensor],
    grads: &[Tensor],
    exp_avgs: &[&Tensor],
    exp_avg_sqs: &[&Tensor],
    step: &Tensor,
    h: Hyper,
) {
    let n = params.len();
    assert!(grads.len() == n && exp_avgs.len() == n && exp_avg_sqs.len() == n);
    let ptrs = |ts: &[&Tensor]| ts.iter().map(|t| t.as_ptr()).collect::<Vec<_>>();
    let grads: Vec<&Tensor> = grads.iter().collect();
    let steps = vec![step.as_ptr(); n];
    let (p, g, m, v) = (
        ptrs(params),
        ptrs(&grads),
        ptrs(exp_avgs),
        ptrs(exp_avg_sqs),
    );
    // SAFETY: every pointer is a live tensor borrowed for the duration of the call; the kernel
    // writes only into the tensors' storage.
    let status = unsafe {
        flux_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            steps.as_ptr(),
            n as i64,
            h.lr,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
        )
    };
    if status != 0 {
        // SAFETY: the bridge returns a NUL-terminated thread-local string.
        let message = unsafe { CStr::from_ptr(flux_fused_adamw_error()) };
        panic!("fused AdamW: {}", message.to_string_lossy());
    }
}
