//! Device choice: CUDA when present, CPU otherwise, or what the user forces with `--device`.

use std::str::FromStr;

use tch::{Cuda, Device};

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// CUDA (GPU `local_rank mod count`) when `tch::Cuda::is_available()`, else CPU.
    #[default]
    Auto,
    /// The CPU, even when a GPU exists.
    Cpu,
    /// A CUDA device: the given index, or `local_rank mod count`.
    Cuda(Option<usize>),
}

/// A device request that cannot be met or parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// Not one of `auto`, `cpu`, `cuda`, `cuda:N`.
    #[error("unknown device {0:?}: expected auto, cpu, cuda or cuda:N")]
    Parse(String),
    /// CUDA was asked for but libtorch sees no GPU.
    #[error("--device cuda was requested but no CUDA device is available (tch::Cuda::is_available() is false)")]
    NoCuda,
    /// The index is beyond the GPUs present.
    #[error("--device cuda:{index} was requested but only {count} CUDA device(s) exist")]
    NoSuchGpu {
        /// Requested index.
        index: usize,
        /// GPUs present.
        count: usize,
    },
}

impl FromStr for DeviceChoice {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda(None)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|n| Self::Cuda(Some(n)))
                .ok_or_else(|| DeviceError::Parse(s.to_string())),
        }
    }
}

impl DeviceChoice {
    /// The device for the rank with node-local index `local_rank`, given `gpus` visible GPUs.
    pub fn resolve_with(self, local_rank: usize, gpus: usize) -> Result<Device, DeviceError> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Auto if gpus == 0 => Ok(Device::Cpu),
            Self::Auto | Self::Cuda(None) if gpus > 0 => Ok(Device::Cuda(local_rank % gpus)),
            Self::Auto | Self::Cuda(None) => Err(DeviceError::NoCuda),
            Self::Cuda(Some(index)) if index < gpus => Ok(Device::Cuda(index)),
            Self::Cuda(Some(_)) if gpus == 0 => Err(DeviceError::NoCuda),
            Self::Cuda(Some(index)) => Err(DeviceError::NoSuchGpu { index, count: gpus }),
        }
    }

    /// [`DeviceChoice::resolve_with`] the GPUs libtorch sees on this machine.
    pub fn resolve(self, local_rank: usize) -> Result<Device, DeviceError> {
        let gpus = if Cuda::is_available() {
            Cuda::device_count() as usize
        } else {
            0
        };
        self.resolve_with(local_rank, gpus)
    }
}
