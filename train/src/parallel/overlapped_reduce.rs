//! Gradient buckets summed over the data-parallel group while backward runs
//! (`[parallelism] overlap_grad_reduce`), as PyTorch's DDP reducer and Megatron's
//! `overlap_grad_reduce` do: parameters are packed into buckets in reverse registration order
//! (about the order backward produces their gradients), and [`GradHooks`] hands each bucket
//! whose gradients are complete to a non-blocking all-reduce. Only the last micro-batch's
//! backward reduces; earlier ones just accumulate.

use flux_model::tp::{pack, unpack, Collective, Pending};
use tch::Tensor;

use crate::parallel::grad_hooks::{BucketSink, GradHooks, OverlapReport};

/// The parameters whose gradients are summed during backward, and the hooks on them.
pub struct OverlappedReduce<'a> {
    hooks: GradHooks<AllReduce<'a>>,
}

/// A bucket in flight: the parameters whose gradients it holds, and its sum.
type InFlight<'a> = (Vec<usize>, Box<dyn Pending + 'a>);

/// Starts each bucket's all-reduce and writes the sums back as they arrive.
struct AllReduce<'a> {
    dp: &'a dyn Collective,
    in_flight: Vec<InFlight<'a>>,
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
        let sink = AllReduce {
            dp,
            in_flight: Vec::new(),
        };
        Self {
            hooks: GradHooks::new(params, buckets, sink),
        }
    }

    /// Before a micro-batch's backward: `last` arms the reduction for the step's last one.
    pub fn arm(&mut self, last: bool) {
        self.hooks.arm(last);
    }

    /// After the last backward: start the buckets backward did not (parameters without a
    /// gradient this step), wait for every sum and write it into the gradients.
    pub fn finish(&mut self) -> OverlapReport {
        let report = self.hooks.flush();
        self.hooks.with_sink(|sink, params| {
            for (members, pending) in std::mem::take(&mut sink.in_flight) {
                unpack(&grads_of(params, &members), &pending.wait());
            }
        });
        report
    }
}

impl<'a> BucketSink for AllReduce<'a> {
    /// Start summing the bucket's gradients (those defined; every rank has the same).
    fn take(&mut self, _bucket: usize, members: &[usize], params: &[Tensor]) {
        let members: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&i| params[i].grad().defined())
            .collect();
        if members.is_empty() {
            return;
        }
        let pending = self.dp.start_all_reduce(pack(&grads_of(params, &members)));
        self.in_flight.push((members, pending));
    }

    /// Move the sums in flight along; write those done back now, freeing their buffers.
    fn progress(&mut self, params: &[Tensor]) {
        let mut still = Vec::with_capacity(self.in_flight.len());
        for (members, mut pending) in std::mem::take(&mut self.in_flight) {
            match pending.test() {
                true => unpack(&grads_of(params, &members), &pending.wait()),
                false => still.push((members, pending)),
            }
        }
        self.in_flight = still;
    }
}

/// The gradients of `params[members]`, in order.
fn grads_of(params: &[Tensor], members: &[usize]) -> Vec<Tensor> {
    members.iter().map(|&i| params[i].grad()).collect()
}
