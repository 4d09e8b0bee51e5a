//! The `[logging]` and `[sampling]` tables of a run config: what a run shows while it trains
//! besides `metrics.jsonl` and the loss curve.

use std::path::PathBuf;

use flux_model::ConfigError;
use serde::{Deserialize, Serialize};

use crate::sampling::OdeSettings;

/// `[logging]`: where training records go besides `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    /// Write TensorBoard event files into `<run dir>/tensorboard/`: the scalars of each
    /// metrics record (loss, learning rate, gradient norm, throughput, held-out loss) and the
    /// `[sampling]` grids.
    pub tensorboard: bool,
}

/// `[sampling]`: images sampled from fixed prompts and seeds while training, one PNG grid per
/// time (rows: prompts, columns: seeds) in `<run dir>/samples/step_<N>.png`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingConfig {
    /// Steps between sample grids, plus one at the last step (0: none).
    pub interval: u64,
    /// A FLUX.1 folder (as `flux-hpc sample --encoders`): its text encoders encode the prompts
    /// once at the start, its autoencoder decodes the samples.
    pub encoders: Option<PathBuf>,
    /// The prompts, one grid row each.
    pub prompts: Vec<String>,
    /// Seeds of the starting noise, one grid column each (a cell is what `flux-hpc sample
    /// --prompt P --seed S` gives for the same weights).
    pub seeds: Vec<u64>,
    /// ODE steps.
    pub steps: usize,
    /// Image width in pixels (default: `[training] latent_width` latents).
    pub width: Option<i64>,
    /// Image height in pixels (default: `[training] latent_height` latents).
    pub height: Option<i64>,
    /// Guidance strength given to a guidance-embedding model (default: `[model]`'s).
    pub guidance: Option<f64>,
    /// Two-pass classifier-free guidance scale against empty prompts (default: none).
    pub cfg_scale: Option<f64>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            interval: 0,
            encoders: None,
            prompts: Vec::new(),
            seeds: vec![0],
            steps: 20,
            width: None,
            height: None,
            guidance: None,
            cfg_scale: None,
        }
    }
}

impl SamplingConfig {
    /// Whether the run samples at all.
    pub fn enabled(&self) -> bool {
        self.interval > 0
    }

    /// Check the table; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled() {
            return Ok(());
        }
        ConfigError::check(self.encoders.is_some(), "encoders", || {
            "sampling needs a FLUX.1 folder to encode prompts and decode images".into()
        })?;
        ConfigError::check(!self.prompts.is_empty(), "prompts", || {
            "sampling needs at least one prompt".into()
        })?;
        ConfigError::check(!self.seeds.is_empty(), "seeds", || {
            "sampling needs at least one seed".into()
        })?;
        self.ode().check()?;
        for (name, side) in [("width", self.width), ("height", self.height)] {
            ConfigError::check(side.is_none_or(|s| s > 0), name, || {
                format!("must be positive, got {side:?}")
            })?;
        }
        Ok(())
    }

    /// How each grid's samples are integrated (Euler's steps).
    pub fn ode(&self) -> OdeSettings {
        OdeSettings {
            steps: self.steps,
            heun: false,
            guidance: self.guidance,
            cfg_scale: self.cfg_scale,
        }
    }

    /// Whether a grid is drawn after `step` of a run stopping at `last`.
    pub fn due(&self, step: u64, last: bool) -> bool {
        self.enabled() && (last || step.is_multiple_of(self.interval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enabled() -> SamplingConfig {
        SamplingConfig {
            interval: 5,
            encoders: Some("flux".into()),
            prompts: vec!["a cat".into()],
            ..Default::default()
        }
    }

    #[test]
    fn an_enabled_table_needs_encoders_prompts_and_seeds() {
        assert!(SamplingConfig::default().validate().is_ok());
        assert!(enabled().validate().is_ok());
        let cases = [
            (
                SamplingConfig {
                    encoders: None,
                    ..enabled()
                },
                "encoders",
            ),
            (
                SamplingConfig {
                    prompts: vec![],
                    ..enabled()
                },
                "prompts",
            ),
            (
                SamplingConfig {
                    seeds: vec![],
                    ..enabled()
                },
                "seeds",
            ),
            (
                SamplingConfig {
                    steps: 0,
                    ..enabled()
                },
                "steps",
            ),
            (
                SamplingConfig {
                    width: Some(0),
                    ..enabled()
                },
                "width",
            ),
        ];
        for (config, field) in cases {
            assert_eq!(config.validate().unwrap_err().field, field);
        }
    }

    #[test]
    fn grids_are_due_every_interval_and_at_the_last_step() {
        let s = enabled();
        let due: Vec<u64> = (1..=12).filter(|&k| s.due(k, k == 12)).collect();
        assert_eq!(due, [5, 10, 12]);
        assert!(!SamplingConfig::default().due(12, true));
    }
}
