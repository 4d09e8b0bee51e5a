//! Gradient buckets handed over while backward runs: a hook on each parameter
//! (`csrc/grad_ready.cpp`) reports its gradient accumulated, and a bucket whose gradients are all
//! there is given to a [`BucketSink`] (which sums, reduce-scatters, … it). Buckets are handed
//! over strictly in the order given, so every rank issues the same collectives in the same order
//! whatever order its hooks fire in; buckets backward did not complete (parameters without a
//! gradient) are handed over by [`GradHooks::flush`] after it.

use std::cell::RefCell;
use std::ffi::c_void;
use std::time::Instant;

use tch::Tensor;
use torch_sys::C_tensor;

extern "C" {
    fn flux_set_grad_ready_hook(
        param: *mut C_tensor,
        f: *mut c_void,
        handle: *mut c_void,
        index: i64,
    ) -> i32;
    fn flux_clear_grad_ready_hook(param: *mut C_tensor);
    fn flux_free_grad(param: *mut C_tensor);
}

/// Drop `param`'s gradient (`.grad = None`): its memory is freed once nothing else holds it.
pub(crate) fn free_grad(param: &Tensor) {
    // SAFETY: `param` is a live tensor.
    unsafe { flux_free_grad(param.as_ptr() as *mut C_tensor) }
}

/// What receives the buckets whose gradients are complete.
pub(crate) trait BucketSink {
    /// Bucket `bucket` (its parameters `members`, indices into `params`) has all its gradients:
    /// take them. Parameters without a gradient in this backward have an undefined `.grad`.
    fn take(&mut self, bucket: usize, members: &[usize], params: &[Tensor]);

    /// After every hook: let work in flight progress without blocking.
    fn progress(&mut self, _params: &[Tensor]) {}
}

/// When a step's bucket hand-overs ran relative to its backward pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlapReport {
    /// Seconds between the first bucket's hand-over and the end of backward (0 when none was
    /// handed over before backward ended).
    pub overlapped_s: f64,
    /// Buckets handed over before backward ended, of all buckets.
    pub started_early: usize,
    /// Buckets of the step.
    pub buckets: usize,
}

/// Hooks on parameters that hand their gradient buckets to a sink `S`.
pub(crate) struct GradHooks<S> {
    params: Vec<Tensor>,
    /// Boxed: the hooks hold its address.
    state: Box<RefCell<Hooked<S>>>,
}

struct Hooked<S> {
    params: Vec<Tensor>,
    /// Parameter indices of each bucket, in hand-over order.
    buckets: Vec<Vec<usize>>,
    bucket_of: Vec<usize>,
    ready: Vec<bool>,
    /// Per bucket: its parameters whose gradients have not been reported yet.
    waiting: Vec<usize>,
    /// The next bucket to hand over.
    next: usize,
    /// Whether this backward hands buckets over.
    armed: bool,
    first_start: Option<Instant>,
    sink: S,
}

/// Called by the hook of parameter `index`.
extern "C" fn on_ready<S: BucketSink>(handle: *mut c_void, index: i64) {
    // SAFETY: `handle` is the address of the boxed state, which outlives its hooks (removed in
    // `Drop` before the box is freed); backward runs while no other borrow of it is alive.
    let state = unsafe { &*(handle as *const RefCell<Hooked<S>>) };
    if let Ok(mut state) = state.try_borrow_mut() {
        state.ready(index as usize);
    }
}

impl<S: BucketSink> GradHooks<S> {
    /// Hook `params` (leaves requiring a gradient) to hand `buckets` (parameter indices, in
    /// hand-over order; each parameter in exactly one) to `sink`.
    pub(crate) fn new(params: Vec<Tensor>, buckets: Vec<Vec<usize>>, sink: S) -> Self {
        let mut bucket_of = vec![usize::MAX; params.len()];
        for (b, members) in buckets.iter().enumerate() {
            for &i in members {
                bucket_of[i] = b;
            }
        }
        assert!(
            bucket_of.iter().all(|&b| b != usize::MAX),
            "every hooked parameter is in a bucket"
        );
        let state = Box::new(RefCell::new(Hooked {
            params: params.iter().map(Tensor::shallow_clone).collect(),
            waiting: buckets.iter().map(Vec::len).collect(),
            buckets,
            bucket_of,
            ready: vec![false; params.len()],
            next: 0,
            armed: false,
            first_start: None,
            sink,
        }));
        let handle = &*state as *const RefCell<Hooked<S>> as *mut c_void;
        for (i, p) in params.iter().enumerate() {
            // SAFETY: `p` is a live tensor; the hook's handle is the boxed state above.
            let refused = unsafe {
                flux_set_grad_ready_hook(
                    p.as_ptr() as *mut C_tensor,
                    on_ready::<S> as *mut c_void,
                    handle,
                    i as i64,
                )
            };
            assert_eq!(
                refused, 0,
                "parameter {i} is not a leaf requiring a gradient"
            );
        }
        Self { params, state }
    }

    /// Before a backward: whether it hands buckets over (`false`: gradients just accumulate).
    pub(crate) fn arm(&mut self, active: bool) {
        let mut s = self.state.borrow_mut();
        s.armed = active;
        s.ready.iter_mut().for_each(|r| *r = false);
        let counts: Vec<usize> = s.buckets.iter().map(Vec::len).collect();
        s.waiting = counts;
        s.next = 0;
        s.first_start = None;
    }

    /// After an armed backward: hand over the buckets it did not complete, disarm, and report
    /// how the hand-overs overlapped it.
    pub(crate) fn flush(&mut self) -> OverlapReport {
        let end = Instant::now();
        let mut s = self.state.borrow_mut();
        let started_early = s.next;
        let overlapped_s = s
            .first_start
            .map_or(0.0, |t| end.saturating_duration_since(t).as_secs_f64());
        while s.next < s.buckets.len() {
            s.hand_over();
        }
        s.armed = false;
        OverlapReport {
            overlapped_s,
            started_early,
            buckets: s.buckets.len(),
        }
    }

    /// `f` run on the sink and the hooked parameters (not during backward).
    pub(crate) fn with_sink<R>(&self, f: impl FnOnce(&mut S, &[Tensor]) -> R) -> R {
        let mut s = self.state.borrow_mut();
        let Hooked { sink, params, .. } = &mut *s;
        f(sink, params)
    }
}

impl<S: BucketSink> Hooked<S> {
    fn ready(&mut self, i: usize) {
        if !self.armed {
            return;
        }
        // A leaf's gradient is accumulated once per backward; a second time would land after
        // its bucket was handed over.
        assert!(
            !self.ready[i],
            "parameter {i}'s gradient was accumulated twice in one backward"
        );
        self.ready[i] = true;
        self.waiting[self.bucket_of[i]] -= 1;
        while self.next < self.buckets.len() && self.waiting[self.next] == 0 {
            self.hand_over();
        }
        self.sink.progress(&self.params);
    }

    /// Hand the next bucket to the sink.
    fn hand_over(&mut self) {
        let b = self.next;
        self.first_start.get_or_insert_with(Instant::now);
        self.sink.take(b, &self.buckets[b], &self.params);
        self.next += 1;
    }
}

impl<S> Drop for GradHooks<S> {
    fn drop(&mut self) {
        for p in &self.params {
            // SAFETY: `p` is live; removing its hook stops calls into the state freed next.
            unsafe { flux_clear_grad_ready_hook(p.as_ptr() as *mut C_tensor) };
        }
    }
}
