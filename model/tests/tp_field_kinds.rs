//! The tensor-parallel field kinds on a real group: a block with a vocab-parallel embedding, a
//! LayerNorm, a column/row pair without biases, a raw parameter split with the hidden layer and
//! a replicated one applied to each rank's heads, run on two ranks (two threads joined by a
//! shared-memory collective) against one. Outputs agree to 1e-6 and every gathered gradient to
//! 1e-6 of its largest entry (f32; the ranks sum partial products in another order, and the
//! LayerNorm over a 0.02-scale table scales the embedding's gradient up ~50×), and the group
//! issues exactly the all-reduces the specs predict. The sequence-parallel regions slice, gather
//! and reduce-scatter tokens in rank order on three ranks.

mod common;

use std::collections::HashMap;

use common::threads::ThreadGroup;

use flux_macros::diffusion_block;
use flux_model::tp::{CollectiveCounts, Embedding, LayerNorm, Linear, ShardedStore, TpContext};
use flux_model::Block;
use tch::{Device, Kind, Tensor};

const TOLERANCE: f64 = 1e-6;

pub struct Dims {
    vocab: i64,
    width: i64,
    hidden: i64,
    head_dim: i64,
}

const DIMS: Dims = Dims {
    vocab: 10,
    width: 6,
    hidden: 16,
    head_dim: 4,
};

#[diffusion_block(config = Dims)]
pub struct Tagger {
    #[embedding(num = config.vocab, dim = config.width, shard = vocab)]
    tokens: Embedding,
    #[norm(dim = config.width)]
    norm: LayerNorm,
    #[linear(in = config.width, out = config.hidden, shard = column, bias = false)]
    up: Linear,
    /// Per hidden unit, split with `up`'s output.
    #[param(shape = [config.hidden], init = normal(0.5), split = 0)]
    hidden_scale: Tensor,
    /// Per head channel, the same on every rank's heads.
    #[param(shape = [config.head_dim], init = normal(0.5), on_shards)]
    head_gain: Tensor,
    #[linear(in = config.hidden, out = config.width, shard = row, bias = false)]
    down: Linear,
    #[value(config.head_dim)]
    head_dim: i64,
}

impl Tagger {
    /// `ids [B, L]` → `[B, L, D]`.
    pub fn forward(&self, ids: &Tensor) -> Tensor {
        let x = self.norm.forward(&self.tokens.forward(ids));
        let h = self.up.forward(&x).gelu("none") * &self.hidden_scale;
        let (b, l, width) = h.size3().unwrap();
        let heads = h.view([b, l, width / self.head_dim, self.head_dim]) * &self.head_gain;
        &x + self.down.forward(&heads.view([b, l, width]))
    }
}

/// Output, logical gradients and collective counts of the block on `tp` loaded with `weights`.
fn run(
    tp: TpContext,
    weights: &HashMap<String, Tensor>,
) -> (Tensor, Vec<(String, Tensor)>, CollectiveCounts) {
    let specs = Tagger::param_specs("", &DIMS, tp.size() as i64);
    let (mut store, block) = ShardedStore::build(Device::Cpu, Kind::Float, tp, specs, |p, tp| {
        Tagger::new(p, &DIMS, tp)
    })
    .unwrap();
    store.load_logical(weights).unwrap();
    let ids = Tensor::from_slice(&[0i64, 9, 4, 5, 5, 2, 7, 1]).view([2, 4]);
    let y = block.forward(&ids);
    let probe = Tensor::arange(y.numel() as i64, (Kind::Float, Device::Cpu))
        .view(y.size().as_slice())
        .sin();
    (&y * probe).sum(Kind::Float).backward();
    store.finish_grads();
    let counts = store.tp().counts();
    (y.detach(), store.gather_logical(true), counts)
}

#[test]
fn two_ranks_match_one_with_every_field_kind() {
    tch::manual_seed(7);
    let specs = Tagger::param_specs("", &DIMS, 1);
    let (store, _) = ShardedStore::build(
        Device::Cpu,
        Kind::Float,
        TpContext::single(),
        specs.clone(),
        |p, tp| Tagger::new(p, &DIMS, tp),
    )
    .unwrap();
    let weights: HashMap<String, Tensor> = store.gather_logical(false).into_iter().collect();
    let (y1, grads1, _) = run(TpContext::single(), &weights);

    let ranks: Vec<_> = ThreadGroup::group(2)
        .into_iter()
        .map(|comm| {
            let weights: HashMap<String, Tensor> =
                weights.iter().map(|(k, v)| (k.clone(), v.copy())).collect();
            std::thread::spawn(move || run(TpContext::new(Box::new(comm)), &weights))
        })
        .collect();
    let expected = CollectiveCounts::expected(&Tagger::param_specs("", &DIMS, 2));
    // The embedding's and the row linear's partial outputs forward, the column linear's input
    // gradient backward, the replicated gain's partial gradients in one bucket.
    assert_eq!(
        expected,
        CollectiveCounts {
            forward: 2,
            backward: 1,
            grad_sync: 1,
            sequence: 0,
            amax: 0,
        }
    );
    for (rank, handle) in ranks.into_iter().enumerate() {
        let (y2, grads2, counts) = handle.join().unwrap();
        let dy = (&y2 - &y1).abs().max().double_value(&[]);
        assert!(dy <= TOLERANCE, "rank {rank}: output max|Δ| {dy:e}");
        common::threads::assert_grads_match(rank, &grads1, &grads2, TOLERANCE);
        assert_eq!(counts, expected, "rank {rank}");
    }
}

#[test]
fn sequence_regions_slice_gather_and_reduce_scatter_the_tokens_in_rank_order() {
    // Three ranks, `x [2, 6, 4]` on each: sliced to 2 tokens, gathered into a "column-parallel"
    // region, weighted per rank (partial sums), reduce-scattered back to slices and gathered
    // whole. One process computes the same `e = 2 x (w_0 + w_1 + w_2)`; every rank's `x`
    // gradient is the whole one, gathered from the slices.
    let x = Tensor::randn([2, 6, 4], (Kind::Float, Device::Cpu));
    let probe = Tensor::randn([2, 6, 4], (Kind::Float, Device::Cpu));
    let weight = |rank: usize| 1.0 + rank as f64 * 0.5;
    let total: f64 = (0..3).map(weight).sum();
    let expected = &x * (2.0 * total);
    let expected_grad = &probe * (2.0 * total);
    let ranks: Vec<_> = ThreadGroup::group(3)
        .into_iter()
        .map(|comm| {
            let (x, probe) = (x.copy().set_requires_grad(true), probe.copy());
            std::thread::spawn(move || {
                let tp = TpContext::new(Box::new(comm)).with_sequence_parallel(true);
                let slice = tp.scatter_sequence(&x);
                assert_eq!(slice.size(), [2, 2, 4]);
                let whole = tp.column_input(&(slice * 2.0));
                let partial = whole * weight(tp.rank());
                let summed = tp.row_output(&partial);
                assert_eq!(summed.size(), [2, 2, 4]);
                let e = tp.gather_sequence(&summed);
                (&e * &probe).sum(Kind::Float).backward();
                (e.detach(), x.grad(), tp.counts().sequence)
            })
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        let (e, grad, sequence) = handle.join().unwrap();
        // Relative to the largest entry: the ranks' partial products are summed in f32.
        let relative =
            |a: &Tensor, b: &Tensor| ((a - b).abs().max() / b.abs().max()).double_value(&[]);
        let (de, dg) = (relative(&e, &expected), relative(&grad, &expected_grad));
        assert!(
            de <= TOLERANCE && dg <= TOLERANCE,
            "rank {rank}: {de:e} {dg:e}"
        );
        // Gathers: the column input and the whole output forward, the row output's and the
        // slice's gradients backward (4); reduce-scatters: the row output forward, the column
        // input's gradient backward (2). Slicing moves nothing.
        assert_eq!(sequence, 6, "rank {rank}");
    }
}
