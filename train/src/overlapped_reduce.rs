//! Gradient buckets summed over the data-parallel group while backward runs
//! (`[parallelism] overlap_grad_reduce`), as PyTorch's DDP reducer and Megatron's
//! `overlap_grad_reduce` do: parameters are packed into buckets in reverse registration order
//! (about the order backward produces their gradients), a hook on each parameter
//! (`csrc/grad_ready.cpp`) reports its gradient accumulated, and a bucket whose gradients are
//! all there starts a non-blocking all-reduce. Buckets start strictly in order, so every rank
//! issues the same collectives in the same order whatever order its hooks fire in. Only the
//! last micro-batch's backward reduces; earlier ones just accumulate.

use std::cell::RefCell;
use std::ffi::c_void;
use std::time::Instant;

use flux_model::tp::{Collective, PendingSum};
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn flux_set_grad_ready_hook(
        param: *mut C_tensor,
        f: *mut c_void,
        handle: *mut c_void,
        index: i64,
    ) -> i32;
    fn flux_clear_grad_ready_hook(param: *mut C_tensor);
}

/// The parameters whose gradients are summed during backward, and the hooks on them.
pub struct OverlappedReduce<'a> {
    params: Vec<Tensor>,
    /// Boxed: the hooks hold its address.
    state: Box<RefCell<State<'a>>>,
}

/// A bucket in flight: the parameters whose gradients it holds, and its sum.
type InFlight<'a> = (Vec<usize>, Box<dyn PendingSum + 'a>);

struct State<'a> {
    dp: &'a dyn Collective,
    params: Vec<Tensor>,
    /// Parameter indices of each bucket, in the order buckets start.
    buckets: Vec<Vec<usize>>,
    bucket_of: Vec<usize>,
    ready: Vec<bool>,
    /// Per bucket: its parameters whose gradients have not been reported yet.
    waiting: Vec<usize>,
    /// The next bucket to start.
    next: usize,
    in_flight: Vec<InFlight<'a>>,
    /// Whether this backward reduces (the step's last micro-batch).
    armed: bool,
    first_start: Option<Instant>,
}

/// When a step's reductions ran relative to its backward pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlapReport {
    /// Seconds between the first bucket's start and the end of backward (0 when no bucket
    /// started before backward ended).
    pub overlapped_s: f64,
    /// Buckets started before backward ended, of all buckets.
    pub started_early: usize,
    /// Buckets of the step.
    pub buckets: usize,
}

/// Called by the hook of parameter `index`.
extern "C" fn on_ready(handle: *mut c_void, index: i64) {
    // SAFETY: `handle` is the address of the boxed state, which outlives its hooks (removed in
    // `Drop` before the box is freed); backward runs while no other borrow of it is alive.
    let state = unsafe { &*(handle as *const RefCell<State<'_>>) };
    if let Ok(mut state) = state.try_borrow_mut() {
        state.ready(index as usize);
    }
}

impl<'a> OverlappedReduce<'a> {
    /// Hook `params` (trainable leaves, in registration order) to sum their gradients over `dp`
    /// in buckets of at most `bucket_elements` (a larger gradient alone).
    pub fn new(params: Vec<Tensor>, dp: &'a dyn Collective, bucket_elements: usize) -> Self {
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut size = 0;
        for i in (0..params.len()).rev() {
            let n = params[i].numel();
            match buckets.last_mut() {
                Some(b) if size + n <= bucket_elements => {
                    b.push(i);
                    size += n;
                }
                _ => {
                    buckets.push(vec![i]);
                    size = n;
                }
            }
        }
        let mut bucket_of = vec![0; params.len()];
        for (b, members) in buckets.iter().enumerate() {
            for &i in members {
                bucket_of[i] = b;
            }
        }
        let state = Box::new(RefCell::new(State {
            dp,
            params: params.iter().map(Tensor::shallow_clone).collect(),
            waiting: buckets.iter().map(Vec::len).collect(),
            buckets,
            bucket_of,
            ready: vec![false; params.len()],
            next: 0,
            in_flight: Vec::new(),
            armed: false,
            first_start: None,
        }));
        let handle = &*state as *const RefCell<State<'_>> as *mut c_void;
        for (i, p) in params.iter().enumerate() {
            // SAFETY: `p` is a live tensor; the hook's handle is the boxed state above.
            let refused = unsafe {
                flux_set_grad_ready_hook(
                    p.as_ptr() as *mut C_tensor,
                    on_ready as *mut c_void,
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

    /// Before a micro-batch's backward: `last` arms the reduction for the step's last one.
    pub fn arm(&mut self, last: bool) {
        let mut s = self.state.borrow_mut();
        s.armed = last;
        s.ready.iter_mut().for_each(|r| *r = false);
        let counts: Vec<usize> = s.buckets.iter().map(Vec::len).collect();
        s.waiting = counts;
        s.next = 0;
        s.first_start = None;
    }

    /// After the last backward: start the buckets backward did not (parameters without a
    /// gradient this step), wait for every sum and write it into the gradients.
    pub fn finish(&mut self) -> OverlapReport {
        let end = Instant::now();
        let mut s = self.state.borrow_mut();
        let started_early = s.next;
        let overlapped_s = s
            .first_start
            .map_or(0.0, |t| end.saturating_duration_since(t).as_secs_f64());
        while s.next < s.buckets.len() {
            let b = s.next;
            s.start(b);
            s.next += 1;
        }
        s.armed = false;
        for (members, pending) in std::mem::take(&mut s.in_flight) {
            s.unpack(&members, &pending.wait());
        }
        OverlapReport {
            overlapped_s,
            started_early,
            buckets: s.buckets.len(),
        }
    }
}

impl State<'_> {
    fn ready(&mut self, i: usize) {
        if !self.armed {
            return;
        }
        // A leaf's gradient is accumulated once per backward; a second time would land after
        // its bucket was summed.
        assert!(
            !self.ready[i],
            "overlap_grad_reduce: parameter {i}'s gradient was accumulated twice in one backward"
        );
        self.ready[i] = true;
        self.waiting[self.bucket_of[i]] -= 1;
        while self.next < self.buckets.len() && self.waiting[self.next] == 0 {
            let b = self.next;
            self.start(b);
            self.next += 1;
        }
        // Move the sums in flight along; write those done back now, freeing their buffers.
        let mut still = Vec::with_capacity(self.in_flight.len());
        for (members, mut pending) in std::mem::take(&mut self.in_flight) {
            match pending.test() {
                true => self.unpack(&members, &pending.wait()),
                false => still.push((members, pending)),
            }
        }
        self.in_flight = still;
    }

    /// Write `sum` (the gradients of `members`, flattened in order) into their gradients.
    fn unpack(&self, members: &[usize], sum: &[f32]) {
        let mut offset = 0;
        for &i in members {
            let g = self.params[i].grad();
            let n = g.numel();
            // SAFETY: `sum[offset..offset + n]` is live f32 data for the whole of this block,
            // which only reads it (the copy into the gradient).
            let piece = unsafe {
                Tensor::from_blob(
                    sum[offset..].as_ptr().cast(),
                    &[n as i64],
                    &[],
                    Kind::Float,
                    Device::Cpu,
                )
            };
            tch::no_grad(|| g.shallow_clone().copy_(&piece.view(g.size().as_slice())));
            offset += n;
        }
    }

    /// Start summing bucket `b`'s gradients (those defined; every rank has the same).
    fn start(&mut self, b: usize) {
        let members: Vec<usize> = self.buckets[b]
            .iter()
            .copied()
            .filter(|&i| self.params[i].grad().defined())
            .collect();
        if members.is_empty() {
            return;
        }
        let total = members.iter().map(|&i| self.params[i].numel()).sum();
        let mut data = vec![0f32; total];
        let mut offset = 0;
        for &i in &members {
            let g = self.params[i]
                .grad()
                .to_kind(Kind::Float)
                .to_device(Device::Cpu);
            let n = g.numel();
            g.contiguous().copy_data(&mut data[offset..offset + n], n);
            offset += n;
        }
        self.first_start.get_or_insert_with(Instant::now);
        let pending = self.dp.start_all_reduce_sum(data);
        self.in_flight.push((members, pending));
    }
}

impl Drop for OverlappedReduce<'_> {
    fn drop(&mut self) {
        for p in &self.params {
            // SAFETY: `p` is live; removing its hook stops calls into the state freed next.
            unsafe { flux_clear_grad_ready_hook(p.as_ptr() as *mut C_tensor) };
        }
        // Sums still in flight complete as they drop.
        self.state.borrow_mut().in_flight.clear();
    }
}
