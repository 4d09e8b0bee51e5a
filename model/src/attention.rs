//! Attention pieces shared by the joint and single blocks: head split, QK-norm, RoPE, one SDPA call.

use tch::Tensor;

use crate::embeddings::Rope;
use crate::tp::RmsNorm;

/// Queries, keys and values of one stream, each `[B, H, L, Dh]` (`H` = this rank's heads).
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
    /// Split a fused projection `[B, L, 3·H·Dh]` laid out `[q; k; v]` into heads of width
    /// `head_dim` (`H` follows from the width, so a rank's shard splits the same way).
    pub fn from_fused(qkv: &Tensor, head_dim: i64) -> Self {
        let (b, l, width) = qkv.size3().expect("fused qkv must be [B, L, 3·H·Dh]");
        let heads = width / (3 * head_dim);
        let parts = qkv
            .view([b, l, 3, heads, head_dim])
            .permute([2, 0, 3, 1, 4])
            .unbind(0);
        let [q, k, v]: [Tensor; 3] = parts.try_into().expect("three parts");
        Self { q, k, v }
    }

    /// Split separate projections `q`, `k`, `v` (each `[B, L, H·Dh]`) into heads of width
    /// `head_dim`.
    pub fn from_separate(q: &Tensor, k: &Tensor, v: &Tensor, head_dim: i64) -> Self {
        let heads = |x: &Tensor| {
            let (b, l, width) = x.size3().expect("projections must be [B, L, H·Dh]");
            x.view([b, l, width / head_dim, head_dim]).transpose(1, 2)
        };
        Self {
            q: heads(q),
            k: heads(k),
            v: heads(v),
        }
    }

    /// Tokens `L`.
    pub fn tokens(&self) -> i64 {
        self.q.size()[2]
    }

    /// RMS-normalise queries and keys with their learnable scales; values pass through.
    pub fn normalized(self, q_norm: &RmsNorm, k_norm: &RmsNorm) -> Self {
        let kind = self.v.kind();
        Self {
            q: q_norm.forward(&self.q).to_kind(kind),
            k: k_norm.forward(&self.k).to_kind(kind),
            v: self.v,
        }
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

/// RoPE (if any) on queries and keys, then one scaled-dot-product attention over the whole
/// sequence (no mask). `qkv` `[B, H, L, Dh]` → `[B, L, H·Dh]`.
pub fn attention(qkv: &Qkv, rope: Option<&Rope>, dropout: f64) -> Tensor {
    let (q, k) = match rope {
        Some(rope) => (rope.apply(&qkv.q), rope.apply(&qkv.k)),
        None => (qkv.q.shallow_clone(), qkv.k.shallow_clone()),
    };
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
