//! Analytic floating-point operations of a forward pass, the numerator of model FLOPs utilisation
//! (MFU). Each architecture lists its weight matrices and what each is applied to
//! ([`ModelConfig::forward_flops`](crate::ModelConfig::forward_flops)); every matrix costs
//! `2 · in · out` FLOPs per row it is applied to (an image token, a text token, or one
//! conditioning vector per sample), and attention over `L` tokens costs `4 · L² · D` per sample and
//! layer (`Q·Kᵀ` and `P·V` over all heads). Norms, activations, RoPE and softmax are not counted,
//! as in Megatron's and PaLM's MFU. A training step (forward and backward) counts as three forward
//! passes.

/// What a weight matrix is applied to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Every image token.
    Image,
    /// Every text token.
    Text,
    /// Every token of the joint sequence (single-stream layers).
    Tokens,
    /// One conditioning vector per sample (embedders, modulation).
    Sample,
}

/// The work of one forward pass, split by where it goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ForwardFlops {
    /// Weight matrix multiplications, FLOPs.
    pub linear: f64,
    /// Attention scores and weighted values, FLOPs.
    pub attention: f64,
}

/// The attention layers of a model, for the FLOPs count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attention {
    /// Layers with one attention each.
    pub layers: usize,
    /// Width `D` of queries, keys and values (all heads).
    pub width: i64,
    /// The tokens attended over: [`Rows::Tokens`] (joint text and image) or [`Rows::Image`].
    pub over: Rows,
}

impl Rows {
    /// How many rows of this kind a sample has.
    pub(crate) fn count(self, img: f64, txt: f64) -> f64 {
        match self {
            Rows::Image => img,
            Rows::Text => txt,
            Rows::Tokens => img + txt,
            Rows::Sample => 1.0,
        }
    }
}

impl ForwardFlops {
    /// Forward FLOPs on `batch` samples of `img` image and `txt` text tokens, of a model whose
    /// weight matrices are `matrices` (`(in · out, rows)`) and whose attention is `attention`.
    pub fn of(
        matrices: &[(f64, Rows)],
        attention: Attention,
        batch: i64,
        img: i64,
        txt: i64,
    ) -> Self {
        let (b, img, txt) = (batch as f64, img as f64, txt as f64);
        let linear: f64 = matrices
            .iter()
            .map(|&(weights, rows)| weights * rows.count(img, txt))
            .sum();
        let l = attention.over.count(img, txt);
        Self {
            linear: 2.0 * b * linear,
            attention: attention.layers as f64 * b * 4.0 * l * l * attention.width as f64,
        }
    }

    /// Total forward FLOPs.
    pub fn total(&self) -> f64 {
        self.linear + self.attention
    }

    /// FLOPs of a training step: the forward pass and a backward pass of twice its work.
    pub fn training_step(&self) -> f64 {
        3.0 * self.total()
    }
}
