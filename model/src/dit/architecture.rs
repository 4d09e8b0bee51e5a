//! DiT as an architecture: what its config tells the rest of flux-hpc, and its forward pass on a
//! model-agnostic batch (latents, σ, a pooled conditioning vector).

use tch::{Device, Tensor};

use crate::architecture::{DiffusionBatch, DiffusionModel, InputError, InputSpec, ModelConfig};
use crate::dit::{Dit, DitConfig, DitTransformer};
use crate::flops::{Attention, Rows};
use crate::tp::{check_tp_size, ParamSpec, ShardedStore, TpContext};
use crate::ConfigError;

impl ModelConfig for DitConfig {
    const NAME: &'static str = "dit";
    const ABOUT: &'static str = "DiT with adaLN-Zero blocks, conditioned on a pooled vector";

    fn validate(&self) -> Result<(), ConfigError> {
        DitConfig::validate(self)
    }

    fn check_tp_size(&self, tp: usize) -> Result<(), ConfigError> {
        check_tp_size(self.num_attention_heads, self.widths().mlp_hidden(), tp)
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

    fn param_specs(&self, tp_size: i64) -> Vec<ParamSpec> {
        DitTransformer::param_specs("", self, tp_size)
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

    fn build(&self, device: Device, tp: TpContext) -> Result<Box<dyn DiffusionModel>, ConfigError> {
        Ok(Box::new(Dit::new_parallel(self, device, tp)?))
    }
}

impl DiffusionModel for Dit {
    fn store(&self) -> &ShardedStore {
        &self.store
    }

    fn store_mut(&mut self) -> &mut ShardedStore {
        &mut self.store
    }

    fn forward(&self, batch: &DiffusionBatch, train: bool) -> Result<Tensor, InputError> {
        ModelConfig::inputs(self.transformer.config()).check(batch)?;
        let pooled = batch
            .pooled
            .as_ref()
            .expect("InputSpec::check requires the pooled vector");
        Ok(self
            .transformer
            .forward_t(&batch.latents, &batch.timesteps, pooled, train))
    }

    fn set_recompute(&self, on: bool) {
        self.transformer.set_recompute(on);
    }
}
