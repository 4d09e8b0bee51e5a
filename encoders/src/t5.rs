//! T5's encoder (transformers' `T5EncoderModel`, FLUX.1's `text_encoder_2/`, T5 v1.1 XXL): shared
//! token embeddings; pre-norm blocks of self-attention with a learned relative-position bias
//! (bucketed, computed by the first block and shared by all; scores unscaled) and a gated-GELU
//! feed-forward; RMS norms without bias; a final norm. Flux takes the final states.

use std::path::Path;

use serde::Deserialize;
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

use crate::weights::{load_into, read_config, LoadError};

/// The fields of `config.json` the encoder needs (others are ignored).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct T5Config {
    /// Embedding rows.
    pub vocab_size: i64,
    /// Model width D.
    pub d_model: i64,
    /// Width of each head's keys and values.
    pub d_kv: i64,
    /// Feed-forward width.
    pub d_ff: i64,
    /// Encoder blocks.
    pub num_layers: i64,
    /// Attention heads.
    pub num_heads: i64,
    /// Relative-position buckets (half for each direction).
    #[serde(default = "default_buckets")]
    pub relative_attention_num_buckets: i64,
    /// Distance from which all positions share the last bucket.
    #[serde(default = "default_max_distance")]
    pub relative_attention_max_distance: i64,
    /// RMS-norm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// `gated-gelu` (v1.1: GELU with tanh), `relu` (the original T5), or `gated-…`/plain with
    /// `dense_act_fn`.
    #[serde(default = "default_ff")]
    pub feed_forward_proj: String,
    /// The activation, where `feed_forward_proj` does not fix it.
    #[serde(default)]
    pub dense_act_fn: Option<String>,
}

fn default_buckets() -> i64 {
    32
}

fn default_max_distance() -> i64 {
    128
}

fn default_eps() -> f64 {
    1e-6
}

fn default_ff() -> String {
    "relu".into()
}

/// The feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Activation {
    Relu,
    Gelu,
    GeluTanh,
}

impl T5Config {
    /// Whether the feed-forward is gated, and its activation, as transformers reads them.
    fn feed_forward(&self) -> Result<(bool, Activation), String> {
        let proj = self.feed_forward_proj.as_str();
        let gated = proj.starts_with("gated-");
        let name = match (proj, &self.dense_act_fn) {
            ("gated-gelu", _) => "gelu_new",
            (_, Some(act)) => act.as_str(),
            _ => proj.trim_start_matches("gated-"),
        };
        let act = match name {
            "relu" => Activation::Relu,
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
            other => return Err(format!("feed-forward activation `{other}`")),
        };
        Ok((gated, act))
    }
}

/// The bucket of each relative position `key − query` (bidirectional): half the buckets per
/// sign; distances below a quarter of the buckets exactly, larger ones logarithmically up to
/// `max_distance`, beyond which all share the last bucket. `relative` int64 → int64.
fn relative_position_bucket(relative: &Tensor, buckets: i64, max_distance: i64) -> Tensor {
    let half = buckets / 2;
    let sign = relative.gt(0).to_kind(Kind::Int64) * half;
    let distance = relative.abs();
    let exact = half / 2;
    let large = (distance.to_kind(Kind::Float) / exact as f64).log()
        / (max_distance as f64 / exact as f64).ln()
        * (half - exact) as f64;
    let large = (large.to_kind(Kind::Int64) + exact).clamp_max(half - 1);
    sign + distance.where_self(&distance.lt(exact), &large)
}

/// One encoder block.
#[derive(Debug)]
struct Block {
    attention_norm: Tensor,
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
    ff_norm: Tensor,
    wi_0: nn::Linear,
    /// The gate's second input projection (gated feed-forwards only).
    wi_1: Option<nn::Linear>,
    wo: nn::Linear,
}

/// T5's encoder with its weights.
#[derive(Debug)]
pub struct T5Encoder {
    vs: VarStore,
    config: T5Config,
    activation: Activation,
    shared: nn::Embedding,
    /// `[buckets, heads]`, the first block's.
    relative_attention_bias: Tensor,
    blocks: Vec<Block>,
    final_norm: Tensor,
}

impl T5Encoder {
    /// The encoder `config` describes with fresh weights on `device`. Fails naming what the
    /// config asks that T5 does not have.
    pub fn new(config: T5Config, device: Device) -> Result<Self, String> {
        let (gated, activation) = config.feed_forward()?;
        let vs = VarStore::new(device);
        let root = vs.root();
        let (d, inner) = (config.d_model, config.num_heads * config.d_kv);
        let plain = nn::LinearConfig {
            bias: false,
            ..Default::default()
        };
        let linear = |p: nn::Path, i, o| nn::linear(p, i, o, plain);
        let norm = |p: nn::Path| p.ones("weight", &[d]);
        let shared = nn::embedding(&root / "shared", config.vocab_size, d, Default::default());
        let blocks: Vec<Block> = (0..config.num_layers)
            .map(|i| {
                let b = &root / "encoder" / "block" / i / "layer";
                let attn = &b / 0 / "SelfAttention";
                let ff = &b / 1 / "DenseReluDense";
                let (wi_0, wi_1) = match gated {
                    true => (
                        linear(&ff / "wi_0", d, config.d_ff),
                        Some(linear(&ff / "wi_1", d, config.d_ff)),
                    ),
                    false => (linear(&ff / "wi", d, config.d_ff), None),
                };
                Block {
                    attention_norm: norm(&b / 0 / "layer_norm"),
                    q: linear(&attn / "q", d, inner),
                    k: linear(&attn / "k", d, inner),
                    v: linear(&attn / "v", d, inner),
                    o: linear(&attn / "o", inner, d),
                    ff_norm: norm(&b / 1 / "layer_norm"),
                    wi_0,
                    wi_1,
                    wo: linear(&ff / "wo", config.d_ff, d),
                }
            })
            .collect();
        let relative_attention_bias = (&root
            / "encoder"
            / "block"
            / 0
            / "layer"
            / 0
            / "SelfAttention"
            / "relative_attention_bias")
            .randn_standard(
                "weight",
                &[config.relative_attention_num_buckets, config.num_heads],
            );
        let final_norm = norm(&root / "encoder" / "final_layer_norm");
        Ok(Self {
            vs,
            config,
            activation,
            shared,
            relative_attention_bias,
            blocks,
            final_norm,
        })
    }

    /// The encoder saved in `dir` (`config.json` and `model.safetensors` or a sharded
    /// `model.safetensors.index.json`, as transformers saves `T5EncoderModel` and FLUX.1's
    /// `text_encoder_2/` holds it), its weights in `kind` (FLUX.1 runs T5 in bf16), on `device`.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self, LoadError> {
        let config: T5Config = read_config(dir)?;
        let mut model =
            Self::new(config, device).map_err(|e| LoadError::new(&dir.join("config.json"), e))?;
        model.vs.set_kind(kind);
        load_into(
            &mut model.vs,
            dir,
            "model",
            &[],
            &["encoder.embed_tokens.weight"],
        )?;
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// `x · rsqrt(mean(x²) + ε) · weight`, the mean taken in f32.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        let variance = x
            .to_kind(Kind::Float)
            .square()
            .mean_dim(-1, true, Kind::Float);
        let normed = x * (variance + self.config.layer_norm_epsilon).rsqrt();
        weight * normed.to_kind(weight.kind())
    }

    /// The position bias `[1, H, L, L]` of a sequence of `l` tokens.
    fn position_bias(&self, l: i64, device: Device) -> Tensor {
        let positions = Tensor::arange(l, (Kind::Int64, device));
        let relative = positions.unsqueeze(0) - positions.unsqueeze(1);
        let buckets = relative_position_bucket(
            &relative,
            self.config.relative_attention_num_buckets,
            self.config.relative_attention_max_distance,
        );
        self.relative_attention_bias
            .index_select(0, &buckets.flatten(0, -1))
            .view([l, l, -1])
            .permute([2, 0, 1])
            .unsqueeze(0)
    }

    /// Final states `[B, L, D]` for token ids `[B, L]`; with `attention_mask` (`[B, L]`, 1 for
    /// tokens, 0 for padding) no position attends to padding. FLUX.1 passes no mask.
    pub fn forward(&self, ids: &Tensor, attention_mask: Option<&Tensor>) -> Tensor {
        let (b, l) = ids.size2().expect("token ids are [B, L]");
        let (heads, d_kv) = (self.config.num_heads, self.config.d_kv);
        let mut x = self.shared.forward(ids);
        let kind = x.kind();
        let bias = self.position_bias(l, ids.device()).to_kind(Kind::Float);
        // Padding masked out: a large negative score, [B, 1, 1, L] broadcast over heads and queries.
        let bias = match attention_mask {
            Some(mask) => {
                bias + mask.eq(0).view([b, 1, 1, l]).to_kind(Kind::Float) * f32::MIN as f64
            }
            None => bias,
        };
        let bias = bias.to_kind(kind);
        let split = |t: Tensor| t.view([b, l, heads, d_kv]).transpose(1, 2);
        for block in &self.blocks {
            let h = self.rms_norm(&x, &block.attention_norm);
            let attended = Tensor::scaled_dot_product_attention(
                &split(h.apply(&block.q)),
                &split(h.apply(&block.k)),
                &split(h.apply(&block.v)),
                Some(&bias),
                0.0,
                false,
                1.0,
                false,
            );
            x += attended
                .transpose(1, 2)
                .reshape([b, l, heads * d_kv])
                .apply(&block.o);
            let h = self.rms_norm(&x, &block.ff_norm);
            let a = h.apply(&block.wi_0);
            let a = match self.activation {
                Activation::Relu => a.relu(),
                Activation::Gelu => a.gelu("none"),
                Activation::GeluTanh => a.gelu("tanh"),
            };
            let a = match &block.wi_1 {
                Some(wi_1) => a * h.apply(wi_1),
                None => a,
            };
            x += a.apply(&block.wo);
        }
        self.rms_norm(&x, &self.final_norm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_exact_near_and_logarithmic_far_in_both_directions() {
        let relative = Tensor::from_slice(&[0i64, 1, -1, 7, 8, 20, 127, 128, 1000, -1000]);
        let got = Vec::<i64>::try_from(relative_position_bucket(&relative, 32, 128)).unwrap();
        // 16 buckets a side, 8 exact; keys after the query take the upper 16.
        assert_eq!(got, [0, 17, 1, 23, 24, 26, 31, 31, 31, 15]);
    }

    #[test]
    fn feed_forward_kinds_follow_transformers() {
        let config = |proj: &str, act: Option<&str>| T5Config {
            vocab_size: 1,
            d_model: 1,
            d_kv: 1,
            d_ff: 1,
            num_layers: 1,
            num_heads: 1,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: proj.into(),
            dense_act_fn: act.map(str::to_string),
        };
        let ff = |proj, act| config(proj, act).feed_forward();
        assert_eq!(
            ff("gated-gelu", Some("gelu")),
            Ok((true, Activation::GeluTanh))
        );
        assert_eq!(ff("relu", None), Ok((false, Activation::Relu)));
        assert_eq!(
            ff("gated-silu", None).unwrap_err(),
            "feed-forward activation `silu`"
        );
    }
}
