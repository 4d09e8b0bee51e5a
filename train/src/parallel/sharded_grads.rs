//! Gradients sharded over the data-parallel group (ZeRO-2, `[parallelism] sharding =
//! "gradients"`): each replica keeps f32 sums of only the gradient parts it owns.
//!
//! Each micro-batch's backward hands every bucket whose gradients are complete (by
//! [`GradHooks`], in reverse bucket order, about the order backward produces them) to a
//! non-blocking reduce-scatter of an f32 copy of them, and drops the bucket's full gradients at
//! once, so that a replica never holds more than the buckets backward is still filling. The
//! reduce-scatter travels while backward goes on; this rank adds the sum of its share into its
//! `[owned]` f32 gradient shard when it arrives, and at the latest before the next bucket starts
//! (one bucket in flight at a time) or when backward ends. The buckets of parameters that the
//! tensor-parallel group sums after backward ([`flux_model::tp::ShardedStore::finish_grads`])
//! are reduced after it.
//! Under HSDP the reduce-scatters run within the shard group, and one all-reduce of the shard
//! over the other groups completes the sums after the step's last backward. Between steps the
//! shard holds no memory (as PyTorch's `zero_grad(set_to_none=True)`).

use flux_model::execution::residency::{fill_storage, release_storage, storage_present};
use flux_model::tp::{Collective, Pending};
use tch::{Kind, Tensor};

use std::rc::Rc;

use crate::parallel::grad_hooks::{free_grad, BucketSink, GradHooks, OverlapReport};
use crate::parallel::shard_layout::{
    flat_bucket_grads, reduce_scatter_bucket, sum_over, Bucket, ShardLayout,
};
use crate::parallel::sharded_params::ShardedParams;

/// This rank's share of the summed gradients, and the hooks that fill it during backward.
pub(crate) struct GradShard<'a> {
    /// `[owned]` f32: the summed gradients of the parts this rank owns, laid out as the
    /// optimizer state.
    sum: Tensor,
    /// The buckets handed over during backward: all but `late`.
    hooks: Option<GradHooks<ReduceScatter<'a>>>,
    /// Buckets (indices into the layout) reduced after `finish_grads`.
    late: Vec<usize>,
    /// Whether each parameter got a gradient in this step.
    got: Vec<bool>,
}

/// Reduce-scatters each bucket handed over into the shard.
struct ReduceScatter<'a> {
    dp: &'a dyn Collective,
    /// The bucket (index into the layout) whose reduce-scatter is travelling, if any.
    in_flight: Option<(usize, Box<dyn Pending + 'a>)>,
    layout: ShardLayout,
    /// Layout bucket of each hand-over position.
    order: Vec<usize>,
    sum: Tensor,
    /// Parameters whose gradient a hand-over saw defined since the step began.
    got: Vec<bool>,
    /// Under `sharding = "full"`: the weights given back once their bucket is reduced.
    residency: Option<Rc<ShardedParams<'a>>>,
}

/// Reduce-scatter bucket `b` of `params` and add this rank's share of the sum into the owned
/// parts of `sum`; then drop the bucket's full gradients, marking in `got` the parameters that
/// had one.
fn reduce_into(
    sum: &Tensor,
    params: &[Tensor],
    layout: &ShardLayout,
    b: &Bucket,
    dp: &dyn Collective,
    got: &mut [bool],
) {
    let summed = reduce_scatter_bucket(params, layout, b, dp);
    add_share(sum, b, &summed);
    drop_grads(params, b, got);
}

/// Add `summed`, this rank's `[share]` of bucket `b`'s summed gradients, into the owned parts of
/// `sum`.
fn add_share(sum: &Tensor, b: &Bucket, summed: &Tensor) {
    ensure_zeroed(sum);
    tch::no_grad(|| {
        for s in &b.segments {
            let share = summed.narrow(0, s.in_share as i64, s.len as i64);
            let _ = sum
                .narrow(0, s.in_state as i64, s.len as i64)
                .g_add_(&share.to_device(sum.device()));
        }
    });
}

/// Drop bucket `b`'s full gradients, marking in `got` the parameters that had one.
fn drop_grads(params: &[Tensor], b: &Bucket, got: &mut [bool]) {
    for p in b.params.clone() {
        if params[p].grad().defined() {
            got[p] = true;
            free_grad(&params[p]);
        }
    }
}

/// Give `sum` memory again, all zeros, if [`GradShard::zero`] gave it back.
fn ensure_zeroed(sum: &Tensor) {
    if !storage_present(sum) {
        let zero = Tensor::zeros([1], (Kind::Float, sum.device()));
        fill_storage(sum, &zero.expand([sum.numel() as i64], false));
    }
}

impl ReduceScatter<'_> {
    /// Wait for the reduce-scatter in flight, if any, and add its share into the shard.
    fn land(&mut self) {
        if let Some((index, pending)) = self.in_flight.take() {
            add_share(&self.sum, &self.layout.buckets[index], &pending.wait());
        }
    }
}

impl BucketSink for ReduceScatter<'_> {
    /// Land the bucket before, then start this one's reduce-scatter and drop its gradients.
    fn take(&mut self, position: usize, _members: &[usize], params: &[Tensor]) {
        self.land();
        let index = self.order[position];
        let b = &self.layout.buckets[index];
        let flat = flat_bucket_grads(params, &self.layout, b, self.dp.size());
        drop_grads(params, b, &mut self.got);
        self.in_flight = Some((index, self.dp.start_reduce_scatter(flat)));
        if let Some(residency) = &self.residency {
            residency.release_bucket(index);
        }
    }

    /// Land the reduce-scatter in flight once it has arrived.
    fn progress(&mut self, _params: &[Tensor]) {
        if self.in_flight.as_mut().is_some_and(|(_, p)| p.test()) {
            self.land();
        }
    }
}

impl<'a> GradShard<'a> {
    /// The gradient shard of `params` (leaves; those before index `early` are reduced during
    /// backward, the rest after `finish_grads`) laid out by `layout`, on `device`; under
    /// `sharding = "full"` giving back each bucket's weights through `residency` once reduced.
    pub(crate) fn new(
        params: &[Tensor],
        early: usize,
        layout: &ShardLayout,
        dp: &'a dyn Collective,
        residency: Option<Rc<ShardedParams<'a>>>,
        device: tch::Device,
    ) -> Self {
        let sum = Tensor::zeros([layout.owned as i64], (Kind::Float, device));
        let (hooked, late): (Vec<usize>, Vec<usize>) =
            (0..layout.buckets.len()).partition(|&b| layout.buckets[b].params.end <= early);
        let order: Vec<usize> = hooked.into_iter().rev().collect();
        let hooks = (!order.is_empty()).then(|| {
            let buckets = order
                .iter()
                .map(|&b| layout.buckets[b].params.clone().collect())
                .collect();
            let sink = ReduceScatter {
                dp,
                in_flight: None,
                layout: layout.clone(),
                order,
                sum: sum.shallow_clone(),
                got: vec![false; early],
                residency,
            };
            let params = params[..early].iter().map(Tensor::shallow_clone).collect();
            GradHooks::new(params, buckets, sink)
        });
        Self {
            sum,
            hooks,
            late,
            got: vec![false; params.len()],
        }
    }

    /// Before each micro-batch's backward: every backward reduces.
    pub(crate) fn arm(&mut self) {
        if let Some(hooks) = &mut self.hooks {
            hooks.arm(true);
        }
    }

    /// After each micro-batch's backward: reduce the buckets it did not complete, and land every
    /// reduce-scatter.
    pub(crate) fn flush(&mut self) -> Option<OverlapReport> {
        let hooks = self.hooks.as_mut()?;
        let report = hooks.flush();
        hooks.with_sink(|sink, _| sink.land());
        Some(report)
    }

    /// After `finish_grads`: reduce the late buckets into the shard (over `shard`, the group
    /// the layout shards over) and complete the sums over `across` (the other shard groups).
    /// Which parameters had a gradient this step.
    pub(crate) fn finish(
        &mut self,
        params: &[Tensor],
        layout: &ShardLayout,
        shard: &dyn Collective,
        across: &dyn Collective,
    ) -> Vec<bool> {
        for &b in &self.late {
            let bucket = &layout.buckets[b];
            reduce_into(&self.sum, params, layout, bucket, shard, &mut self.got);
        }
        ensure_zeroed(&self.sum);
        sum_over(&self.sum, across);
        if let Some(hooks) = &self.hooks {
            hooks.with_sink(|sink, _| {
                for (got, early) in self.got.iter_mut().zip(&sink.got) {
                    *got |= early;
                }
            });
        }
        self.got.clone()
    }

    /// The `[owned]` f32 gradient sums.
    pub(crate) fn sum(&self) -> &Tensor {
        &self.sum
    }

    /// Bytes the sums hold now (none between steps).
    pub(crate) fn bytes(&self) -> u64 {
        match storage_present(&self.sum) {
            true => (self.sum.numel() * 4) as u64,
            false => 0,
        }
    }

    /// Clear the sums for the next step: their memory is given back until the next backward
    /// reduces into them.
    pub(crate) fn zero(&mut self) {
        release_storage(&self.sum);
        self.got.iter_mut().for_each(|g| *g = false);
        if let Some(hooks) = &self.hooks {
            hooks.with_sink(|sink, _| sink.got.iter_mut().for_each(|g| *g = false));
        }
    }
}
