//! Shard layouts: how fused tensors split over a tensor-parallel group and reassemble.

use flux_model::tp::{parts, GradSync, LinearDecl, LinearInit, ParamSpec, Shard};
use flux_model::FluxConfig;
use tch::{Device, Kind, Tensor};

fn rows(n: i64) -> Tensor {
    Tensor::arange(n, (Kind::Float, Device::Cpu)).view([n, 1])
}

#[test]
fn fused_parts_give_each_rank_its_slice_of_every_part() {
    // [q; k; v; mlp] with q, k, v of 4 rows and mlp of 8, over 2 ranks.
    let decl = LinearDecl {
        in_dim: 1,
        out_dim: 20,
        bias: true,
        shard: Shard::Column,
        parts: parts(&[("q", 4), ("k", 4), ("v", 4), ("mlp", 8)]),
        init: LinearInit::Xavier,
    };
    let specs = decl.param_specs("linear1", 2);
    let weight = &specs[0];
    assert_eq!(weight.local_shape(), [10, 1]);
    let full = rows(20);
    let rank1: Vec<f32> = Vec::try_from(weight.shard_of(&full, 1).flatten(0, -1)).unwrap();
    assert_eq!(rank1, [2., 3., 6., 7., 10., 11., 16., 17., 18., 19.]);
    let shards = [weight.shard_of(&full, 0), weight.shard_of(&full, 1)];
    assert!(weight.unshard(&shards).equal(&full));
    assert_eq!(
        specs[1].split_dim,
        Some(0),
        "column-parallel bias is split with the weight"
    );
}

#[test]
fn row_parallel_splits_inputs_and_keeps_the_bias_whole() {
    let decl = LinearDecl {
        in_dim: 12,
        out_dim: 3,
        bias: true,
        shard: Shard::Row,
        parts: parts(&[("attn", 4), ("mlp", 8)]),
        init: LinearInit::Zeros,
    };
    let specs = decl.param_specs("linear2", 4);
    assert_eq!(
        (specs[0].split_dim, specs[0].local_shape()),
        (Some(1), vec![3, 3])
    );
    assert_eq!(
        (specs[1].split_dim, specs[1].local_shape()),
        (None, vec![3])
    );
    let full = Tensor::arange(36, (Kind::Float, Device::Cpu)).view([3, 12]);
    let shards: Vec<Tensor> = (0..4).map(|r| specs[0].shard_of(&full, r)).collect();
    assert!(specs[0].unshard(&shards).equal(&full));
}

#[test]
#[should_panic(
    expected = "linear parts [(\"q\", 4), (\"k\", 4)] sum to 8 but the split dimension has 12 features"
)]
fn parts_that_do_not_tile_the_dimension_are_rejected() {
    let decl = LinearDecl {
        in_dim: 1,
        out_dim: 12,
        bias: false,
        shard: Shard::Column,
        parts: parts(&[("q", 4), ("k", 4)]),
        init: LinearInit::Xavier,
    };
    decl.param_specs("bad", 2);
}

#[test]
fn flux_specs_are_sharded_like_megatron_and_count_the_same_at_any_tp() {
    let config = FluxConfig::flux_535m();
    let tp1 = <flux_model::FluxTransformer as flux_model::Block>::param_specs("", &config, 1);
    let tp8 = <flux_model::FluxTransformer as flux_model::Block>::param_specs("", &config, 8);
    let total = |s: &[ParamSpec]| s.iter().map(ParamSpec::numel).sum::<u64>();
    assert_eq!(total(&tp1), total(&tp8));
    let find = |name: &str| tp8.iter().find(|s| s.name == name).unwrap().clone();
    let qkv = find("transformer.layers.0.self_attention.linear_qkv.weight");
    assert_eq!(
        (qkv.split_dim, qkv.local_shape()),
        (Some(0), vec![3 * 384, 3072])
    );
    assert_eq!(
        find("transformer.layers.0.self_attention.linear_proj.weight").split_dim,
        Some(1)
    );
    assert_eq!(
        find("transformer.layers.0.mlp.linear_fc2.bias").split_dim,
        None
    );
    assert_eq!(
        find("transformer.layers.1.linear_qkv_fc1.weight").local_shape(),
        [(3 * 3072 + 12288) / 8, 3072]
    );
    assert_eq!(
        find("transformer.layers.1.linear_proj_fc2.weight").local_shape(),
        [3072, (3072 + 12288) / 8]
    );
    assert_eq!(
        find("transformer.layers.1.self_attention.q_layernorm.weight").grad_sync,
        GradSync::SumOverGroup
    );
    assert_eq!(find("x_embedder.weight").split_dim, None);
    assert_eq!(
        find("transformer.layers.0.adaln.linear.weight").split_dim,
        None
    );
}
