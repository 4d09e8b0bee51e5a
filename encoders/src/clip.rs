//! CLIP's text transformer (transformers' `CLIPTextModel`, FLUX.1's `text_encoder/`): token and
//! position embeddings; pre-norm layers of causal self-attention and an MLP (quick-GELU for
//! CLIP-L); a final layer norm. Flux takes the pooled output: the final state at each prompt's
//! end-of-text token.

use std::path::Path;

use serde::Deserialize;
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

use crate::weights::{load_into, read_config, LoadError};

/// The fields of `config.json` the text model needs (others are ignored).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ClipTextConfig {
    /// Token embedding rows.
    pub vocab_size: i64,
    /// Model width D.
    pub hidden_size: i64,
    /// MLP width.
    pub intermediate_size: i64,
    /// Layers.
    pub num_hidden_layers: i64,
    /// Attention heads (D must divide evenly).
    pub num_attention_heads: i64,
    /// Longest prompt, in tokens (77).
    pub max_position_embeddings: i64,
    /// `quick_gelu` (CLIP-L) or `gelu`.
    #[serde(default = "quick_gelu")]
    pub hidden_act: String,
    /// Layer-norm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// The end-of-text id the pooled output is read at; 2 (the value FLUX.1's config carries)
    /// means the largest id of each prompt, as transformers reads it.
    #[serde(default)]
    pub eos_token_id: Option<i64>,
}

fn quick_gelu() -> String {
    "quick_gelu".into()
}

fn default_eps() -> f64 {
    1e-5
}

/// One pre-norm transformer layer.
#[derive(Debug)]
struct Layer {
    layer_norm1: nn::LayerNorm,
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    out_proj: nn::Linear,
    layer_norm2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

/// The text encoder's outputs for `[B, L]` token ids.
#[derive(Debug)]
pub struct ClipTextOutput {
    /// Final states after the last norm, `[B, L, D]`.
    pub last_hidden_state: Tensor,
    /// The state at each prompt's end-of-text token, `[B, D]` (Flux's pooled vector).
    pub pooled: Tensor,
}

/// CLIP's text transformer with its weights.
#[derive(Debug)]
pub struct ClipTextModel {
    vs: VarStore,
    config: ClipTextConfig,
    quick_gelu: bool,
    token_embedding: nn::Embedding,
    position_embedding: nn::Embedding,
    layers: Vec<Layer>,
    final_layer_norm: nn::LayerNorm,
}

impl ClipTextModel {
    /// The model `config` describes with fresh weights on `device`. Fails naming the field when
    /// the activation is not one CLIP uses or the heads do not divide the width.
    pub fn new(config: ClipTextConfig, device: Device) -> Result<Self, String> {
        let quick_gelu = match config.hidden_act.as_str() {
            "quick_gelu" => true,
            "gelu" => false,
            other => return Err(format!("hidden_act `{other}` (quick_gelu or gelu)")),
        };
        if config.num_attention_heads <= 0 || config.hidden_size % config.num_attention_heads != 0 {
            return Err(format!(
                "num_attention_heads {} does not divide hidden_size {}",
                config.num_attention_heads, config.hidden_size
            ));
        }
        let vs = VarStore::new(device);
        let root = vs.root();
        let d = config.hidden_size;
        let norm = |p: nn::Path| {
            let c = nn::LayerNormConfig {
                eps: config.layer_norm_eps,
                ..Default::default()
            };
            nn::layer_norm(p, vec![d], c)
        };
        let linear = |p: nn::Path, i, o| nn::linear(p, i, o, Default::default());
        let embeddings = &root / "embeddings";
        let token_embedding = nn::embedding(
            &embeddings / "token_embedding",
            config.vocab_size,
            d,
            Default::default(),
        );
        let position_embedding = nn::embedding(
            &embeddings / "position_embedding",
            config.max_position_embeddings,
            d,
            Default::default(),
        );
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let p = &root / "encoder" / "layers" / i;
                let attn = &p / "self_attn";
                Layer {
                    layer_norm1: norm(&p / "layer_norm1"),
                    q_proj: linear(&attn / "q_proj", d, d),
                    k_proj: linear(&attn / "k_proj", d, d),
                    v_proj: linear(&attn / "v_proj", d, d),
                    out_proj: linear(&attn / "out_proj", d, d),
                    layer_norm2: norm(&p / "layer_norm2"),
                    fc1: linear(&p / "mlp" / "fc1", d, config.intermediate_size),
                    fc2: linear(&p / "mlp" / "fc2", config.intermediate_size, d),
                }
            })
            .collect();
        let final_layer_norm = norm(&root / "final_layer_norm");
        Ok(Self {
            vs,
            config,
            quick_gelu,
            token_embedding,
            position_embedding,
            layers,
            final_layer_norm,
        })
    }

    /// The model saved in `dir` (`config.json` and `model.safetensors`, as transformers'
    /// `save_pretrained` and FLUX.1's `text_encoder/` hold them; names with or without
    /// `text_model.`), on `device`.
    pub fn load(dir: &Path, device: Device) -> Result<Self, LoadError> {
        let config: ClipTextConfig = read_config(dir)?;
        let mut model =
            Self::new(config, device).map_err(|e| LoadError::new(&dir.join("config.json"), e))?;
        load_into(
            &mut model.vs,
            dir,
            "model",
            &["text_model."],
            &["embeddings.position_ids"],
        )?;
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &ClipTextConfig {
        &self.config
    }

    /// Encode token ids `[B, L]` (int64, `L ≤ max_position_embeddings`).
    pub fn forward(&self, ids: &Tensor) -> ClipTextOutput {
        let (b, l) = ids.size2().expect("token ids are [B, L]");
        let (d, heads) = (self.config.hidden_size, self.config.num_attention_heads);
        let positions = Tensor::arange(l, (Kind::Int64, ids.device()));
        let mut x = self.token_embedding.forward(ids) + self.position_embedding.forward(&positions);
        let split = |t: Tensor| t.view([b, l, heads, d / heads]).transpose(1, 2);
        for layer in &self.layers {
            let h = x.apply(&layer.layer_norm1);
            let (q, k, v) = (
                split(h.apply(&layer.q_proj)),
                split(h.apply(&layer.k_proj)),
                split(h.apply(&layer.v_proj)),
            );
            let attended = Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                None::<Tensor>,
                0.0,
                true,
                None,
                false,
            );
            x += attended
                .transpose(1, 2)
                .reshape([b, l, d])
                .apply(&layer.out_proj);
            let h = x.apply(&layer.layer_norm2).apply(&layer.fc1);
            let h = if self.quick_gelu {
                &h * (&h * 1.702).sigmoid()
            } else {
                h.gelu("none")
            };
            x += h.apply(&layer.fc2);
        }
        let last_hidden_state = x.apply(&self.final_layer_norm);
        let end = match self.config.eos_token_id {
            Some(eos) if eos != 2 => ids.eq(eos).to_kind(Kind::Int).argmax(-1, false),
            _ => ids.argmax(-1, false),
        };
        let rows = Tensor::arange(b, (Kind::Int64, ids.device()));
        let pooled = last_hidden_state.index(&[Some(rows), Some(end)]);
        ClipTextOutput {
            last_hidden_state,
            pooled,
        }
    }
}
