//! `Block`: what `#[diffusion_block]` implements for every block — its config type, its
//! construction on a rank's shard of a tensor-parallel group, its parameter specs and count.

use tch::nn::Path;

use crate::execution::LayerStack;
use crate::tp::{Linear, ParamSpec, TpContext};

/// A block declared with `#[diffusion_block(config = C)]`.
pub trait Block: Sized {
    /// The config the block's attribute expressions read as `config`.
    type Config;

    /// Create the parameters below `p` for `config`: each rank allocates only its shard of the
    /// tensor-parallel group `tp`, initialised as the matching slice of the full (logical)
    /// tensor, so every group size starts from the same weights.
    fn new(p: &Path<'_>, config: &Self::Config, tp: &TpContext) -> Self;

    /// Every parameter below `prefix`: logical name and shape, and how it is split over a
    /// tensor-parallel group of `tp_size` ranks (what checkpoints save, gather and reshard).
    fn param_specs(prefix: &str, config: &Self::Config, tp_size: i64) -> Vec<ParamSpec>;

    /// Call `f` on every `Linear` of this block and its children, in declaration order (each
    /// knows its state-dict name): how adapters find the layers they wrap.
    fn visit_linears<'s>(&'s self, f: &mut dyn FnMut(&'s Linear));

    /// Call `f` on each `#[layers]` field of this block, in declaration order (not those of its
    /// children): how the framework runs a root block's layers.
    fn visit_layers<'s>(&'s self, f: &mut dyn FnMut(&'s dyn LayerStack)) {
        let _ = f;
    }

    /// Number of parameters for `config`, the same for every tensor-parallel size (computed from
    /// the specs; nothing is allocated).
    fn num_params(config: &Self::Config) -> u64 {
        Self::param_specs("", config, 1)
            .iter()
            .map(ParamSpec::numel)
            .sum()
    }
}
