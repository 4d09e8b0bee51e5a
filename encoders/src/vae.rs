//! FLUX.1's autoencoder (diffusers' `AutoencoderKL`, the `vae/` folder, or BFL's `ae.safetensors`): images `[B, 3, H, W]` in
//! [-1, 1] ↔ latents `[B, 16, H/f, W/f]` (`f` = 2 per down block after the first; 8 for FLUX.1).
//!
//! Encoder: a 3×3 conv in; down blocks of ResNet blocks (GroupNorm, SiLU, 3×3 convs, a 1×1
//! shortcut where the width changes), each but the last ending in a stride-2 conv after padding
//! right and bottom; a middle of ResNet, single-head self-attention over all positions, ResNet;
//! GroupNorm, SiLU, a 3×3 conv out to the posterior's mean and log-variance. Decoder: the mirror,
//! with nearest-neighbour 2× upsampling and one more ResNet block per up block.

use std::path::{Path, PathBuf};

use flux_data::convert::SafetensorsReader;

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};

use crate::bfl_vae;
pub use crate::vae_config::AutoencoderConfig;
use crate::weights::{assign, load_into, read_config, LoadError};

impl AutoencoderConfig {
    /// The configuration of the autoencoder at `path` (see [`Autoencoder::load`]): a diffusers
    /// folder's `config.json`, or what BFL's single file's shapes say.
    pub fn read(path: &Path) -> Result<Self, LoadError> {
        match bfl_vae::is_single_file(path) {
            true => {
                let reader = SafetensorsReader::open(path).map_err(|e| LoadError::new(path, e))?;
                bfl_vae::infer_config(&reader)
            }
            false => read_config(path),
        }
    }
}

const EPS: f64 = 1e-6;

fn conv(p: nn::Path, i: i64, o: i64, k: i64, stride: i64, padding: i64) -> nn::Conv2D {
    let c = nn::ConvConfig {
        stride,
        padding,
        ..Default::default()
    };
    nn::conv2d(p, i, o, k, c)
}

fn group_norm(p: nn::Path, groups: i64, channels: i64) -> nn::GroupNorm {
    let c = nn::GroupNormConfig {
        eps: EPS,
        ..Default::default()
    };
    nn::group_norm(p, groups, channels, c)
}

/// GroupNorm, SiLU, conv, GroupNorm, SiLU, conv, plus the (1×1-projected) input.
#[derive(Debug)]
struct ResnetBlock {
    norm1: nn::GroupNorm,
    conv1: nn::Conv2D,
    norm2: nn::GroupNorm,
    conv2: nn::Conv2D,
    shortcut: Option<nn::Conv2D>,
}

impl ResnetBlock {
    fn new(p: nn::Path, groups: i64, i: i64, o: i64) -> Self {
        Self {
            norm1: group_norm(&p / "norm1", groups, i),
            conv1: conv(&p / "conv1", i, o, 3, 1, 1),
            norm2: group_norm(&p / "norm2", groups, o),
            conv2: conv(&p / "conv2", o, o, 3, 1, 1),
            shortcut: (i != o).then(|| conv(&p / "conv_shortcut", i, o, 1, 1, 0)),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let h = x.apply(&self.norm1).silu().apply(&self.conv1);
        let h = h.apply(&self.norm2).silu().apply(&self.conv2);
        match &self.shortcut {
            Some(s) => x.apply(s) + h,
            None => x + h,
        }
    }
}

/// Single-head self-attention over all positions, with a residual.
#[derive(Debug)]
struct Attention {
    group_norm: nn::GroupNorm,
    to_q: nn::Linear,
    to_k: nn::Linear,
    to_v: nn::Linear,
    to_out: nn::Linear,
}

impl Attention {
    fn new(p: nn::Path, groups: i64, c: i64) -> Self {
        let linear = |name: &str| nn::linear(&p / name, c, c, Default::default());
        Self {
            group_norm: group_norm(&p / "group_norm", groups, c),
            to_q: linear("to_q"),
            to_k: linear("to_k"),
            to_v: linear("to_v"),
            to_out: nn::linear(&p / "to_out" / 0, c, c, Default::default()),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, c, h, w) = x.size4().expect("[B, C, H, W]");
        let tokens = x
            .apply(&self.group_norm)
            .view([b, c, h * w])
            .transpose(1, 2);
        let head = |l: &nn::Linear| tokens.apply(l).unsqueeze(1);
        let attended = Tensor::scaled_dot_product_attention(
            &head(&self.to_q),
            &head(&self.to_k),
            &head(&self.to_v),
            None::<Tensor>,
            0.0,
            false,
            None,
            false,
        );
        let out = attended.squeeze_dim(1).apply(&self.to_out);
        x + out.transpose(1, 2).view([b, c, h, w])
    }
}

/// ResNet, attention, ResNet.
#[derive(Debug)]
struct MidBlock {
    first: ResnetBlock,
    attention: Option<Attention>,
    second: ResnetBlock,
}

impl MidBlock {
    fn new(p: nn::Path, config: &AutoencoderConfig, c: i64) -> Self {
        let g = config.norm_num_groups;
        Self {
            first: ResnetBlock::new(&p / "resnets" / 0, g, c, c),
            attention: config
                .mid_block_add_attention
                .then(|| Attention::new(&p / "attentions" / 0, g, c)),
            second: ResnetBlock::new(&p / "resnets" / 1, g, c, c),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let x = self.first.forward(x);
        let x = match &self.attention {
            Some(a) => a.forward(&x),
            None => x,
        };
        self.second.forward(&x)
    }
}

/// A down or up block: its ResNet blocks, then the resampling conv (all blocks but the last).
#[derive(Debug)]
struct Stage {
    resnets: Vec<ResnetBlock>,
    resample: Option<nn::Conv2D>,
}

/// The posterior of an encoded image batch.
#[derive(Debug)]
pub struct Posterior {
    /// `[B, C, h, w]`.
    pub mean: Tensor,
    /// `[B, C, h, w]`, clamped to [-30, 20] as diffusers does.
    pub logvar: Tensor,
}

/// The autoencoder with its weights.
#[derive(Debug)]
pub struct Autoencoder {
    vs: VarStore,
    config: AutoencoderConfig,
    encoder_in: nn::Conv2D,
    down: Vec<Stage>,
    encoder_mid: MidBlock,
    encoder_norm: nn::GroupNorm,
    encoder_out: nn::Conv2D,
    quant_conv: Option<nn::Conv2D>,
    post_quant_conv: Option<nn::Conv2D>,
    decoder_in: nn::Conv2D,
    decoder_mid: MidBlock,
    up: Vec<Stage>,
    decoder_norm: nn::GroupNorm,
    decoder_out: nn::Conv2D,
}

impl Autoencoder {
    /// The autoencoder `config` describes with fresh weights on `device`. Fails naming what the
    /// config asks that this autoencoder does not have.
    pub fn new(config: AutoencoderConfig, device: Device) -> Result<Self, String> {
        if config.act_fn != "silu" {
            return Err(format!("act_fn `{}` (silu only)", config.act_fn));
        }
        let widths = &config.block_out_channels;
        let (first, last) = match (widths.first(), widths.last()) {
            (Some(&f), Some(&l)) => (f, l),
            _ => return Err("block_out_channels is empty".into()),
        };
        if let Some(w) = widths.iter().find(|&&w| w % config.norm_num_groups != 0) {
            return Err(format!(
                "norm_num_groups {} does not divide block width {w}",
                config.norm_num_groups
            ));
        }
        let vs = VarStore::new(device);
        let root = vs.root();
        let (g, n, latent) = (config.norm_num_groups, widths.len(), config.latent_channels);
        let enc = &root / "encoder";
        let mut down = Vec::new();
        let mut width = first;
        for (i, &out) in widths.iter().enumerate() {
            let p = &enc / "down_blocks" / i;
            let resnets = (0..config.layers_per_block)
                .map(|j| {
                    let i = if j == 0 { width } else { out };
                    ResnetBlock::new(&p / "resnets" / j, g, i, out)
                })
                .collect();
            let resample =
                (i + 1 < n).then(|| conv(&p / "downsamplers" / 0 / "conv", out, out, 3, 2, 0));
            down.push(Stage { resnets, resample });
            width = out;
        }
        let dec = &root / "decoder";
        let mut up = Vec::new();
        let mut width = last;
        for (i, &out) in widths.iter().rev().enumerate() {
            let p = &dec / "up_blocks" / i;
            let resnets = (0..=config.layers_per_block)
                .map(|j| {
                    let i = if j == 0 { width } else { out };
                    ResnetBlock::new(&p / "resnets" / j, g, i, out)
                })
                .collect();
            let resample =
                (i + 1 < n).then(|| conv(&p / "upsamplers" / 0 / "conv", out, out, 3, 1, 1));
            up.push(Stage { resnets, resample });
            width = out;
        }
        Ok(Self {
            encoder_in: conv(&enc / "conv_in", config.in_channels, first, 3, 1, 1),
            down,
            encoder_mid: MidBlock::new(&enc / "mid_block", &config, last),
            encoder_norm: group_norm(&enc / "conv_norm_out", g, last),
            encoder_out: conv(&enc / "conv_out", last, 2 * latent, 3, 1, 1),
            quant_conv: config
                .use_quant_conv
                .then(|| conv(&root / "quant_conv", 2 * latent, 2 * latent, 1, 1, 0)),
            post_quant_conv: config
                .use_post_quant_conv
                .then(|| conv(&root / "post_quant_conv", latent, latent, 1, 1, 0)),
            decoder_in: conv(&dec / "conv_in", latent, last, 3, 1, 1),
            decoder_mid: MidBlock::new(&dec / "mid_block", &config, last),
            up,
            decoder_norm: group_norm(&dec / "conv_norm_out", g, first),
            decoder_out: conv(&dec / "conv_out", first, config.out_channels, 3, 1, 1),
            vs,
            config,
        })
    }

    /// The autoencoder at `path`, on `device`: a diffusers folder (`config.json` and
    /// `diffusion_pytorch_model.safetensors`, FLUX.1's `vae/`) or BFL's single file
    /// (`ae.safetensors`, its config read from the weights' shapes).
    pub fn load(path: &Path, device: Device) -> Result<Self, LoadError> {
        let config = AutoencoderConfig::read(path)?;
        let blocks = config.block_out_channels.len();
        let mut model = Self::new(config, device).map_err(|e| LoadError::new(path, e))?;
        if bfl_vae::is_single_file(path) {
            let reader = SafetensorsReader::open(path).map_err(|e| LoadError::new(path, e))?;
            let tensors = bfl_vae::diffusers_tensors(&reader, blocks)?;
            assign(&mut model.vs, tensors, path)?;
        } else {
            load_into(&mut model.vs, path, "diffusion_pytorch_model", &[], &[])?;
        }
        Ok(model)
    }

    /// Where a FLUX.1 folder keeps its autoencoder: `folder/vae/` (diffusers' layout), else
    /// `folder/ae.safetensors` (BFL's). Fails naming both when neither is there.
    pub fn find(folder: &Path) -> Result<PathBuf, LoadError> {
        let (diffusers, bfl) = (folder.join("vae"), folder.join("ae.safetensors"));
        if diffusers.is_dir() {
            Ok(diffusers)
        } else if bfl.is_file() {
            Ok(bfl)
        } else {
            Err(LoadError::new(
                folder,
                "holds no autoencoder: neither vae/ (diffusers) nor ae.safetensors (BFL)",
            ))
        }
    }

    /// The configuration.
    pub fn config(&self) -> &AutoencoderConfig {
        &self.config
    }

    /// The posterior of images `[B, in_channels, H, W]` in [-1, 1] (H and W multiples of the
    /// downsampling factor).
    pub fn encode(&self, images: &Tensor) -> Posterior {
        let mut x = images.apply(&self.encoder_in);
        for stage in &self.down {
            for r in &stage.resnets {
                x = r.forward(&x);
            }
            if let Some(resample) = &stage.resample {
                x = x.constant_pad_nd([0, 1, 0, 1]).apply(resample);
            }
        }
        let x = self.encoder_mid.forward(&x);
        let moments = x.apply(&self.encoder_norm).silu().apply(&self.encoder_out);
        let moments = match &self.quant_conv {
            Some(q) => moments.apply(q),
            None => moments,
        };
        let parts = moments.chunk(2, 1);
        Posterior {
            mean: parts[0].shallow_clone(),
            logvar: parts[1].clamp(-30.0, 20.0),
        }
    }

    /// Images `[B, out_channels, H, W]` (about [-1, 1]) from latents `[B, latent_channels, h, w]`
    /// (unnormalised: `z / scaling_factor + shift_factor` of what the transformer denoises).
    pub fn decode(&self, latents: &Tensor) -> Tensor {
        let z = match &self.post_quant_conv {
            Some(p) => latents.apply(p),
            None => latents.shallow_clone(),
        };
        let mut x = self.decoder_mid.forward(&z.apply(&self.decoder_in));
        for stage in &self.up {
            for r in &stage.resnets {
                x = r.forward(&x);
            }
            if let Some(resample) = &stage.resample {
                x = x
                    .upsample_nearest2d_vec(None::<&[i64]>, &[2.0, 2.0][..])
                    .apply(resample);
            }
        }
        x.apply(&self.decoder_norm).silu().apply(&self.decoder_out)
    }

    /// The factor between image and latent sides.
    pub fn downsampling(&self) -> i64 {
        self.config.downsampling()
    }

    /// Images `[B, out_channels, H, W]` from what a diffusion model denoises: normalised
    /// latents, 2×2-packed or not (see [`AutoencoderConfig::packed_for`]).
    pub fn decode_model_latents(&self, latents: &Tensor) -> Result<Tensor, String> {
        let z = match self.config.packed_for(latents.size()[1])? {
            true => latents.pixel_shuffle(2),
            false => latents.shallow_clone(),
        };
        let z = z.to_device(self.device()).to_kind(self.kind());
        Ok(tch::no_grad(|| self.decode(&self.denormalize(&z))))
    }

    /// `scale · (z − shift)`: a latent as the transformer sees it.
    pub fn normalize(&self, z: &Tensor) -> Tensor {
        (z - self.config.shift_factor.unwrap_or(0.0)) * self.config.scaling_factor
    }

    /// The inverse of [`Autoencoder::normalize`], before decoding.
    pub fn denormalize(&self, latents: &Tensor) -> Tensor {
        latents / self.config.scaling_factor + self.config.shift_factor.unwrap_or(0.0)
    }

    /// The dtype of the weights.
    pub fn kind(&self) -> Kind {
        self.vs.kind()
    }

    /// Where the weights are.
    pub fn device(&self) -> Device {
        self.vs.device()
    }
}
