//! Closed-form checks of the embeddings and normalisations.

use approx::assert_abs_diff_eq;
use flux_model::embeddings::{generate_image_position_ids, timestep_embedding, EmbedNd};
use flux_model::layers::layer_norm;
use flux_model::tp::{LayerNorm, NormDecl, RmsNorm, TpContext};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

fn f32s(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
}

#[test]
fn timestep_embedding_is_cos_then_sin_of_scaled_time() {
    let t = Tensor::from_slice(&[0.0f32, 0.5]);
    let emb = timestep_embedding(&t, 8);
    assert_eq!(emb.size(), [2, 8]);
    let row0 = f32s(&emb.get(0));
    assert_eq!(row0, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    let row1 = f32s(&emb.get(1));
    for i in 0..4 {
        let freq = (-(10_000f64.ln()) * i as f64 / 4.0).exp();
        let arg = 500.0 * freq; // t · 1000 · f_i
        assert_abs_diff_eq!(row1[i] as f64, arg.cos(), epsilon = 1e-4);
        assert_abs_diff_eq!(row1[i + 4] as f64, arg.sin(), epsilon = 1e-4);
    }
}

#[test]
fn image_ids_follow_the_packed_grid() {
    let ids = generate_image_position_ids(2, 4, 6, Device::Cpu); // 2×3 tokens
    assert_eq!(ids.size(), [2, 6, 3]);
    let row: Vec<f32> = f32s(&ids.get(1));
    assert_eq!(
        row,
        [0., 0., 0., 0., 0., 1., 0., 0., 2., 0., 1., 0., 0., 1., 1., 0., 1., 2.]
    );
}

#[test]
fn rope_rotates_interleaved_pairs_by_position_times_frequency() {
    let embed = EmbedNd::new(10_000.0, &[2, 2, 4], true);
    let ids = Tensor::from_slice(&[0.0f32, 3.0, 5.0]).view([1, 1, 3]);
    let rope = embed.forward(&ids);
    let x = Tensor::ones([1, 1, 1, 8], (Kind::Float, Device::Cpu));
    let y = f32s(&rope.apply(&x));
    // Angles per pair: axis0 pos 0 → 0; axis1 pos 3, ω=1 → 3; axis2 pos 5, ω = 1, 10000^-0.5.
    let angles = [0.0f64, 3.0, 5.0, 5.0 * 0.01];
    for (k, a) in angles.iter().enumerate() {
        assert_abs_diff_eq!(y[2 * k] as f64, a.cos() - a.sin(), epsilon = 1e-5);
        assert_abs_diff_eq!(y[2 * k + 1] as f64, a.sin() + a.cos(), epsilon = 1e-5);
    }
    // Rotation keeps norms.
    let x = Tensor::randn([2, 3, 5, 8], (Kind::Float, Device::Cpu));
    let ids = Tensor::randn([2, 5, 3], (Kind::Float, Device::Cpu)) * 10.0;
    let r = embed.forward(&ids).apply(&x);
    let norms = |t: &Tensor| t.square().sum_dim_intlist(-1, false, Kind::Float);
    assert!((norms(&r) - norms(&x)).abs().max().double_value(&[]) < 1e-4);
}

#[test]
fn rope_halves_mode_pairs_i_with_i_plus_half() {
    let embed = EmbedNd::new(10_000.0, &[2, 2, 4], false);
    let ids = Tensor::from_slice(&[0.0f32, 3.0, 5.0]).view([1, 1, 3]);
    let x = Tensor::from_slice(&[1.0f32, 0., 0., 0., 0., 0., 0., 0.]).view([1, 1, 1, 8]);
    let y = f32s(&embed.forward(&ids).apply(&x));
    assert_abs_diff_eq!(y[0], 1.0, epsilon = 1e-6); // angle 0 on pair (0, 4)
    let x = Tensor::from_slice(&[0.0f32, 1., 0., 0., 0., 0., 0., 0.]).view([1, 1, 1, 8]);
    let y = f32s(&embed.forward(&ids).apply(&x));
    assert_abs_diff_eq!(y[1] as f64, 3f64.cos(), epsilon = 1e-6);
    assert_abs_diff_eq!(y[5] as f64, 3f64.sin(), epsilon = 1e-6);
}

#[test]
fn rms_norm_and_layer_norm_match_their_formulas() {
    let vs = VarStore::new(Device::Cpu);
    let decl = NormDecl {
        dim: 4,
        eps: 1e-6,
        bias: false,
        on_shards: false,
    };
    let norm = RmsNorm::new(&vs.root(), &decl, &TpContext::single());
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([1, 4]);
    let rms = (30.0f64 / 4.0).sqrt();
    for (got, v) in f32s(&norm.forward(&x)).iter().zip([1.0, 2.0, 3.0, 4.0]) {
        assert_abs_diff_eq!(*got as f64, v / rms, epsilon = 1e-5);
    }
    let ln = f32s(&layer_norm(&x, 1e-6));
    let sd = 1.25f64.sqrt();
    for (got, v) in ln.iter().zip([-1.5, -0.5, 0.5, 1.5]) {
        assert_abs_diff_eq!(*got as f64, v / sd, epsilon = 1e-5);
    }
    // The learnable LayerNorm: the same normalisation, then `· weight + bias`.
    let affine = LayerNorm::new(
        &vs.root().sub("ln"),
        &NormDecl { bias: true, ..decl },
        &TpContext::single(),
    );
    tch::no_grad(|| {
        affine
            .weight
            .shallow_clone()
            .copy_(&Tensor::from_slice(&[1.0f32, 2.0, -1.0, 0.5]));
        let mut bias = affine.bias.as_ref().unwrap().shallow_clone();
        bias.copy_(&Tensor::from_slice(&[0.0f32, 1.0, 0.0, -2.0]));
    });
    let (scale, shift) = ([1.0, 2.0, -1.0, 0.5], [0.0, 1.0, 0.0, -2.0]);
    let y = f32s(&affine.forward(&x));
    for i in 0..4 {
        let expected = ([-1.5, -0.5, 0.5, 1.5][i] / sd) * scale[i] + shift[i];
        assert_abs_diff_eq!(y[i] as f64, expected, epsilon = 1e-5);
    }
}
