//! FLUX.2 as an architecture: what its config tells the rest of flux-hpc, and its forward pass on
//! a model-agnostic batch (latents, σ, text states, guidance; no pooled vector).

use tch::Tensor;

use crate::activations::{
    diffusion_io, joint_layer, single_stream_layer, Activations, Saved, StreamLinears, Width,
};
use crate::architecture::{
    DiffusionBatch, InputError, InputSpec, ModelConfig, Registered, RootBlock,
};
use crate::convert::{Layout, Source};
use crate::flops::{Attention, Rows};
use crate::flux2::{layouts, Flux2Config, Flux2Transformer};
use crate::{ConfigError, Widths};

impl Registered for Flux2Config {
    type Root = Flux2Transformer;
    const NAME: &'static str = "flux2";
    const ABOUT: &'static str = "FLUX.2 MMDiT: shared modulation, SwiGLU, 4-axis RoPE, no biases";

    /// `configs/flux2_tiny.toml`'s model.
    fn tiny() -> Self {
        Flux2Config {
            num_layers: 2,
            num_single_layers: 2,
            num_attention_heads: 4,
            attention_head_dim: 16,
            in_channels: 16,
            patch_size: 1,
            joint_attention_dim: 32,
            timestep_guidance_channels: 32,
            mlp_ratio: 3.0,
            axes_dims_rope: vec![4, 4, 4, 4],
            rope_theta: 2000.0,
            guidance_embeds: true,
            ..Flux2Config::default()
        }
    }
}

impl ModelConfig for Flux2Config {
    fn validate(&self) -> Result<(), ConfigError> {
        Flux2Config::validate(self)
    }

    fn widths(&self) -> Widths {
        Widths {
            hidden_size: self.hidden_size(),
            num_attention_heads: self.num_attention_heads,
            mlp_ratio: self.mlp_ratio,
            in_channels: self.in_channels,
            patch_size: self.patch_size,
        }
    }

    /// Modulation and residuals act on slices of the sequence (FLUX.2 has no dropout).
    fn check_sequence_parallel(&self) -> Result<(), ConfigError> {
        Ok(())
    }

    fn inputs(&self) -> InputSpec {
        InputSpec {
            latent_channels: self.in_channels,
            patch_size: self.patch_size,
            text_dim: Some(self.joint_attention_dim),
            pooled_dim: None,
            guidance: self.guidance_embeds.then_some(self.guidance_scale),
        }
    }

    fn weight_matrices(&self) -> Vec<(f64, Rows)> {
        let d = self.hidden_size() as f64;
        let m = self.mlp_hidden() as f64;
        let channels = self.token_channels() as f64;
        let timestep = self.timestep_guidance_channels as f64 * d + d * d;
        let mut out = vec![
            (channels * d, Rows::Image),
            (self.joint_attention_dim as f64 * d, Rows::Text),
            (timestep, Rows::Sample),
        ];
        if self.guidance_embeds {
            out.push((timestep, Rows::Sample));
        }
        // The shared modulations: double image, double text, single.
        out.extend([
            (6.0 * d * d, Rows::Sample),
            (6.0 * d * d, Rows::Sample),
            (3.0 * d * d, Rows::Sample),
        ]);
        for _ in 0..self.num_layers {
            for rows in [Rows::Image, Rows::Text] {
                // q, k, v, output projection, SwiGLU in (gate and value) and out.
                out.extend([
                    (3.0 * d * d, rows),
                    (d * d, rows),
                    (2.0 * m * d, rows),
                    (m * d, rows),
                ]);
            }
        }
        for _ in 0..self.num_single_layers {
            out.extend([
                ((3.0 * d + 2.0 * m) * d, Rows::Tokens),
                ((d + m) * d, Rows::Tokens),
            ]);
        }
        out.extend([(2.0 * d * d, Rows::Sample), (d * channels, Rows::Image)]);
        out
    }

    /// As FLUX.1's ([`crate::flux::activations`]) with SwiGLU MLPs: the fused gate and value
    /// `2m`, SiLU of the gate `m` and the product `m`, the output projection's input (in the
    /// single layers copied into the `[attention | MLP]` input), and the modulation computed
    /// once per model rather than per layer.
    fn activations(&self) -> Activations {
        let d = self.hidden_size() as f64;
        let m = self.mlp_hidden() as f64;
        let heads = self.num_attention_heads as f64;
        let image = StreamLinears {
            modulation: "",
            qkv: "attn.to_qkv",
            proj: "attn.to_out.0",
            fc1: "ff.linear_in",
            fc2: "ff.linear_out",
        };
        let text = StreamLinears {
            qkv: "attn.to_added_qkv",
            proj: "attn.to_add_out",
            fc1: "ff_context.linear_in",
            fc2: "ff_context.linear_out",
            ..image
        };
        let joint = (0..self.num_layers).map(|i| {
            joint_layer(
                Flux2Transformer::layer_name(false, i),
                (d, m, heads),
                [&image, &text],
                3.0 * m,
                Vec::new(),
            )
        });
        let single = (0..self.num_single_layers).map(|j| {
            single_stream_layer(
                Flux2Transformer::layer_name(true, j),
                (d, heads),
                ["", "attn.to_qkv_mlp_proj", "attn.to_out"],
                (6.0 * d + 3.0 * m, d + m),
                Vec::new(),
            )
        });
        let layers = joint.chain(single).collect();
        let embedders = if self.guidance_embeds { 2.0 } else { 1.0 };
        let mut outside = diffusion_io(
            d,
            self.token_channels() as f64,
            self.joint_attention_dim as f64,
            0.0,
            embedders,
            Rows::Tokens,
        );
        // The three shared modulations: SiLU of the conditioning and `6d + 6d + 3d` outputs.
        outside.push(Saved::new(Rows::Sample, 18.0 * d, Width::Gathered));
        Activations {
            layers,
            outside,
            stem_regathered_for: Some(self.num_layers),
        }
    }

    fn attention(&self) -> Attention {
        Attention {
            layers: self.num_layers + self.num_single_layers,
            width: self.hidden_size(),
            over: Rows::Tokens,
        }
    }

    fn weight_layouts(&self) -> Vec<Layout> {
        vec![Layout::Bfl, Layout::Diffusers]
    }

    fn external_source(&self, native: &str, layout: Layout) -> Option<Source> {
        layouts::source(native, layout)
    }

    fn diffusers_config(&self) -> Result<serde_json::Value, String> {
        Ok(serde_json::json!({
            "_class_name": "Flux2Transformer2DModel",
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "out_channels": self.in_channels,
            "num_layers": self.num_layers,
            "num_single_layers": self.num_single_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "timestep_guidance_channels": self.timestep_guidance_channels,
            "mlp_ratio": self.mlp_ratio,
            "axes_dims_rope": self.axes_dims_rope,
            "rope_theta": self.rope_theta,
            "eps": self.eps,
            "guidance_embeds": self.guidance_embeds,
        }))
    }

    fn summary(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "layers",
                format!(
                    "{} double + {} single",
                    self.num_layers, self.num_single_layers
                ),
            ),
            (
                "width",
                format!(
                    "hidden {} = {} heads × {}, SwiGLU {}",
                    self.hidden_size(),
                    self.num_attention_heads,
                    self.attention_head_dim,
                    self.mlp_hidden()
                ),
            ),
            (
                "conditioning",
                format!(
                    "text {} · guidance {}",
                    self.joint_attention_dim, self.guidance_embeds
                ),
            ),
        ]
    }
}

impl RootBlock for Flux2Transformer {
    fn inputs(&self) -> InputSpec {
        self.config().inputs()
    }

    fn forward_batch(&self, batch: &DiffusionBatch, _train: bool) -> Result<Tensor, InputError> {
        let text = batch
            .text
            .as_ref()
            .expect("InputSpec::check requires the text states");
        Ok(self.forward(
            &batch.latents,
            text,
            &batch.timesteps,
            batch.guidance.as_ref(),
        ))
    }
}
