//! FLUX.1's autoencoder against diffusers' `AutoencoderKL` (random weights, FLUX.1's layout at
//! channels 16/32/32, 16 latent channels): the posterior mean and log-variance of seeded images
//! and the images decoded from seeded latents agree to 1e-4 in f32 (measured 4e-6), through the
//! loader users run on FLUX.1's `vae/` folder; and the same for BFL's single `ae.safetensors`
//! (measured 4e-6).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use flux_encoders::Autoencoder;
use tch::{Device, Tensor};

const TOLERANCE: f64 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/data/vae")
}

#[test]
fn autoencoder_encodes_and_decodes_as_diffusers() {
    let e: HashMap<String, Tensor> =
        Tensor::read_safetensors(fixtures().join("vae_outputs.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let vae = Autoencoder::load(&fixtures().join("vae"), Device::Cpu).unwrap();
    assert_eq!(vae.downsampling(), 4);
    let (posterior, decoded) = tch::no_grad(|| (vae.encode(&e["images"]), vae.decode(&e["z"])));
    for (name, ours) in [
        ("mean", &posterior.mean),
        ("logvar", &posterior.logvar),
        ("decoded", &decoded),
    ] {
        assert_eq!(ours.size(), e[name].size(), "{name}");
        let err = (ours - &e[name]).abs().max().double_value(&[]);
        println!("{name}: max abs error {err:e}");
        assert!(err <= TOLERANCE, "{name}: max abs error {err:e}");
    }
    // Normalisation round trip with FLUX.1's constants.
    let z = &e["z"];
    let back = vae.denormalize(&vae.normalize(z));
    assert!((back - z).abs().max().double_value(&[]) < 1e-6);
}

#[test]
fn bfl_single_file_loads_as_the_same_autoencoder() {
    // BFL's layout, checked by the fixture script to convert back to the model's own weights
    // through diffusers' single-file converter; 32 groups and two ResNets per block.
    let e: HashMap<String, Tensor> =
        Tensor::read_safetensors(fixtures().join("bfl_outputs.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let file = fixtures().join("bfl/ae.safetensors");
    assert_eq!(Autoencoder::find(&fixtures().join("bfl")).unwrap(), file);
    let vae = Autoencoder::load(&file, Device::Cpu).unwrap();
    let config = vae.config();
    assert_eq!(config.block_out_channels, [32, 64, 64]);
    assert_eq!((config.layers_per_block, config.latent_channels), (2, 16));
    assert_eq!(config.shift_factor, Some(0.1159));
    let (posterior, decoded) = tch::no_grad(|| (vae.encode(&e["images"]), vae.decode(&e["z"])));
    for (name, ours) in [("mean", &posterior.mean), ("decoded", &decoded)] {
        let err = (ours - &e[name]).abs().max().double_value(&[]);
        println!("{name}: max abs error {err:e}");
        assert!(err <= TOLERANCE, "{name}: max abs error {err:e}");
    }
}

#[test]
fn a_bfl_file_lacking_a_weight_is_refused_naming_it() {
    let dir = std::env::temp_dir().join(format!("flux-bfl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tensors: Vec<(String, Tensor)> =
        Tensor::read_safetensors(fixtures().join("bfl/ae.safetensors"))
            .unwrap()
            .into_iter()
            .filter(|(k, _)| k != "decoder.up.0.block.1.conv2.weight")
            .collect();
    let file = dir.join("ae.safetensors");
    Tensor::write_safetensors(&tensors, &file).unwrap();
    let err = Autoencoder::load(&file, Device::Cpu)
        .unwrap_err()
        .to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        err.contains("decoder.up_blocks.2.resnets.1.conv2.weight"),
        "{err}"
    );
    let missing = Autoencoder::find(Path::new("/nonexistent")).unwrap_err();
    assert!(missing.to_string().contains("ae.safetensors"), "{missing}");
}
