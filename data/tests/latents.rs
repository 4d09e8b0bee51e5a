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
