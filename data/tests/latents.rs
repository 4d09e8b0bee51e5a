//! Closed-form checks of latent sampling and bf16 decoding.

use approx::assert_abs_diff_eq;
use flux_data::{bf16_from_bits, bits_from_le_bytes, bits_of, VaeNorm};
use tch::{Kind, Tensor};

#[test]
fn sampling_follows_the_mlperf_formula() {
    let mean = Tensor::from_slice(&[0.5f32, -1.0]);
    let logvar = Tensor::from_slice(&[0.0f32, 2.0f32.ln() * 2.0]); // std 1 and 2
    let noise = Tensor::from_slice(&[1.0f32, -0.5]);
    let z = Vec::<f32>::try_from(VaeNorm::FLUX1.sample(&mean, &logvar, &noise)).unwrap();
    assert_abs_diff_eq!(z[0] as f64, 0.3611 * (0.5 + 1.0 - 0.1159), epsilon = 1e-6);
    assert_abs_diff_eq!(z[1] as f64, 0.3611 * (-1.0 - 1.0 - 0.1159), epsilon = 1e-6);
}

#[test]
fn mode_and_denormalize_invert_each_other() {
    let mean = Tensor::randn([2, 16, 4, 4], (Kind::Float, tch::Device::Cpu));
    let back = VaeNorm::FLUX1.denormalize(&VaeNorm::FLUX1.mode(&mean));
    assert!((back - &mean).abs().max().double_value(&[]) < 1e-6);
}

#[test]
fn bf16_bits_decode_to_their_values() {
    // 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00 in bf16.
    let t = bf16_from_bits(&[0x3F80, 0xC000, 0x3F00, 0x0000], &[2, 2]).unwrap();
    assert_eq!(t.kind(), Kind::BFloat16);
    assert_eq!(
        Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap(),
        [1.0, -2.0, 0.5, 0.0]
    );
    assert_eq!(
        bits_from_le_bytes(&[0x80, 0x3F, 0x00, 0xC0]).unwrap(),
        [0x3F80, 0xC000]
    );
    let x = Tensor::randn([3, 5], (Kind::Float, tch::Device::Cpu));
    let round = bf16_from_bits(&bits_of(&x), &[3, 5]).unwrap();
    assert!(round.equal(&x.to_kind(Kind::BFloat16)));
}

#[test]
fn malformed_bf16_data_is_an_error() {
    assert_eq!(
        bf16_from_bits(&[1, 2, 3], &[2, 2]).unwrap_err(),
        "bf16 data holds 3 values but shape [2, 2] needs 4"
    );
    assert_eq!(
        bits_from_le_bytes(&[1, 2, 3]).unwrap_err(),
        "bf16 data has an odd byte count (3)"
    );
}

#[test]
fn synthetic_samples_are_deterministic_per_index_and_learnable() {
    use flux_data::{SyntheticLatents, SyntheticShape};
    let shape = SyntheticShape {
        channels: 4,
        height: 3,
        width: 5,
        text_len: 2,
        context_dim: 6,
        vec_dim: 8,
        factors_in_text: false,
    };
    let data = SyntheticLatents::new(7, shape);
    let ab = data.batch(&[3, 9], tch::Device::Cpu);
    let b = data.batch(&[9], tch::Device::Cpu);
    assert_eq!(ab.latents.size(), [2, 4, 3, 5]);
    assert!(
        ab.latents.get(1).equal(&b.latents.get(0)),
        "a sample does not depend on its batch"
    );
    assert!(ab.txt.get(1).equal(&b.txt.get(0)));
    // Latents are a fixed linear function of y: scaling y scales the latent.
    let other = SyntheticLatents::new(7, shape);
    assert!(other
        .batch(&[3], tch::Device::Cpu)
        .latents
        .equal(&ab.latents.narrow(0, 0, 1)));
    let var = data
        .batch(&(0..256).collect::<Vec<_>>(), tch::Device::Cpu)
        .latents
        .var(true)
        .double_value(&[]);
    assert!(
        (0.8..1.2).contains(&var),
        "latents have unit variance, got {var}"
    );
    // For a model without a pooled input the factors start the first text state (6 of 8 fit);
    // latents and pooled vectors stay the same.
    let in_text = SyntheticLatents::new(
        7,
        SyntheticShape {
            factors_in_text: true,
            ..shape
        },
    )
    .batch(&[3, 9], tch::Device::Cpu);
    assert!(in_text.latents.equal(&ab.latents) && in_text.y.equal(&ab.y));
    assert!(in_text
        .txt
        .narrow(1, 0, 1)
        .view([2, 6])
        .equal(&ab.y.narrow(1, 0, 6)));
    assert!(in_text.txt.narrow(1, 1, 1).equal(&ab.txt.narrow(1, 1, 1)));
}

#[test]
fn keyed_streams_are_independent_of_order() {
    use flux_data::KeyedRng;
    let a: Vec<u64> = (0..3).map(|_| KeyedRng::new(1, 5, 0).next_u64()).collect();
    assert!(a.iter().all(|&x| x == a[0]));
    assert_ne!(
        KeyedRng::new(1, 5, 0).next_u64(),
        KeyedRng::new(1, 6, 0).next_u64()
    );
    assert_ne!(
        KeyedRng::new(1, 5, 0).next_u64(),
        KeyedRng::new(1, 5, 1).next_u64()
    );
    let mut r = KeyedRng::new(3, 0, 0);
    let xs: Vec<f64> = (0..20_000).map(|_| r.normal()).collect();
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
    assert!(
        mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
        "mean {mean} var {var}"
    );
}
