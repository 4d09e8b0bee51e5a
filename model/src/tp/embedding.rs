//! `Embedding`: a lookup table `[N, D]`, replicated or split by rows over the group
//! (Megatron's vocab-parallel embedding).

use tch::nn::Path;
use tch::{Kind, Tensor};

use crate::tp::linear::shard_var;
use crate::tp::{ParamSpec, Pass, TpContext};

/// Standard deviation of the initial table, `N(0, 0.02²)` as Megatron's and transformers'
/// embeddings.
pub const EMBEDDING_INIT_STD: f64 = 0.02;

/// Everything `#[embedding(..)]` says about one table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingDecl {
    /// Rows (vocabulary size, classes, positions).
    pub num: i64,
    /// Width of each row.
    pub dim: i64,
    /// Rows split over the group: each rank looks up the ids in its range and the partial
    /// outputs are summed (one forward all-reduce).
    pub vocab_parallel: bool,
}

impl EmbeddingDecl {
    /// Spec of `name.weight` `[num, dim]`.
    pub fn param_specs(&self, name: &str, tp_size: i64) -> Vec<ParamSpec> {
        let mut spec =
            ParamSpec::replicated(format!("{name}.weight"), vec![self.num, self.dim], tp_size);
        if self.vocab_parallel {
            spec.split_dim = Some(0);
            spec.all_reduce = Some(Pass::Forward);
        }
        vec![spec]
    }
}

/// A lookup table holding this rank's rows.
#[derive(Debug)]
pub struct Embedding {
    /// Local table: `[N, D]`, or rows `[r·N/tp, (r+1)·N/tp)` when vocab-parallel.
    pub weight: Tensor,
    /// First id this rank holds.
    first: i64,
    vocab_parallel: bool,
    tp: TpContext,
}

impl Embedding {
    /// Allocate this rank's rows of `decl` under `p`.
    pub fn new(p: &Path, decl: &EmbeddingDecl, tp: &TpContext) -> Self {
        let device = p.device();
        let spec = &decl.param_specs("", tp.size() as i64)[0];
        let weight = shard_var(p, spec, tp, |shape| {
            Tensor::empty(shape, (Kind::Float, device)).normal_(0.0, EMBEDDING_INIT_STD)
        });
        let first = if decl.vocab_parallel {
            tp.rank() as i64 * spec.local_shape()[0]
        } else {
            0
        };
        Self {
            weight,
            first,
            vocab_parallel: decl.vocab_parallel,
            tp: tp.clone(),
        }
    }

    /// `ids [..]` (integers in `0..N`) → rows `[.., D]`. Vocab-parallel: each rank fills the
    /// rows of the ids it holds and zeros elsewhere, and the group sums them.
    pub fn forward(&self, ids: &Tensor) -> Tensor {
        if !self.vocab_parallel {
            return Tensor::embedding(&self.weight, ids, -1, false, false);
        }
        let local = ids - self.first;
        let outside = local.lt(0).logical_or(&local.ge(self.weight.size()[0]));
        let rows = Tensor::embedding(
            &self.weight,
            &local.masked_fill(&outside, 0),
            -1,
            false,
            false,
        )
        .masked_fill(&outside.unsqueeze(-1), 0.0);
        self.tp.reduce_from_region(&rows)
    }
}
