//! How the trained parameters fall into buckets and each bucket into the equal shares the
//! data-parallel ranks own (`[parallelism] sharding`), and a bucket's gradients reduce-scattered
//! into the share of this rank.
//!
//! Parameters are grouped into buckets of consecutive parameters (`[parallelism] bucket_mib`, a
//! larger parameter alone); each bucket, laid end to end and padded, is cut into equal contiguous
//! shares, and data-parallel rank `r` owns share `r` of every bucket.

use std::ops::Range;

use flux_model::execution::residency::units;
use flux_model::tp::{Collective, GradSync, ParamSpec};
use tch::{Device, Kind, Tensor};

use crate::config::run_config::Sharding;

/// The part of one parameter in this rank's share of its bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Index of the parameter.
    pub(crate) param: usize,
    /// First element of the part among the parameter's (flattened) elements.
    pub(crate) in_param: usize,
    /// Where the part starts in this rank's share of the bucket.
    pub(crate) in_share: usize,
    /// Where the part starts in this rank's optimizer state (its parts end to end).
    pub(crate) in_state: usize,
    /// Elements in the part.
    pub(crate) len: usize,
}

/// Consecutive parameters reduced and gathered together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// The parameters, by index.
    pub(crate) params: Range<usize>,
    /// Elements per share: the bucket's elements padded to `share · ranks`.
    pub(crate) share: usize,
    /// The parts of its parameters this rank owns, in order.
    pub(crate) segments: Vec<Segment>,
}

/// How parameters of `numels` elements fall into buckets and shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardLayout {
    pub(crate) numels: Vec<usize>,
    pub(crate) buckets: Vec<Bucket>,
    /// Elements of this rank's optimizer state (the lengths of all its segments).
    pub(crate) owned: usize,
}

impl ShardLayout {
    /// Parameters of `numels` elements in buckets of at most `cap` elements (a larger parameter
    /// alone; no bucket holds parameters on both sides of any index in `splits`), each cut into
    /// `ranks` shares, seen from rank `rank`.
    pub(crate) fn new(
        numels: Vec<usize>,
        cap: usize,
        ranks: usize,
        rank: usize,
        splits: &[usize],
    ) -> Self {
        let mut buckets = Vec::new();
        let mut owned = 0;
        let mut first = 0;
        while first < numels.len() {
            let (mut end, mut total) = (first, 0);
            while end < numels.len()
                && (end == first || (total + numels[end] <= cap && !splits.contains(&end)))
            {
                total += numels[end];
                end += 1;
            }
            let share = total.div_ceil(ranks).max(1);
            let (lo, hi) = (rank * share, (rank + 1) * share);
            let mut segments = Vec::new();
            let mut start = 0;
            for (param, &n) in numels.iter().enumerate().take(end).skip(first) {
                let (from, to) = (start.max(lo), (start + n).min(hi));
                if from < to {
                    segments.push(Segment {
                        param,
                        in_param: from - start,
                        in_share: from - lo,
                        in_state: owned,
                        len: to - from,
                    });
                    owned += to - from;
                }
                start += n;
            }
            buckets.push(Bucket {
                params: first..end,
                share,
                segments,
            });
            first = end;
        }
        Self {
            numels,
            buckets,
            owned,
        }
    }

    pub(crate) fn segments(&self) -> impl Iterator<Item = &Segment> {
        self.buckets.iter().flat_map(|b| b.segments.iter())
    }
}

/// The trained parameters in the order the optimizer keeps them, cut into buckets and shares:
/// one answer for the optimizer ([`crate::ShardedAdamW`]), the build of a fully sharded model
/// and the memory plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParamOrder {
    /// The spec index of each parameter, in the optimizer's order: spec order, except that
    /// under sharded gradients with tensor parallelism the gradients the tensor-parallel group
    /// sums after backward come last, in buckets of their own (they are reduced after it).
    pub(crate) spec_of: Vec<usize>,
    /// How many parameters precede those.
    pub(crate) early: usize,
    /// The unit each parameter is gathered with under `"full"` (its layer, or the stem or head
    /// around the layers: [`units`]).
    pub(crate) unit: Vec<String>,
    /// The buckets (under `"full"`, each unit's parameters in buckets of their own) and this
    /// rank's shares.
    pub(crate) layout: ShardLayout,
}

impl ParamOrder {
    /// The parameters of `specs` (a rank's, at tensor-parallel size `tp`) sharded at `level`
    /// over `ranks` replicas, in buckets of at most `cap` elements, seen from `rank`.
    pub(crate) fn new(
        specs: &[ParamSpec],
        tp: usize,
        level: Sharding,
        cap: usize,
        ranks: usize,
        rank: usize,
    ) -> Self {
        let shard_grads = matches!(level, Sharding::Gradients | Sharding::Full);
        let late =
            |i: &usize| shard_grads && tp > 1 && specs[*i].grad_sync == GradSync::SumOverGroup;
        let (mut spec_of, late): (Vec<usize>, Vec<usize>) =
            (0..specs.len()).partition(|i| !late(i));
        let early = spec_of.len();
        spec_of.extend(late);
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        let of_spec = units(&names);
        let unit: Vec<String> = spec_of.iter().map(|&i| of_spec[i].to_string()).collect();
        let mut splits = vec![early];
        if level == Sharding::Full {
            splits.extend((1..spec_of.len()).filter(|&i| unit[i] != unit[i - 1]));
        }
        let numels = spec_of
            .iter()
            .map(|&i| specs[i].local_numel() as usize)
            .collect();
        Self {
            layout: ShardLayout::new(numels, cap, ranks, rank, &splits),
            spec_of,
            early,
            unit,
        }
    }
}

/// A zero f32 tensor of `n` elements on `device`.
fn zeros(n: usize, device: Device) -> Tensor {
    Tensor::zeros([n as i64], (Kind::Float, device))
}

/// Bucket `b`'s gradients (`params[p].grad()` for the bucket's parameters, zeros where
/// undefined) end to end in f32, padded to `share · ranks`: `[share · ranks]` on the parameters'
/// device, what a reduce-scatter over `ranks` takes.
pub(crate) fn flat_bucket_grads(
    params: &[Tensor],
    layout: &ShardLayout,
    b: &Bucket,
    ranks: usize,
) -> Tensor {
    let device = params[b.params.start].device();
    let mut flat: Vec<Tensor> = b
        .params
        .clone()
        .map(|p| {
            let g = params[p].grad();
            match g.defined() {
                true => g.to_kind(Kind::Float).flatten(0, -1),
                false => zeros(layout.numels[p], device),
            }
        })
        .collect();
    let total: usize = b.params.clone().map(|p| layout.numels[p]).sum();
    flat.push(zeros(b.share * ranks - total, device));
    Tensor::cat(&flat, 0)
}

/// The sum over `dp` of this rank's share of bucket `b`'s gradients ([`flat_bucket_grads`]):
/// `[share]` f32 on the parameters' device, a reduce-scatter.
pub(crate) fn reduce_scatter_bucket(
    params: &[Tensor],
    layout: &ShardLayout,
    b: &Bucket,
    dp: &dyn Collective,
) -> Tensor {
    let flat = flat_bucket_grads(params, layout, b, dp.size());
    let summed = zeros(b.share, flat.device());
    dp.reduce_scatter_into(&flat, &summed);
    summed
}

/// This rank's `parts` of bucket `b` (one tensor per segment, any dtype) laid out as its share:
/// `[share]` of `kind` on `device`, zero where the share is padding.
pub(crate) fn local_share(b: &Bucket, parts: &[Tensor], device: Device, kind: Kind) -> Tensor {
    let share = Tensor::zeros([b.share as i64], (kind, device));
    for (s, part) in b.segments.iter().zip(parts) {
        share
            .narrow(0, s.in_share as i64, s.len as i64)
            .copy_(&part.to_device(device).to_kind(kind));
    }
    share
}

/// Every rank's `parts` of bucket `b` (this rank's, one tensor per segment, any dtype),
/// all-gathered over `group`: the bucket's elements end to end, `[share · ranks]` f32 on
/// `device`.
pub(crate) fn gather_bucket(
    b: &Bucket,
    parts: &[Tensor],
    group: &dyn Collective,
    device: Device,
) -> Tensor {
    gather_share(&local_share(b, parts, device, Kind::Float), group)
}

/// Every rank's `share` (`[share]`, from [`local_share`]) all-gathered over `group`, in rank
/// order, in the share's dtype on its device.
pub(crate) fn gather_share(share: &Tensor, group: &dyn Collective) -> Tensor {
    let full = share.new_zeros(
        [(share.numel() * group.size()) as i64],
        (share.kind(), share.device()),
    );
    group.all_gather_into(share, &full);
    full
}

/// Sum `t` (f32, on any device) elementwise over `group`, in place.
pub(crate) fn sum_over(t: &Tensor, group: &dyn Collective) {
    if group.size() > 1 {
        group.all_reduce(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(param: usize, in_param: usize, in_share: usize, in_state: usize, len: usize) -> Segment {
        Segment {
            param,
            in_param,
            in_share,
            in_state,
            len,
        }
    }

    #[test]
    fn buckets_are_cut_into_equal_padded_shares_owned_once() {
        // 3 + 5 + 2 + 9 elements, buckets of at most 10: [3, 5, 2] and [9]; 3 ranks: shares of 4
        // and 3.
        let layouts: Vec<ShardLayout> = (0..3)
            .map(|r| ShardLayout::new(vec![3, 5, 2, 9], 10, 3, r, &[]))
            .collect();
        let first = &layouts[0].buckets;
        assert_eq!((first[0].params.clone(), first[0].share), (0..3, 4));
        assert_eq!((first[1].params.clone(), first[1].share), (3..4, 3));
        assert_eq!(first[0].segments, [seg(0, 0, 0, 0, 3), seg(1, 0, 3, 3, 1)]);
        assert_eq!(first[1].segments, [seg(3, 0, 0, 4, 3)]);
        assert_eq!(layouts[1].buckets[0].segments, [seg(1, 1, 0, 0, 4)]);
        // The last share of the first bucket is half padding.
        assert_eq!(layouts[2].buckets[0].segments, [seg(2, 0, 0, 0, 2)]);
        assert_eq!(layouts[2].buckets[1].segments, [seg(3, 6, 0, 2, 3)]);
        // Every element of every parameter is owned exactly once.
        let owned: usize = layouts.iter().map(|l| l.owned).sum();
        assert_eq!(owned, 19);
    }

    #[test]
    fn no_bucket_straddles_a_split() {
        // Without splits the first bucket would be [3, 5, 2]; split at 2: [3, 5] and [2, 9]
        // would exceed 10, so [3, 5], [2], [9]; split at 1 and 2 as well: [3], [5], [2], [9].
        let params = |splits: &[usize]| -> Vec<Range<usize>> {
            let layout = ShardLayout::new(vec![3, 5, 2, 9], 10, 1, 0, splits);
            layout.buckets.iter().map(|b| b.params.clone()).collect()
        };
        assert_eq!(params(&[2]), [0..2, 2..3, 3..4]);
        assert_eq!(params(&[1, 2]), [0..1, 1..2, 2..3, 3..4]);
    }

    fn spec(name: &str, shape: Vec<i64>, sync: GradSync) -> ParamSpec {
        ParamSpec {
            grad_sync: sync,
            ..ParamSpec::replicated(name.into(), shape, 2)
        }
    }

    #[test]
    fn the_order_puts_group_summed_gradients_last_and_layers_in_buckets_of_their_own() {
        let specs = [
            spec("x_embedder.weight", vec![4], GradSync::Complete),
            spec("layers.0.norm.weight", vec![2], GradSync::SumOverGroup),
            spec("layers.0.proj.weight", vec![3], GradSync::Complete),
            spec("layers.1.proj.weight", vec![3], GradSync::Complete),
        ];
        let order = |level, tp| ParamOrder::new(&specs, tp, level, 100, 2, 0);
        // Plain order, one bucket, where gradients are not sharded or there is no group.
        for (level, tp) in [(Sharding::Optimizer, 2), (Sharding::Full, 1)] {
            assert_eq!(order(level, tp).spec_of, [0, 1, 2, 3]);
        }
        assert_eq!(order(Sharding::Optimizer, 2).layout.buckets.len(), 1);
        let gradients = order(Sharding::Gradients, 2);
        assert_eq!((gradients.spec_of, gradients.early), (vec![0, 2, 3, 1], 3));
        let buckets = |o: ParamOrder| -> Vec<Range<usize>> {
            o.layout.buckets.iter().map(|b| b.params.clone()).collect()
        };
        assert_eq!(buckets(order(Sharding::Gradients, 2)), [0..3, 3..4]);
        // Under "full" each layer apart: the embedder, layer 0's, layer 1's, the late norm.
        assert_eq!(buckets(order(Sharding::Full, 2)), [0..1, 1..2, 2..3, 3..4]);
        assert_eq!(buckets(order(Sharding::Full, 1)), [0..1, 1..3, 3..4]);
    }

    #[test]
    fn more_ranks_than_elements_leave_some_shares_all_padding() {
        let layout = ShardLayout::new(vec![1], 10, 4, 3, &[]);
        assert_eq!(layout.buckets[0].share, 1);
        assert_eq!(layout.owned, 0);
    }
}
