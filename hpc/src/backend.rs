//! Which library moves a run's collectives (`[parallelism] backend`).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tch::Device;

extern "C" {
    // csrc/c10d_groups.cpp
    fn flux_c10d_has_nccl() -> i32;
}

/// Whether this build has c10d's NCCL process group (it found CUDA's and NCCL's headers).
pub fn has_nccl() -> bool {
    // SAFETY: reads a constant.
    unsafe { flux_c10d_has_nccl() != 0 }
}

/// How a world's groups communicate: the backend a run's device takes, and how long any
/// collective or set-up step may wait for its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transport {
    /// `Mpi`, `Nccl` or `Gloo` (never `Auto`).
    pub backend: Backend,
    /// Bound on the store's connection and on c10d's own waits.
    pub timeout: Duration,
}

impl Transport {
    /// `backend` made concrete for `device` ([`Backend::resolve`]).
    pub fn new(backend: Backend, device: Device, timeout: Duration) -> Result<Self, BackendError> {
        Ok(Self {
            backend: backend.resolve(device)?,
            timeout,
        })
    }

    /// MPI, the CPU's default.
    pub fn mpi(timeout: Duration) -> Self {
        Self {
            backend: Backend::Mpi,
            timeout,
        }
    }
}

/// The library that moves the collectives of tensor and data parallelism. MPI launches and
/// places the ranks whichever it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// NCCL on CUDA (MPI where this build has no NCCL), MPI on the CPU.
    #[default]
    Auto,
    /// MPI on host `f32` buffers: CPU tensors of other dtypes are converted, CUDA tensors copied
    /// through host memory (the bytes are counted in the metrics' `host_staged_mib`).
    Mpi,
    /// libtorch's c10d ProcessGroupNCCL on CUDA tensors, where they lie.
    Nccl,
    /// libtorch's c10d ProcessGroupGloo on CPU tensors of any dtype.
    Gloo,
}

impl Backend {
    /// The field's value as written in a config.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
            Backend::Gloo => "gloo",
        }
    }

    /// The backend a run on `device` uses (`Auto` made concrete), or why it cannot: NCCL needs
    /// CUDA tensors and a build that found NCCL's headers; gloo moves CPU tensors only.
    pub fn resolve(self, device: Device) -> Result<Backend, BackendError> {
        let cuda = device.is_cuda();
        match self {
            Backend::Auto if cuda && has_nccl() => Ok(Backend::Nccl),
            Backend::Auto => Ok(Backend::Mpi),
            Backend::Nccl if !cuda => Err(BackendError::NcclWithoutCuda { device }),
            Backend::Nccl if !has_nccl() => Err(BackendError::NcclNotBuilt),
            Backend::Gloo if cuda => Err(BackendError::GlooOnCuda { device }),
            concrete => Ok(concrete),
        }
    }
}

/// Why `[parallelism] backend` cannot move this run's collectives, or its groups could not be
/// set up. Every rank reaches the first three verdicts alone, before any collective.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// NCCL asked for on a run without CUDA.
    #[error("[parallelism] backend = \"nccl\" moves CUDA tensors, but this run's device is {}: use \"mpi\" or \"gloo\" on the CPU, or run on a GPU", device_name(.device))]
    NcclWithoutCuda {
        /// The run's device.
        device: Device,
    },
    /// NCCL asked for in a build without NCCL.
    #[error("[parallelism] backend = \"nccl\": this flux-hpc was built without NCCL (CUDA's and NCCL's headers were not beside libtorch; scripts/setup.sh installs them); use \"mpi\"")]
    NcclNotBuilt,
    /// Gloo asked for on a CUDA run.
    #[error("[parallelism] backend = \"gloo\" moves CPU tensors, but this run's device is {}: use \"nccl\" (or \"mpi\", which stages through host memory)", device_name(.device))]
    GlooOnCuda {
        /// The run's device.
        device: Device,
    },
    /// The c10d store or a group could not be set up on some rank.
    #[error("[parallelism] backend = \"{backend}\": {message}")]
    Setup {
        /// The backend's name.
        backend: &'static str,
        /// What failed, and on which ranks.
        message: String,
    },
}

/// `cpu`, `cuda:N`, as `--device` spells it.
fn device_name(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_mpi_on_the_cpu() {
        assert_eq!(Backend::Auto.resolve(Device::Cpu), Ok(Backend::Mpi));
        assert_eq!(Backend::Gloo.resolve(Device::Cpu), Ok(Backend::Gloo));
        assert_eq!(Backend::Mpi.resolve(Device::Cuda(0)), Ok(Backend::Mpi));
    }

    #[test]
    fn nccl_off_cuda_and_gloo_on_cuda_are_refused_by_name() {
        let e = Backend::Nccl.resolve(Device::Cpu).unwrap_err().to_string();
        assert!(
            e.contains("backend = \"nccl\"") && e.contains("device is cpu"),
            "{e}"
        );
        let e = Backend::Gloo
            .resolve(Device::Cuda(0))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("backend = \"gloo\"") && e.contains("device is cuda:0"),
            "{e}"
        );
    }

    #[test]
    fn the_config_spelling_is_lowercase() {
        #[derive(Deserialize)]
        struct T {
            backend: Backend,
        }
        let t: T = toml::from_str("backend = \"gloo\"").unwrap();
        assert_eq!(t.backend, Backend::Gloo);
        assert!(toml::from_str::<T>("backend = \"ucc\"").is_err());
        assert_eq!(Backend::Nccl.name(), "nccl");
    }
}
