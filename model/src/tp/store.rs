//! `ShardedStore`: a model's parameters on one rank — the `VarStore` of local shards, the logical
//! spec of every parameter, and the tensor-parallel group — with the operations that span ranks.

use std::collections::HashMap;

use tch::nn::{Path, VarStore};
use tch::{Device, Kind, Tensor};

use crate::tp::{GradSync, ParamSpec, TpContext};
use crate::ConfigError;

/// A parameter that could not be set from logical tensors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogicalLoadError {
    /// No tensor of that name was given.
    #[error("no tensor for parameter `{0}`")]
    Missing(String),
    /// The tensor's shape is not the parameter's logical shape.
    #[error("`{name}`: expected logical shape {expected:?}, got {got:?}")]
    Shape {
        /// Parameter name.
        name: String,
        /// Its logical shape.
        expected: Vec<i64>,
        /// The given shape.
        got: Vec<i64>,
    },
}

/// One rank's parameters of a model built from `#[diffusion_block]`s.
#[derive(Debug)]
pub struct ShardedStore {
    /// Owner of this rank's shards, keyed by state-dict name.
    pub vs: VarStore,
    specs: Vec<ParamSpec>,
    tp: TpContext,
}

impl ShardedStore {
    /// Build a model's modules with `build` (its generated `new`) on `device` for the group `tp`,
    /// recording `specs` (its generated `param_specs` for `tp`'s size), every variable in `kind`:
    /// each weight is initialised in f32 and rounded as it is created, so the model is never
    /// whole in f32 when `kind` is narrower. Fails, before allocating, when the group size does
    /// not divide a split dimension (naming the parameter and sizes).
    pub fn build<M>(
        device: Device,
        kind: Kind,
        tp: TpContext,
        specs: Vec<ParamSpec>,
        build: impl FnOnce(&Path, &TpContext) -> M,
    ) -> Result<(Self, M), ConfigError> {
        for spec in &specs {
            spec.check_divisible()?;
        }
        let mut vs = VarStore::new(device);
        vs.set_kind(kind);
        let modules = build(&vs.root(), &tp);
        Ok((Self { vs, specs, tp }, modules))
    }

    /// The tensor-parallel group.
    pub fn tp(&self) -> &TpContext {
        &self.tp
    }

    /// Every parameter's logical name, shape and split, in construction order.
    pub fn param_specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Number of parameters held on this rank: all, or only those that require gradients.
    pub fn num_local_params(&self, trainable_only: bool) -> u64 {
        self.vs
            .variables()
            .values()
            .filter(|t| !trainable_only || t.requires_grad())
            .map(|t| t.numel() as u64)
            .sum()
    }

    /// Complete gradients after backward: sum the partial gradients of replicated parameters that
    /// act on sharded heads (QK-norm scales) over the tensor-parallel group, in one bucket.
    pub fn finish_grads(&self) {
        let vars = self.vs.variables();
        let partial: Vec<Tensor> = self
            .specs
            .iter()
            .filter(|s| s.grad_sync == GradSync::SumOverGroup)
            .map(|s| vars[&s.name].shallow_clone())
            .collect();
        self.tp.sum_grads(&partial);
    }

    /// Every parameter (or, with `grads`, its gradient) at its logical shape, gathered over the
    /// tensor-parallel group (a collective: every rank of the group must call it).
    pub fn gather_logical(&self, grads: bool) -> Vec<(String, Tensor)> {
        let vars = self.vs.variables();
        self.specs
            .iter()
            .map(|spec| {
                let var = &vars[&spec.name];
                let local = if grads { var.grad() } else { var.detach() };
                (spec.name.clone(), self.tp.gather(spec, &local))
            })
            .collect()
    }

    /// Set every parameter from logical tensors; this rank keeps its shard.
    pub fn load_logical(
        &mut self,
        tensors: &HashMap<String, Tensor>,
    ) -> Result<(), LogicalLoadError> {
        let vars = self.vs.variables();
        for spec in &self.specs {
            let full = tensors
                .get(&spec.name)
                .ok_or_else(|| LogicalLoadError::Missing(spec.name.clone()))?;
            self.set_shard(spec, &vars[&spec.name], full)?;
        }
        Ok(())
    }

    /// Set parameter `name` from its logical tensor `full`; this rank keeps its shard (so a
    /// model can be loaded one tensor at a time).
    pub fn load_one(&mut self, name: &str, full: &Tensor) -> Result<(), LogicalLoadError> {
        let spec = self
            .specs
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| LogicalLoadError::Missing(name.to_string()))?;
        self.set_shard(spec, &self.vs.variables()[name], full)
    }

    /// Copy this rank's shard of `full`, the logical tensor of `spec`, into `var`.
    fn set_shard(
        &self,
        spec: &ParamSpec,
        var: &Tensor,
        full: &Tensor,
    ) -> Result<(), LogicalLoadError> {
        if full.size() != spec.shape {
            return Err(LogicalLoadError::Shape {
                name: spec.name.clone(),
                expected: spec.shape.clone(),
                got: full.size(),
            });
        }
        let local = spec.shard_of(full, self.tp.rank());
        tch::no_grad(|| var.shallow_clone().copy_(&local));
        Ok(())
    }
}

/// Check that `size` ranks can split `heads` attention heads and an MLP of width `mlp`.
pub fn check_tp_size(heads: i64, mlp: i64, size: usize) -> Result<(), crate::ConfigError> {
    let size = size as i64;
    if heads % size == 0 && mlp % size == 0 {
        Ok(())
    } else {
        Err(crate::ConfigError::new(
            "tensor_parallel_size",
            format!("{size} must divide num_attention_heads ({heads}) and the MLP width ({mlp})"),
        ))
    }
}
