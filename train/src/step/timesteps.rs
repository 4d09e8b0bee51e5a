//! Training timestep samplers: which noise levels a batch is trained at.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::scheduler::FlowMatchEulerDiscreteScheduler;

/// A sampling strategy (`[training] timestep_sampling`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "strategy")]
pub enum TimestepSampler {
    /// `idx = ⌊sigmoid(N(mean, std))·1000⌋`: favours the middle of the schedule (SD3, Flux).
    LogitNormal {
        /// Mean of the normal.
        mean: f64,
        /// Standard deviation of the normal.
        std: f64,
    },
    /// Uniform over the 1000 training bins.
    Uniform,
    /// SD3's mode sampling: `u ← 1 − u − s·(cos²(πu/2) − 1 + u)`.
    Mode {
        /// `s` (1.29 in SD3).
        scale: f64,
    },
    /// Continuous `σ ~ U(0, 1)`, `t = 1000·σ` (NVIDIA's MLPerf reference).
    DirectUniform,
}

impl TimestepSampler {
    /// A sampler by name with the reference defaults: `logit_normal` (0, 1), `uniform`,
    /// `mode` (1.29), `direct_uniform`.
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "logit_normal" => Ok(Self::LogitNormal { mean: 0.0, std: 1.0 }),
            "uniform" => Ok(Self::Uniform),
            "mode" => Ok(Self::Mode { scale: 1.29 }),
            "direct_uniform" => Ok(Self::DirectUniform),
            other => Err(format!(
                "unknown timestep sampling strategy {other:?}; expected logit_normal, uniform, mode or direct_uniform"
            )),
        }
    }

    /// `(timesteps [B] in [0, 1000], sigmas [B] in [0, 1])` from per-sample uniforms `u [B]` in
    /// `[0, 1)` and standard normals `z [B]` (the caller owns the randomness, so runs are
    /// reproducible sample by sample). Discrete strategies look up `scheduler`'s training tables.
    pub fn sample(
        &self,
        u: &Tensor,
        z: &Tensor,
        scheduler: &FlowMatchEulerDiscreteScheduler,
    ) -> (Tensor, Tensor) {
        let n = scheduler.num_train_timesteps as f64;
        let bins = |x: Tensor| {
            (x * n)
                .to_kind(Kind::Int64)
                .clamp(0, scheduler.num_train_timesteps as i64 - 1)
        };
        let idx = match *self {
            Self::LogitNormal { mean, std } => bins((z * std + mean).sigmoid()),
            Self::Uniform => bins(u.shallow_clone()),
            Self::Mode { scale } => {
                let cos = (u * (std::f64::consts::PI / 2.0)).cos();
                bins(u.ones_like() - u - (cos.square() - 1.0 + u) * scale)
            }
            Self::DirectUniform => {
                let sigma = u.to_kind(Kind::Float);
                return (&sigma * n, sigma);
            }
        };
        let device = u.device();
        let sigmas = Tensor::from_slice(&scheduler.train_sigmas)
            .to_device(device)
            .to_kind(Kind::Float);
        let timesteps = Tensor::from_slice(&scheduler.train_timesteps)
            .to_device(device)
            .to_kind(Kind::Float);
        (
            timesteps.index_select(0, &idx),
            sigmas.index_select(0, &idx),
        )
    }
}
