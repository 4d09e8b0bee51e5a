//! A hook that sees each parameter the moment it is created, while a model is built: what lets a
//! fully sharded run (`[parallelism] sharding = "full"`) take a layer's share of the masters and
//! give its weights back before the next layer exists, so a rank never holds the whole model.

use std::cell::RefCell;

use tch::Tensor;

/// What [`while_creating`] calls with each new parameter: its state-dict name
/// (`transformer.layers.3.attn.to_q.weight`) and the tensor (this rank's tensor-parallel shard).
type Hook<'h> = dyn FnMut(&str, &Tensor) + 'h;

thread_local! {
    /// The hook of the innermost [`while_creating`] on this thread, type-erased to `'static`
    /// for storage; it is only called while that call, which outlives it, is running.
    static HOOK: RefCell<Option<*mut Hook<'static>>> = const { RefCell::new(None) };
}

/// Run `build` with `hook` called on every parameter created on this thread meanwhile, after
/// it holds its initial value. Calls nest: the innermost hook sees the parameters.
pub fn while_creating<R>(mut hook: impl FnMut(&str, &Tensor), build: impl FnOnce() -> R) -> R {
    let hook: &mut Hook<'_> = &mut hook;
    // SAFETY: the pointer is erased to `'static` only to be stored; the guard below removes it
    // before `hook` goes out of scope, even if `build` panics.
    let erased: *mut Hook<'static> = unsafe { std::mem::transmute(hook as *mut Hook<'_>) };
    let outer = HOOK.with(|h| h.borrow_mut().replace(erased));
    struct Restore(Option<*mut Hook<'static>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            HOOK.with(|h| *h.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(outer);
    build()
}

/// Tell the hook of the running [`while_creating`], if any, that parameter `name` now exists.
pub(crate) fn created(name: &str, param: &Tensor) {
    let hook = HOOK.with(|h| *h.borrow());
    if let Some(hook) = hook {
        // SAFETY: set by a `while_creating` still running on this thread (it clears the slot
        // before returning), and not re-entered: a hook creates no parameters.
        unsafe { (*hook)(name, param) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hook_sees_each_creation_inside_and_none_after() {
        let mut seen = Vec::new();
        let t = Tensor::from_slice(&[1f32, 2.0]);
        let out = while_creating(
            |name, p| seen.push((name.to_string(), p.numel())),
            || {
                created("a.weight", &t);
                created("b.bias", &t);
                7
            },
        );
        created("after", &t);
        assert_eq!(out, 7);
        assert_eq!(seen, [("a.weight".into(), 2), ("b.bias".into(), 2)]);
    }

    #[test]
    fn an_inner_hook_takes_over_and_the_outer_one_returns() {
        let (mut outer, mut inner) = (0, 0);
        let t = Tensor::from_slice(&[1f32]);
        while_creating(
            |_, _| outer += 1,
            || {
                created("x", &t);
                while_creating(|_, _| inner += 1, || created("y", &t));
                created("z", &t);
            },
        );
        assert_eq!((outer, inner), (2, 1));
    }
}
