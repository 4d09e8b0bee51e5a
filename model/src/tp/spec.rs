//! `ParamSpec`: a parameter's logical name and shape and how its tensor-parallel shards tile it.

use tch::Tensor;

use crate::ConfigError;

/// How a parameter is laid out over a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Split along the output features (dim 0 of a `[out, in]` weight, and the bias).
    Column,
    /// Split along the input features (dim 1 of a `[out, in]` weight); the bias stays whole.
    Row,
}

/// How a parameter's gradient is completed across the tensor-parallel group after backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradSync {
    /// The autograd graph already yields the full gradient on every rank (or the rank's own shard).
    Complete,
    /// A replicated parameter applied to sharded activations (QK-norm scales on each rank's heads):
    /// each rank holds a partial gradient, summed over the group.
    SumOverGroup,
}

/// A pass of training: the forward pass, or the backward pass. Said of a parameter's layer
/// ([`ParamSpec::all_reduce`]): where it sums activations over a group of more than one rank,
/// partial outputs in the forward pass (row-parallel linears, vocab-parallel embeddings) or
/// partial input gradients in the backward pass (column-parallel linears).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The forward pass.
    Forward,
    /// The backward pass.
    Backward,
}

/// One parameter as checkpoints and resharding see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Dotted state-dict name, e.g. `transformer.layers.3.linear_qkv_fc1.weight`.
    pub name: String,
    /// Logical (unsharded) shape.
    pub shape: Vec<i64>,
    /// Dimension split over the group, if any.
    pub split_dim: Option<usize>,
    /// Named slices of the split dimension, each split evenly over the group: rank `r` holds the
    /// `r`-th piece of every part, concatenated in part order. One part means a plain split.
    pub parts: Vec<(String, i64)>,
    /// Size of the tensor-parallel group the local shape is for.
    pub tp_size: i64,
    /// How the gradient is completed after backward.
    pub grad_sync: GradSync,
    /// The activation all-reduce its layer issues per forward and backward pass under tensor
    /// parallelism, if any (counted on the layer's weight only).
    pub all_reduce: Option<Pass>,
    /// Whether this is a `#[linear]` layer's weight, what LoRA adapters wrap (as the model
    /// declares it; specs read back from a checkpoint's layout say `false`).
    pub linear: bool,
}

impl ParamSpec {
    /// A parameter every rank holds whole.
    pub fn replicated(name: String, shape: Vec<i64>, tp_size: i64) -> Self {
        Self {
            name,
            shape,
            split_dim: None,
            parts: Vec::new(),
            tp_size,
            grad_sync: GradSync::Complete,
            all_reduce: None,
            linear: false,
        }
    }

    /// Number of elements of the logical tensor.
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }

    /// The sizes of the split dimension's parts (one part covering it when none are named).
    fn part_sizes(&self) -> Vec<i64> {
        match self.split_dim {
            None => Vec::new(),
            Some(_) if !self.parts.is_empty() => self.parts.iter().map(|(_, s)| *s).collect(),
            Some(d) => vec![self.shape[d]],
        }
    }

    /// Check that every part of the split dimension divides evenly over the group; the error
    /// (field `tensor_parallel_size`) names the parameter, the part and the sizes.
    pub fn check_divisible(&self) -> Result<(), ConfigError> {
        let Some(dim) = self.split_dim else {
            return Ok(());
        };
        let named: Vec<(String, i64)> = match self.parts.as_slice() {
            [] => vec![(format!("dimension {dim}"), self.shape[dim])],
            parts => parts
                .iter()
                .map(|(name, size)| (format!("part `{name}`"), *size))
                .collect(),
        };
        match named.iter().find(|(_, size)| size % self.tp_size != 0) {
            None => Ok(()),
            Some((part, size)) => Err(ConfigError::new(
                "tensor_parallel_size",
                format!(
                    "{} ranks cannot split `{}`: its {part} has {size} entries, not a multiple of {}",
                    self.tp_size, self.name, self.tp_size
                ),
            )),
        }
    }

    /// The shape one rank holds (the group size divides the split dimension: see
    /// [`ParamSpec::check_divisible`], which every model build runs).
    pub fn local_shape(&self) -> Vec<i64> {
        let mut shape = self.shape.clone();
        if let Some(d) = self.split_dim {
            shape[d] /= self.tp_size;
        }
        shape
    }

    /// Elements of the shard one rank holds ([`ParamSpec::local_shape`]).
    pub fn local_numel(&self) -> u64 {
        self.local_shape().iter().map(|&d| d as u64).product()
    }

    /// Rank `rank`'s shard of the logical tensor `full`.
    pub fn shard_of(&self, full: &Tensor, rank: usize) -> Tensor {
        let Some(d) = self.split_dim else {
            return full.shallow_clone();
        };
        let mut offset = 0;
        let pieces: Vec<Tensor> = self
            .part_sizes()
            .into_iter()
            .map(|size| {
                let piece = size / self.tp_size;
                let t = full.narrow(d as i64, offset + rank as i64 * piece, piece);
                offset += size;
                t
            })
            .collect();
        Tensor::cat(&pieces, d as i64)
    }

    /// Reassemble the logical tensor from every rank's shard, in rank order.
    pub fn unshard(&self, shards: &[Tensor]) -> Tensor {
        let Some(d) = self.split_dim else {
            return shards[0].shallow_clone();
        };
        let sizes = self.part_sizes();
        let locals: Vec<i64> = sizes.iter().map(|s| s / self.tp_size).collect();
        let split: Vec<Vec<Tensor>> = shards
            .iter()
            .map(|s| s.split_with_sizes(&locals, d as i64))
            .collect();
        let ordered: Vec<&Tensor> = (0..sizes.len())
            .flat_map(|part| split.iter().map(move |pieces| &pieces[part]))
            .collect();
        Tensor::cat(&ordered, d as i64)
    }
}

/// `prefix.name`; either may be empty (an empty `name` flattens a nested block into its parent).
pub fn join_name(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (true, _) => name.to_string(),
        (false, true) => prefix.to_string(),
        (false, false) => format!("{prefix}.{name}"),
    }
}

/// Named parts as owned pairs (what `#[linear(parts = [..])]` expands to).
pub fn parts(named: &[(&str, i64)]) -> Vec<(String, i64)> {
    named.iter().map(|(n, s)| (n.to_string(), *s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(
        shape: Vec<i64>,
        split_dim: Option<usize>,
        named: &[(&str, i64)],
        tp: i64,
    ) -> ParamSpec {
        ParamSpec {
            name: "blocks.0.linear_qkv.weight".into(),
            shape,
            split_dim,
            parts: parts(named),
            tp_size: tp,
            grad_sync: GradSync::Complete,
            all_reduce: None,
            linear: true,
        }
    }

    #[test]
    fn indivisible_splits_name_the_parameter_part_and_sizes() {
        assert!(spec(vec![6, 4], None, &[], 4).check_divisible().is_ok());
        assert!(spec(vec![8, 4], Some(0), &[], 4).check_divisible().is_ok());
        let e = spec(vec![6, 4], Some(0), &[], 4)
            .check_divisible()
            .unwrap_err();
        assert_eq!(e.field, "tensor_parallel_size");
        assert_eq!(
            e.message,
            "4 ranks cannot split `blocks.0.linear_qkv.weight`: its dimension 0 has 6 entries, \
             not a multiple of 4"
        );
        // Parts split one by one: [q; k; v] of 4 each splits over 4 ranks, not over 8.
        let qkv = |tp| spec(vec![12, 4], Some(0), &[("q", 4), ("k", 4), ("v", 4)], tp);
        assert!(qkv(4).check_divisible().is_ok());
        let e = qkv(8).check_divisible().unwrap_err();
        assert!(e.message.contains("its part `q` has 4 entries"), "{e}");
    }
}
