//! Every field kind a block can declare, with its tensor-parallel treatment visible in the specs:
//! linears without bias (replicated, column, row), a LayerNorm with a learnable affine (and one
//! without its shift), a vocab-parallel embedding table, raw parameters (a learned modulation
//! table split by rows, a replicated one used on shards).

use flux_macros::diffusion_block;
use flux_model::tp::{
    Embedding, GradSync, LayerNorm, Linear, Pass, TpContext, EMBEDDING_INIT_STD,
};
use flux_model::Block;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

pub struct Dims {
    vocab: i64,
    width: i64,
}

#[diffusion_block(config = Dims)]
pub struct TokenBlock {
    #[embedding(num = config.vocab, dim = config.width, shard = vocab)]
    tokens: Embedding,
    #[norm(dim = config.width)]
    norm: LayerNorm,
    #[norm(dim = config.width, eps = 1e-6, bias = false, name = "norm_no_shift")]
    scale_only: LayerNorm,
    /// A learned `[6, D]` modulation table, rows split over the group.
    #[param(shape = [6, config.width], init = normal(0.5), split = 0)]
    scale_shift_table: Tensor,
    /// A replicated per-channel gain applied to this rank's slice of the hidden layer.
    #[param(shape = [2 * config.width], init = ones, on_shards, name = "gains.hidden")]
    hidden_gain: Tensor,
    #[linear(in = config.width, out = config.width, bias = false)]
    mix: Linear,
    #[linear(in = config.width, out = 2 * config.width, shard = column, bias = false)]
    up: Linear,
    #[linear(in = 2 * config.width, out = config.width, shard = row, bias = false)]
    down: Linear,
}

impl TokenBlock {
    /// `ids [B, L]` → `[B, L, D]`.
    pub fn forward(&self, ids: &Tensor) -> Tensor {
        let x = self.norm.forward(&self.tokens.forward(ids));
        let x = self.scale_only.forward(&self.mix.forward(&x));
        let hidden = self.up.forward(&x).gelu("none") * &self.hidden_gain;
        let x = x + self.down.forward(&hidden);
        x * (1 + self.scale_shift_table.get(0))
    }
}

fn main() {
    let dims = Dims { vocab: 10, width: 4 };
    let specs = <TokenBlock as Block>::param_specs("blk", &dims, 2);
    let row = |name: &str| {
        let s = specs.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("{name}"));
        (s.shape.clone(), s.split_dim, s.grad_sync, s.all_reduce)
    };
    let whole = GradSync::Complete;
    assert_eq!(row("blk.tokens.weight"), (vec![10, 4], Some(0), whole, Some(Pass::Forward)));
    assert_eq!(row("blk.norm.weight"), (vec![4], None, whole, None));
    assert_eq!(row("blk.norm.bias"), (vec![4], None, whole, None));
    assert_eq!(row("blk.norm_no_shift.weight"), (vec![4], None, whole, None));
    assert_eq!(row("blk.scale_shift_table"), (vec![6, 4], Some(0), whole, None));
    assert_eq!(
        row("blk.gains.hidden"),
        (vec![8], None, GradSync::SumOverGroup, None)
    );
    assert_eq!(row("blk.mix.weight"), (vec![4, 4], None, whole, None));
    assert_eq!(row("blk.up.weight"), (vec![8, 4], Some(0), whole, Some(Pass::Backward)));
    assert_eq!(row("blk.down.weight"), (vec![4, 8], Some(1), whole, Some(Pass::Forward)));
    // No biases on the linears, no shift on the second norm.
    assert_eq!(specs.len(), 9);
    assert_eq!(
        <TokenBlock as Block>::num_params(&dims),
        40 + 4 + 4 + 4 + 24 + 8 + 16 + 32 + 32
    );

    // One rank: the table starts N(0, 0.02²), norms at (1, 0), the gain at ones.
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let block = <TokenBlock as Block>::new(&vs.root(), &dims, &TpContext::single());
    let std = block.tokens.weight.std(true).double_value(&[]);
    assert!((std - EMBEDDING_INIT_STD).abs() < 0.01, "{std}");
    assert!(block.norm.bias.as_ref().unwrap().abs().max().double_value(&[]) == 0.0);
    assert!(block.scale_only.bias.is_none());
    assert!(block.hidden_gain.eq(1.0).all().int64_value(&[]) == 1);
    let ids = Tensor::from_slice(&[0i64, 3, 9, 3, 1, 2]).view([2, 3]);
    let y = block.forward(&ids);
    assert_eq!(y.size(), [2, 3, 4]);
    assert_eq!(y.kind(), Kind::Float);
    // The same id gives the same row.
    let (a, b) = (y.get(0).get(1), y.get(1).get(0));
    assert!(a.allclose(&b, 1e-6, 1e-6, false));
}
