//! FLUX.1 as an architecture: what its config tells the rest of flux-hpc, and its forward pass on
//! a model-agnostic batch.

use tch::Tensor;

use crate::activations::Activations;
use crate::architecture::{
    DiffusionBatch, InputError, InputSpec, ModelConfig, Registered, RootBlock,
};
use crate::convert::{Layout, Source};
use crate::flops::{Attention, Rows};
use crate::flux::{activations, flops, layouts};
use crate::{ConfigError, FluxConfig, FluxTransformer, Widths};

impl Registered for FluxConfig {
    type Root = FluxTransformer;
    const NAME: &'static str = "flux";
    const ABOUT: &'static str = "FLUX.1 MMDiT, joint and single layers";

    /// `configs/flux_tiny.toml`'s model.
    fn tiny() -> Self {
        FluxConfig {
            num_joint_layers: 2,
            num_single_layers: 2,
            hidden_size: 64,
            num_attention_heads: 4,
            in_channels: 16,
            patch_size: 1,
            context_dim: 32,
            vec_in_dim: 16,
            model_channels: 32,
            mlp_ratio: 4.0,
            guidance_embed: true,
            theta: 10000.0,
            axes_dim: vec![4, 6, 6],
            ..FluxConfig::default()
        }
    }
}

impl ModelConfig for FluxConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        FluxConfig::validate(self)
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

    /// Norms, modulation and residuals act on slices of the sequence; not with hidden dropout,
    /// whose masks the ranks' slices would share (every rank of the group draws the same ones).
    fn check_sequence_parallel(&self) -> Result<(), ConfigError> {
        if self.hidden_dropout > 0.0 {
            return Err(ConfigError::new(
                "sequence_parallel",
                format!(
                    "needs model.hidden_dropout = 0 (got {}): the ranks' slices of the sequence \
                     would share one dropout mask",
                    self.hidden_dropout
                ),
            ));
        }
        Ok(())
    }

    fn inputs(&self) -> InputSpec {
        InputSpec {
            latent_channels: self.in_channels,
            patch_size: self.patch_size,
            text_dim: Some(self.context_dim),
            pooled_dim: Some(self.vec_in_dim),
            guidance: self.guidance_embed.then_some(self.guidance_scale),
        }
    }

    fn weight_matrices(&self) -> Vec<(f64, Rows)> {
        flops::weight_matrices(self)
    }

    fn attention(&self) -> Attention {
        flops::attention(self)
    }

    fn activations(&self) -> Activations {
        activations::activations(self)
    }

    fn uses_dropout(&self) -> bool {
        self.hidden_dropout > 0.0 || self.attention_dropout > 0.0
    }

    fn weight_layouts(&self) -> Vec<Layout> {
        vec![Layout::Bfl, Layout::Diffusers]
    }

    fn external_source(&self, native: &str, layout: Layout) -> Option<Source> {
        layouts::source(native, layout, self)
    }

    /// Fails for configs diffusers' `FluxTransformer2DModel` cannot express.
    fn diffusers_config(&self) -> Result<serde_json::Value, String> {
        let fixed = [
            (self.patch_size == 1, "model.patch_size must be 1"),
            (
                self.model_channels == 256,
                "model.model_channels must be 256",
            ),
            (self.mlp_ratio == 4.0, "model.mlp_ratio must be 4"),
            (self.theta == 10000.0, "model.theta must be 10000"),
        ];
        if let Some((_, why)) = fixed.iter().find(|(ok, _)| !ok) {
            return Err(format!(
                "diffusers' FluxTransformer2DModel cannot express this config: {why}"
            ));
        }
        Ok(serde_json::json!({
            "_class_name": "FluxTransformer2DModel",
            "patch_size": 1,
            "in_channels": self.in_channels,
            "out_channels": self.in_channels,
            "num_layers": self.num_joint_layers,
            "num_single_layers": self.num_single_layers,
            "attention_head_dim": self.head_dim(),
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.context_dim,
            "pooled_projection_dim": self.vec_in_dim,
            "guidance_embeds": self.guidance_embed,
            "axes_dims_rope": self.axes_dim,
        }))
    }

    fn summary(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "layers",
                format!(
                    "{} joint + {} single",
                    self.num_joint_layers, self.num_single_layers
                ),
            ),
            (
                "width",
                format!(
                    "hidden {} = {} heads × {}",
                    self.hidden_size,
                    self.num_attention_heads,
                    self.head_dim()
                ),
            ),
            (
                "conditioning",
                format!(
                    "text {} · pooled {} · guidance {}",
                    self.context_dim, self.vec_in_dim, self.guidance_embed
                ),
            ),
        ]
    }
}

impl RootBlock for FluxTransformer {
    fn inputs(&self) -> InputSpec {
        self.config().inputs()
    }

    fn forward_batch(&self, batch: &DiffusionBatch, train: bool) -> Result<Tensor, InputError> {
        let (text, pooled) = match (&batch.text, &batch.pooled) {
            (Some(text), Some(pooled)) => (text, pooled),
            _ => unreachable!("InputSpec::check requires both"),
        };
        Ok(self.forward(
            &batch.latents,
            text,
            pooled,
            &batch.timesteps,
            batch.guidance.as_ref(),
            train,
        ))
    }
}
