//! Float8 linears against torchao and across a tensor-parallel group.
//!
//! Parity: one bf16 linear in each recipe gives torchao 0.18's `Float8Linear` output and input,
//! weight and bias gradients (fixtures from `tests/fixtures/make_fp8_fixtures.py`) bit for bit:
//! the same casts, scales and `_scaled_mm` calls run in the same libtorch, so nothing but the
//! order of identical operations could differ, and it does not.
//!
//! Tensor parallelism: a column/row pair in float8 on two ranks (threads joined by a
//! shared-memory collective) matches one process, because every scale of a split operand is the
//! group's maximum. Weight gradients come out bit-identical; the row-parallel layer's two partial
//! products are rounded to bf16 before they are summed, so outputs and input gradients differ by
//! about one bf16 ulp of their largest entry (measured 4·10⁻³ and 5.5·10⁻³ of it), held to 2⁻⁷.
//! The group takes exactly the amax maxima the recipe's split operands need.

mod common;

use std::collections::HashMap;

use common::threads::ThreadGroup;

use flux_macros::diffusion_block;
use flux_model::execution::residency::storage_present;
use flux_model::float8::{convert, Float8Gemm, Float8Recipe, Float8Settings, Float8Weight};
use flux_model::tp::{Linear, ShardedStore, TpContext};
use flux_model::{Block, DiffusionBatch};
use tch::{Device, Kind, Tensor};

const RECIPES: [Float8Recipe; 3] = [
    Float8Recipe::Tensorwise,
    Float8Recipe::Rowwise,
    Float8Recipe::RowwiseGwHp,
];

pub struct Dims {
    width: i64,
    hidden: i64,
}

#[diffusion_block(config = Dims)]
pub struct One {
    #[linear(in = config.width, out = config.hidden)]
    proj: Linear,
}

impl One {
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.proj.forward(x)
    }
}

#[diffusion_block(config = Dims)]
pub struct Pair {
    #[linear(in = config.width, out = config.hidden, shard = column)]
    up: Linear,
    #[linear(in = config.hidden, out = config.width, shard = row)]
    down: Linear,
}

impl Pair {
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.down.forward(&self.up.forward(x).gelu("tanh"))
    }
}

/// Back-propagate `grad` from `y` (the gradient `y` receives is exactly `grad`).
fn backward(y: &Tensor, grad: &Tensor) {
    (y * grad).sum(y.kind()).backward();
}

fn fixtures() -> HashMap<String, Tensor> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/data/fp8/linear.safetensors"
    );
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| {
            panic!("{path}: {e} (make it with tests/fixtures/make_fp8_fixtures.py)")
        })
        .into_iter()
        .collect()
}

/// The fixture's bf16 linear (48 × 64, with bias) on one process.
fn fixture_linear(f: &HashMap<String, Tensor>) -> (ShardedStore, One) {
    let dims = Dims {
        width: 64,
        hidden: 48,
    };
    let specs = One::param_specs("", &dims, 1);
    let (mut store, one) = ShardedStore::build(
        Device::Cpu,
        Kind::BFloat16,
        TpContext::single(),
        specs,
        |p, tp| One::new(p, &dims, tp),
    )
    .unwrap();
    let weights = HashMap::from([
        ("proj.weight".to_string(), f["w"].shallow_clone()),
        ("proj.bias".to_string(), f["b"].shallow_clone()),
    ]);
    store.load_logical(&weights).unwrap();
    (store, one)
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().to_kind(Kind::Float).double_value(&[])
}

#[test]
fn each_recipe_equals_torchao_float8_linear() {
    let f = fixtures();
    for recipe in RECIPES {
        let (_store, one) = fixture_linear(&f);
        one.proj
            .use_float8(Float8Gemm::new(recipe, one.proj.shard(), 1))
            .unwrap();
        let x = f["x"].copy().set_requires_grad(true);
        let y = one.forward(&x);
        backward(&y, &f["dy"]);
        let name = recipe.name();
        for (what, got) in [
            ("y", y.detach()),
            ("dx", x.grad()),
            ("dw", one.proj.weight.grad()),
            ("db", one.proj.bias.as_ref().unwrap().grad()),
        ] {
            let expected = &f[&format!("{name}.{what}")];
            assert_eq!(got.kind(), Kind::BFloat16, "{name} {what}");
            let diff = max_abs(&(got.to_kind(Kind::Float) - expected.to_kind(Kind::Float)));
            assert!(
                diff == 0.0,
                "{name}: {what} differs from torchao by {diff:e}"
            );
        }
        // The float8 product is not the bf16 one: the fixture would not catch a silent fallback.
        let bf16 = f["x"].linear(&f["w"], Some(&f["b"]));
        assert!(max_abs(&(bf16 - y.detach()).to_kind(Kind::Float)) > 0.0);
    }
}

/// Output, logical gradients of the pair and amax maxima taken on `tp` in float8 as `recipe`.
fn run_pair(
    tp: TpContext,
    weights: &HashMap<String, Tensor>,
    x: &Tensor,
    recipe: Float8Recipe,
) -> (Tensor, Vec<(String, Tensor)>, u64) {
    let dims = Dims {
        width: 64,
        hidden: 96,
    };
    let specs = Pair::param_specs("", &dims, tp.size() as i64);
    let (mut store, pair) = ShardedStore::build(Device::Cpu, Kind::BFloat16, tp, specs, |p, tp| {
        Pair::new(p, &dims, tp)
    })
    .unwrap();
    store.load_logical(weights).unwrap();
    for l in [&pair.up, &pair.down] {
        l.use_float8(Float8Gemm::new(recipe, l.shard(), l.tp().size()))
            .unwrap();
    }
    let x = x.copy().set_requires_grad(true);
    let y = pair.forward(&x);
    let probe = Tensor::arange(y.numel() as i64, (Kind::Float, Device::Cpu))
        .view(y.size().as_slice())
        .sin()
        .to_kind(Kind::BFloat16);
    backward(&y, &probe);
    store.finish_grads();
    let amax = store.tp().counts().amax;
    let mut grads = store.gather_logical(true);
    grads.push(("input".to_string(), x.grad()));
    (y.detach(), grads, amax)
}

#[test]
fn two_ranks_match_one_in_every_recipe() {
    let f = fixtures();
    let x = f["x"].shallow_clone();
    tch::manual_seed(3);
    let weights: HashMap<String, Tensor> = [("up.weight", [96, 64]), ("down.weight", [64, 96])]
        .into_iter()
        .map(|(n, s)| {
            (
                n.to_string(),
                (Tensor::randn(s, (Kind::Float, Device::Cpu)) / 8).to_kind(Kind::BFloat16),
            )
        })
        .chain([
            (
                "up.bias".to_string(),
                Tensor::randn([96], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16),
            ),
            (
                "down.bias".to_string(),
                Tensor::randn([64], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16),
            ),
        ])
        .collect();
    for recipe in RECIPES {
        let (y1, grads1, none) = run_pair(TpContext::single(), &weights, &x, recipe);
        assert_eq!(none, 0, "one process takes no maxima");
        let ranks: Vec<_> = ThreadGroup::group(2)
            .into_iter()
            .map(|comm| {
                let weights: HashMap<String, Tensor> =
                    weights.iter().map(|(k, v)| (k.clone(), v.copy())).collect();
                let x = x.copy();
                std::thread::spawn(move || {
                    run_pair(TpContext::new(Box::new(comm)), &weights, &x, recipe)
                })
            })
            .collect();
        // Split operands whose amax spans the split, per pass of both layers (column: W; g and W
        // for the input gradient; g for the weight gradient when tensorwise. Row: x and W; W and
        // x for the gradients when tensorwise).
        let expected_amax = match recipe {
            Float8Recipe::Tensorwise => 4 + 4,
            Float8Recipe::Rowwise => 2 + 2,
            Float8Recipe::RowwiseGwHp => 2 + 3,
        };
        for (rank, handle) in ranks.into_iter().enumerate() {
            let (y2, grads2, amax) = handle.join().unwrap();
            let name = recipe.name();
            let scale = max_abs(&y1);
            let dy = max_abs(&(y2.to_kind(Kind::Float) - y1.to_kind(Kind::Float))) / scale;
            assert!(
                dy <= 1.0 / 128.0,
                "{name} rank {rank}: output max|Δ|/max|y| {dy:e}"
            );
            common::threads::assert_grads_match(rank, &grads1, &grads2, 1.0 / 128.0);
            assert_eq!(amax, expected_amax, "{name} rank {rank}: amax maxima");
        }
    }
}

#[test]
fn every_architecture_trains_its_layer_linears_in_float8_and_targets_are_checked() {
    for architecture in flux_model::ARCHITECTURES {
        let spec = architecture.tiny();
        tch::manual_seed(0);
        let model = spec
            .build_as(Device::Cpu, Kind::BFloat16, TpContext::single())
            .unwrap();
        let name = architecture.name;
        let chosen = convert(model.as_ref(), &Float8Settings::default()).unwrap();
        // Only linears of the layer stacks: the stem's embedders and the head stay in bf16.
        let layers: Vec<String> = model.layers()[1..model.layers().len() - 1].to_vec();
        assert!(!chosen.is_empty(), "{name}");
        for linear in &chosen {
            let inside = layers.iter().any(|l| linear.starts_with(&format!("{l}.")));
            assert!(inside, "{name}: `{linear}` is outside the layer stacks");
        }
        let mut outside = Vec::new();
        model.visit_linears(&mut |l| {
            if l.float8().is_none() {
                outside.push(l.name().to_string())
            }
        });
        assert!(!outside.is_empty(), "{name}: the embedders stay in bf16");

        // A training step's forward and backward run through them and reach every weight.
        let batch =
            DiffusionBatch::random(&spec.inputs(), 2, 8, 8, 4, Device::Cpu).to_kind(Kind::BFloat16);
        let out = model.forward(&batch, true).unwrap();
        assert_eq!(out.kind(), Kind::BFloat16);
        out.to_kind(Kind::Float)
            .square()
            .mean(Kind::Float)
            .backward();
        for (param, t) in model.store().vs.variables() {
            let g = t.grad();
            assert!(g.defined(), "{name}: {param} has no gradient");
            let finite = bool::try_from(g.isfinite().all()).unwrap();
            assert!(finite, "{name}: {param} has a non-finite gradient");
        }

        // A second switch is refused; patterns that select nothing or unaligned layers too.
        let again = convert(model.as_ref(), &Float8Settings::default()).unwrap_err();
        assert_eq!(again.field, "fp8", "{name}");
        let fresh = spec
            .build_as(Device::Cpu, Kind::BFloat16, TpContext::single())
            .unwrap();
        let nothing = Float8Settings {
            targets: vec!["no_such_layer".into()],
            ..Float8Settings::default()
        };
        let err = convert(fresh.as_ref(), &nothing).unwrap_err();
        assert_eq!(err.field, "fp8.targets");
        assert!(err.to_string().contains("no_such_layer"), "{err}");
    }
}

#[test]
fn a_named_linear_whose_sides_are_not_multiples_of_16_is_refused_by_name() {
    // A DiT 40 wide: its attention and MLP linears have a side of 40.
    let table = "architecture = \"dit\"\ndepth = 1\nhidden_size = 40\nnum_attention_heads = 4\n\
                 in_channels = 4\npatch_size = 2\ncond_dim = 16\nfrequency_embedding_size = 32";
    let spec = flux_model::ModelSpec::from_table(toml::from_str(table).unwrap()).unwrap();
    // By default those layers are left in bf16.
    let model = spec
        .build_as(Device::Cpu, Kind::BFloat16, TpContext::single())
        .unwrap();
    assert!(convert(model.as_ref(), &Float8Settings::default())
        .unwrap()
        .is_empty());
    let model = spec
        .build_as(Device::Cpu, Kind::BFloat16, TpContext::single())
        .unwrap();
    let all = Float8Settings {
        targets: vec!["*".into()],
        ..Float8Settings::default()
    };
    let err = convert(model.as_ref(), &all).unwrap_err();
    assert_eq!(err.field, "fp8.targets");
    assert!(err.to_string().contains("multiples of 16"), "{err}");
    assert!(
        err.to_string().contains("[40,") || err.to_string().contains(", 40]"),
        "{err}"
    );
}

#[test]
fn a_frozen_weight_held_in_float8_gives_the_widened_weights_product_and_input_gradient() {
    let f = fixtures();
    let (mut store, one) = fixture_linear(&f);
    store.vs.freeze();
    let held = Float8Weight::quantize(&f["w"]);
    let widened = held.dequantize(Kind::BFloat16);
    assert_eq!(one.proj.hold_in_float8(), 48 * 64 + 4 * 48);
    assert!(
        !storage_present(&one.proj.weight),
        "the bf16 weight is given back"
    );

    let x = f["x"].copy().set_requires_grad(true);
    let y = one.forward(&x);
    backward(&y, &f["dy"]);
    let x_ref = f["x"].copy().set_requires_grad(true);
    let y_ref = x_ref.matmul(&widened.tr()) + &f["b"];
    backward(&y_ref, &f["dy"]);
    assert!(y.detach().equal(&y_ref.detach()), "output");
    assert!(x.grad().equal(&x_ref.grad()), "input gradient");
    // Widening loses at most e4m3's 2⁻⁴ of each row's entries against the bf16 weight.
    let err = max_abs(&(widened.to_kind(Kind::Float) - f["w"].to_kind(Kind::Float)));
    assert!(err <= max_abs(&f["w"]) / 16.0, "{err}");
}

#[test]
fn a_token_count_that_is_not_a_multiple_of_16_gives_what_zero_padding_gives() {
    // 2 × 20 tokens: the weight gradient's inner dimension (40) is padded to 48 for the float8
    // GEMM, which must give exactly what 8 more tokens of zeros (input and gradient) give.
    let f = fixtures();
    let x = f["x"].narrow(1, 0, 20);
    let dy = f["dy"].narrow(1, 0, 20);
    let zeros = |t: &Tensor| Tensor::zeros([2, 4, t.size()[2]], (t.kind(), Device::Cpu));
    let (x_padded, dy_padded) = (
        Tensor::cat(&[&x, &zeros(&x)], 1),
        Tensor::cat(&[&dy, &zeros(&dy)], 1),
    );
    for recipe in RECIPES {
        let run = |x: &Tensor, dy: &Tensor| {
            let (_store, one) = fixture_linear(&f);
            one.proj
                .use_float8(Float8Gemm::new(recipe, one.proj.shard(), 1))
                .unwrap();
            let x = x.copy().set_requires_grad(true);
            let y = one.forward(&x);
            backward(&y, dy);
            (y.detach(), x.grad(), one.proj.weight.grad())
        };
        let (y, dx, dw) = run(&x, &dy);
        let (y_p, dx_p, dw_p) = run(&x_padded, &dy_padded);
        let name = recipe.name();
        assert!(y.equal(&y_p.narrow(1, 0, 20)), "{name}: output");
        assert!(dx.equal(&dx_p.narrow(1, 0, 20)), "{name}: input gradient");
        assert!(dw.equal(&dw_p), "{name}: weight gradient");
    }
}
