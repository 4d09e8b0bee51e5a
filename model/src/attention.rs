//! Attention pieces shared by the joint and single blocks: head split, QK-norm, RoPE, one SDPA call.

use tch::Tensor;

use crate::embeddings::Rope;
use crate::layers::RmsNorm;
use crate::params::ParamPath;

/// Queries, keys and values of one stream, each `[B, H, L, Dh]`.
#[derive(Debug)]
pub struct Qkv {
    /// `[B, H, L, Dh]`.
    pub q: Tensor,
    /// `[B, H, L, Dh]`.
    pub k: Tensor,
    /// `[B, H, L, Dh]`.
    pub v: Tensor,
}

impl Qkv {
    /// Split a fused projection `[B, L, 3·H·Dh]` laid out `[q; k; v]` into heads.
    pub fn from_fused(qkv: &Tensor, heads: i64) -> Self {
        let (b, l, width) = qkv.size3().expect("fused qkv must be [B, L, 3·D]");
        let head_dim = width / (3 * heads);
        let parts = qkv
            .view([b, l, 3, heads, head_dim])
            .permute([2, 0, 3, 1, 4])
            .unbind(0);
        let [q, k, v]: [Tensor; 3] = parts.try_into().expect("three parts");
        Self { q, k, v }
    }

    /// Concatenate streams along the sequence (`[txt; img]` in the joint block).
    pub fn cat(streams: &[&Qkv]) -> Self {
        let gather = |f: fn(&Qkv) -> &Tensor| {
            Tensor::cat(&streams.iter().map(|s| f(s)).collect::<Vec<_>>(), 2)
        };
        Self {
            q: gather(|s| &s.q),
            k: gather(|s| &s.k),
            v: gather(|s| &s.v),
        }
    }
}

/// QK-norm: RMSNorm with learnable scale on each head's queries and keys.
#[derive(Debug)]
pub struct QkNorm<P = Tensor> {
    /// Scale `[Dh]` for queries.
    pub q_layernorm: RmsNorm<P>,
    /// Scale `[Dh]` for keys.
    pub k_layernorm: RmsNorm<P>,
}

impl<P> QkNorm<P> {
    /// Create `p.{prefix}q_layernorm` and `p.{prefix}k_layernorm`, each `[head_dim]`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, prefix: &str, head_dim: i64, eps: f64) -> Self {
        Self {
            q_layernorm: RmsNorm::new(&p.sub(&format!("{prefix}q_layernorm")), head_dim, eps),
            k_layernorm: RmsNorm::new(&p.sub(&format!("{prefix}k_layernorm")), head_dim, eps),
        }
    }
}

impl QkNorm {
    /// Normalise `qkv`'s queries and keys; values pass through. Result in `v`'s dtype.
    pub fn forward(&self, qkv: Qkv) -> Qkv {
        let kind = qkv.v.kind();
        Qkv {
            q: self.q_layernorm.forward(&qkv.q).to_kind(kind),
            k: self.k_layernorm.forward(&qkv.k).to_kind(kind),
            v: qkv.v,
        }
    }
}

/// RoPE on queries and keys, then one scaled-dot-product attention over the whole sequence
/// (no mask). `qkv` `[B, H, L, Dh]` → `[B, L, H·Dh]`.
pub fn attention(qkv: &Qkv, rope: &Rope, dropout: f64) -> Tensor {
    let q = rope.apply(&qkv.q);
    let k = rope.apply(&qkv.k);
    let out = Tensor::scaled_dot_product_attention(
        &q,
        &k,
        &qkv.v,
        None::<Tensor>,
        dropout,
        false,
        None,
        false,
    );
    out.transpose(1, 2).flatten(2, 3)
}
