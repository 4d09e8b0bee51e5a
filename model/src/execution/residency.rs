//! Where a layer's parameters live between its uses. The framework runs each layer of a model
//! through [`run_layer`] (from [`crate::execution::Layers`]), and the parameters before and after
//! the layers as the units [`STEM`] and [`HEAD`]; by default that only applies activation
//! recomputation, but a training loop that shards the parameters themselves (ZeRO-3,
//! `[parallelism] sharding = "full"`) installs a [`LayerParams`] that gathers a unit's weights
//! just before it runs, gives their memory back after it, and gathers them again when backward
//! reaches the unit (`csrc/residency.cpp`).

use std::ffi::{c_void, CStr};
use std::os::raw::c_char;
use std::sync::Mutex;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::execution::recompute::recompute;
use crate::tp::Pass;

extern "C" {
    fn flux_release_storage(t: *mut C_tensor);
    fn flux_storage_present(t: *mut C_tensor) -> i32;
    fn flux_fill_storage(t: *mut C_tensor, src: *mut C_tensor) -> i32;
    fn flux_on_grad(
        t: *mut C_tensor,
        f: *mut c_void,
        handle: *mut c_void,
        drop: *mut c_void,
    ) -> i32;
    fn flux_residency_last_error() -> *const c_char;
}

/// Give back the memory of `t` (a parameter): its shape, autograd identity and views stay, its
/// data must not be read until [`fill_storage`].
pub fn release_storage(t: &Tensor) {
    // SAFETY: `t` is a live tensor.
    unsafe { flux_release_storage(t.as_ptr() as *mut C_tensor) }
}

/// Whether `t`'s memory is present (not given back by [`release_storage`]).
pub fn storage_present(t: &Tensor) -> bool {
    // SAFETY: `t` is a live tensor.
    unsafe { flux_storage_present(t.as_ptr() as *mut C_tensor) != 0 }
}

/// Allocate `t`'s memory again if it was given back and copy `src` (as many elements, any dtype
/// and device) into it, invisibly to autograd: graphs that saved `t` still accept it.
pub fn fill_storage(t: &Tensor, src: &Tensor) {
    // SAFETY: both are live tensors.
    let rc =
        unsafe { flux_fill_storage(t.as_ptr() as *mut C_tensor, src.as_ptr() as *mut C_tensor) };
    if rc != 0 {
        // SAFETY: the C++ side keeps the message alive until its next error on this thread.
        let message = unsafe { CStr::from_ptr(flux_residency_last_error()) }.to_string_lossy();
        panic!("filling a parameter failed: {message}");
    }
}

/// The unit of the parameters declared before a model's first `#[layers]` field (the embedders
/// of latents, text and conditioning): gathered when the model's forward pass starts, released
/// when its first layers start.
pub const STEM: &str = "stem";

/// The unit of the parameters declared after a model's last `#[layers]` field (the output
/// layer): gathered when its last layers end, released when the forward pass returns.
pub const HEAD: &str = "head";

/// The layer a parameter belongs to: its name up to and including the first all-digit component
/// (`transformer.layers.3.attn.to_q.weight` → `transformer.layers.3`), or `None` outside layers.
fn layer_of(name: &str) -> Option<&str> {
    let mut end = 0;
    for part in name.split('.') {
        end += part.len();
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return Some(&name[..end]);
        }
        end += 1;
    }
    None
}

/// The unit each parameter of `names` (a model's state-dict names, in spec order) is gathered
/// and released with: its layer ([`layer_of`]), or outside layers [`STEM`] before the first
/// layer's parameters and [`HEAD`] after them.
pub fn units<'n>(names: &[&'n str]) -> Vec<&'n str> {
    let first = names.iter().position(|n| layer_of(n).is_some());
    names
        .iter()
        .enumerate()
        .map(|(i, n)| match layer_of(n) {
            Some(layer) => layer,
            None if first.is_none_or(|f| i < f) => STEM,
            None => HEAD,
        })
        .collect()
}

/// The units a forward pass runs: [`STEM`], then `layers`, then [`HEAD`] (what
/// [`crate::DiffusionModel::layers`] lists).
pub fn stem_layers_head(layers: impl IntoIterator<Item = String>) -> Vec<String> {
    std::iter::once(STEM.to_string())
        .chain(layers)
        .chain([HEAD.to_string()])
        .collect()
}

/// What a training loop that shards parameters does around each layer. `layer` is the
/// state-dict prefix of the layer's parameters (`transformer.layers.3`).
pub trait LayerParams {
    /// Make the layer's parameters present: before its forward pass (`Pass::Forward`), and
    /// again when backward is about to reach it (`Pass::Backward`).
    fn gather(&self, layer: &str, pass: Pass);
    /// The layer's forward pass is done: its parameters may go.
    fn release(&self, layer: &str);
}

/// The installed [`LayerParams`], as an address: hooks may run on autograd's threads.
struct Installed(*const (dyn LayerParams + 'static));

// SAFETY: the address is only dereferenced while `install`'s guard keeps the value alive, by
// forward and backward passes the installing thread is driving (never concurrently).
unsafe impl Send for Installed {}

static INSTALLED: Mutex<Option<Installed>> = Mutex::new(None);

/// Uninstalls the [`LayerParams`] given to [`install`] when dropped.
pub struct Installation(());

impl Drop for Installation {
    fn drop(&mut self) {
        *INSTALLED.lock().expect("residency lock") = None;
    }
}

/// Route every [`run_layer`] through `params` until the returned guard is dropped. `params`
/// must outlive the guard and every graph built while it is installed must be back-propagated
/// or dropped before the guard goes.
///
/// # Safety
/// The caller keeps `params` alive and unmoved until the guard is dropped.
pub unsafe fn install(params: &dyn LayerParams) -> Installation {
    // SAFETY: the lifetime is erased; the caller's promise keeps the address valid while it is
    // installed.
    let erased: *const (dyn LayerParams + 'static) = unsafe { std::mem::transmute(params) };
    *INSTALLED.lock().expect("residency lock") = Some(Installed(erased));
    Installation(())
}

/// Run `f` with the installed [`LayerParams`], if any.
fn with_installed(f: impl FnOnce(&dyn LayerParams)) {
    let installed = INSTALLED.lock().expect("residency lock");
    if let Some(Installed(p)) = &*installed {
        // SAFETY: `install`'s contract keeps it alive while installed.
        f(unsafe { &**p });
    }
}

/// Called by the gradient hook of a layer output: gather that layer again.
extern "C" fn regather(handle: *mut c_void) {
    // SAFETY: the handle is the boxed layer name `on_backward` made, alive until `drop_name`.
    let layer = unsafe { &*(handle as *const String) };
    with_installed(|p| p.gather(layer, Pass::Backward));
}

extern "C" fn drop_name(handle: *mut c_void) {
    // SAFETY: made by `Box::into_raw` in `on_backward`; libtorch drops each hook once.
    drop(unsafe { Box::from_raw(handle as *mut String) });
}

/// Whether a [`LayerParams`] is installed.
pub(crate) fn installed() -> bool {
    INSTALLED.lock().expect("residency lock").is_some()
}

/// Make `unit`'s parameters present for its forward pass, when a [`LayerParams`] is installed.
pub(crate) fn gather(unit: &str) {
    with_installed(|p| p.gather(unit, Pass::Forward));
}

/// `unit`'s forward pass is done: release its parameters, and gather them again when backward
/// reaches any of `outputs` (what the unit computed), when a [`LayerParams`] is installed.
pub(crate) fn release(unit: &str, outputs: &[&Tensor]) {
    if installed() {
        with_installed(|p| p.release(unit));
        on_backward(unit, outputs);
    }
}

/// Hooks on `outputs` of `layer` that gather its parameters when backward reaches them.
pub(crate) fn on_backward(layer: &str, outputs: &[&Tensor]) {
    for t in outputs.iter().filter(|t| t.requires_grad()) {
        let handle = Box::into_raw(Box::new(layer.to_string())) as *mut c_void;
        // SAFETY: `t` is live; the hook owns `handle` and frees it with `drop_name`.
        let rc = unsafe {
            flux_on_grad(
                t.as_ptr() as *mut C_tensor,
                regather as *mut c_void,
                handle,
                drop_name as *mut c_void,
            )
        };
        debug_assert_eq!(rc, 0, "the output requires a gradient");
    }
}

/// Run layer `layer` (its parameters' state-dict prefix) on `inputs`, giving `n_out` outputs:
/// `f` is the layer's forward pass. With `recompute`, its activations are recomputed in the
/// backward pass ([`recompute`]; `f` must then be deterministic and everything it refers to must
/// live until backward). With a [`LayerParams`] installed, its parameters are gathered before
/// and released after, and gathered again before backward reaches the layer.
pub(crate) fn run_layer(
    layer: &str,
    inputs: &[&Tensor],
    n_out: usize,
    recomputing: bool,
    f: impl Fn(&[Tensor]) -> Vec<Tensor> + 'static,
) -> Vec<Tensor> {
    gather(layer);
    let outputs = match recomputing {
        true => recompute(inputs, n_out, f),
        false => f(&inputs.iter().map(|t| t.shallow_clone()).collect::<Vec<_>>()),
    };
    release(layer, &outputs.iter().collect::<Vec<_>>());
    outputs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_is_the_name_through_its_index() {
        assert_eq!(
            layer_of("transformer.layers.3.attn.to_q.weight"),
            Some("transformer.layers.3")
        );
        assert_eq!(layer_of("blocks.12.mlp.fc1.bias"), Some("blocks.12"));
        assert_eq!(layer_of("x_embedder.weight"), None);
        assert_eq!(layer_of("a.b2.c"), None);
    }

    #[test]
    fn parameters_outside_layers_fall_in_the_stem_or_the_head() {
        let names = [
            "x_embedder.weight",
            "blocks.0.fc.weight",
            "blocks.1.fc.weight",
            "final.weight",
        ];
        assert_eq!(units(&names), [STEM, "blocks.0", "blocks.1", HEAD]);
        assert_eq!(units(&["a.weight", "b.weight"]), [STEM, STEM]);
    }
}
