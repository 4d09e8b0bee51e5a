//! DiT as an architecture: what its config tells the rest of flux-hpc, and its forward pass on a
//! model-agnostic batch (latents, σ, a pooled conditioning vector).

use tch::Tensor;

use crate::activations::Width;
use crate::activations::{
    diffusion_io, modulated_stream, Activations, LayerActivations, Saved, StreamLinears,
};
use crate::architecture::{
    DiffusionBatch, InputError, InputSpec, ModelConfig, Registered, RootBlock,
};
use crate::dit::{DitConfig, DitTransformer};
use crate::flops::{Attention, Rows};
use crate::{ConfigError, Widths};

impl Registered for DitConfig {
    type Root = DitTransformer;
    const NAME: &'static str = "dit";
    const ABOUT: &'static str = "DiT with adaLN-Zero blocks, conditioned on a pooled vector";

    /// `configs/dit_tiny.toml`'s model.
    fn tiny() -> Self {
        DitConfig {
            depth: 4,
            hidden_size: 64,
            num_attention_heads: 4,
            mlp_ratio: 4.0,
            in_channels: 4,
            patch_size: 2,
            cond_dim: 16,
            frequency_embedding_size: 32,
            ..DitConfig::default()
        }
    }
}

impl ModelConfig for DitConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        DitConfig::validate(self)
    }

    fn widths(&self) -> Widths {
        Widths {
            hidden_size: self.hidden_size,
            num_attention_heads: self.num_attention_heads,
            mlp_ratio: self.mlp_ratio,
            in_channels: self.in_channels,
            patch_size: self.patch_size,
        }
    }

    /// Modulation and residuals act on slices of the image tokens (DiT has no dropout).
    fn check_sequence_parallel(&self) -> Result<(), ConfigError> {
        Ok(())
    }

    fn inputs(&self) -> InputSpec {
        InputSpec {
            latent_channels: self.in_channels,
            patch_size: self.patch_size,
            text_dim: None,
            pooled_dim: Some(self.cond_dim),
            guidance: None,
        }
    }

    fn weight_matrices(&self) -> Vec<(f64, Rows)> {
        let d = self.hidden_size as f64;
        let m = self.widths().mlp_hidden() as f64;
        let channels = self.widths().token_channels() as f64;
        let mut out = vec![
            (channels * d, Rows::Image),
            (
                self.frequency_embedding_size as f64 * d + d * d,
                Rows::Sample,
            ),
            (self.cond_dim as f64 * d + d * d, Rows::Sample),
        ];
        for _ in 0..self.depth {
            // adaLN modulation, fused QKV, output projection, MLP in and out.
            out.extend([
                (6.0 * d * d, Rows::Sample),
                (3.0 * d * d, Rows::Image),
                (d * d, Rows::Image),
                (2.0 * d * m, Rows::Image),
            ]);
        }
        out.extend([(2.0 * d * d, Rows::Sample), (d * channels, Rows::Image)]);
        out
    }

    /// Per block, over the image tokens: the modulated stream with the fused projection `3d`
    /// (its views are attention's queries, keys and values) and the attention output `d`
    /// (besides its copy for the output projection), and the MLP's hidden width before GELU `m`
    /// (after it, the output projection's input); and its modulation per sample.
    fn activations(&self) -> Activations {
        let d = self.hidden_size as f64;
        let m = self.widths().mlp_hidden() as f64;
        let heads = self.num_attention_heads as f64;
        let layers = (0..self.depth)
            .map(|i| {
                let mut saved = vec![Saved::new(Rows::Sample, 7.0 * d, Width::Gathered)];
                let linears = StreamLinears {
                    modulation: "adaln.linear",
                    qkv: "linear_qkv",
                    proj: "linear_proj",
                    fc1: "mlp.linear_fc1",
                    fc2: "mlp.linear_fc2",
                };
                saved.extend(modulated_stream(
                    Rows::Image,
                    (d, m, heads),
                    &linears,
                    4.0 * d,
                    m,
                ));
                LayerActivations {
                    name: DitTransformer::layer_name(i),
                    saved,
                    inputs: vec![Saved::new(Rows::Image, d, Width::Whole)],
                }
            })
            .collect();
        Activations {
            layers,
            outside: diffusion_io(
                d,
                self.widths().token_channels() as f64,
                0.0,
                self.cond_dim as f64,
                2.0,
                Rows::Image,
            ),
            stem_regathered_for: Some(0),
        }
    }

    fn attention(&self) -> Attention {
        Attention {
            layers: self.depth,
            width: self.hidden_size,
            over: Rows::Image,
        }
    }

    fn summary(&self) -> Vec<(&'static str, String)> {
        let w = self.widths();
        vec![
            ("layers", format!("{} DiT blocks", self.depth)),
            (
                "width",
                format!(
                    "hidden {} = {} heads × {}, patch {}",
                    self.hidden_size,
                    self.num_attention_heads,
                    w.head_dim(),
                    self.patch_size
                ),
            ),
            ("conditioning", format!("pooled {}", self.cond_dim)),
        ]
    }
}

impl RootBlock for DitTransformer {
    fn inputs(&self) -> InputSpec {
        self.config().inputs()
    }

    fn forward_batch(&self, batch: &DiffusionBatch, _train: bool) -> Result<Tensor, InputError> {
        let pooled = batch
            .pooled
            .as_ref()
            .expect("InputSpec::check requires the pooled vector");
        Ok(self.forward(&batch.latents, &batch.timesteps, pooled))
    }
}
