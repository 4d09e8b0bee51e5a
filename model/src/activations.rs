//! What a model keeps for its backward pass, from its config alone: the tensors each layer's
//! operations save (inputs of matrix multiplications, norms, activations and gates; attention's
//! queries, keys, values, output and log-sum-exp), per row they act on. `flux-hpc plan` turns it
//! into bytes per rank for a micro-batch, a tensor-parallel size and sequence parallelism
//! ([`ModelConfig::activations`](crate::ModelConfig::activations)).
//!
//! Counts are in elements per row (an image token, a text token, or one sample), in the
//! activations' dtype unless `f32`; tensors that are views of others are counted once, with the
//! tensor that owns the memory.

use crate::flops::Rows;

/// How a saved tensor is divided among the ranks of a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Width {
    /// The model width, whole on every rank; each rank holds its slice of the tokens under
    /// sequence parallelism (norm and residual inputs, modulated streams).
    Whole,
    /// Whole on every rank even under sequence parallelism: the input of a column-parallel
    /// projection, which sequence parallelism all-gathers before the multiplication saves it.
    Gathered,
    /// Split over the group: heads, the MLP's hidden width.
    Split,
}

/// Tensors of one kind saved for backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Saved {
    /// What one row is.
    pub rows: Rows,
    /// Elements per row (all ranks together for [`Width::Split`]).
    pub per_row: f64,
    /// How the group divides them.
    pub width: Width,
    /// Kept in f32 whatever the activations' dtype (norm statistics, log-sum-exp).
    pub f32: bool,
    /// Saved only by these kernels (`None`: by all).
    pub only: Option<Kernels>,
}

/// Which kernels libtorch runs: some operations save more where they are composed of
/// elementwise ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// Composite implementations (libtorch's CPU kernels: RMSNorm as five elementwise ops).
    Composite,
    /// Fused implementations (CUDA: one RMSNorm kernel saving its input and statistics).
    Fused,
}

impl Kernels {
    /// Fused on a GPU, composite on the CPU.
    pub fn on_gpu(gpu: bool) -> Self {
        match gpu {
            true => Kernels::Fused,
            false => Kernels::Composite,
        }
    }
}

impl Saved {
    /// `per_row` elements per row of `rows`, divided as `width` says.
    pub fn new(rows: Rows, per_row: f64, width: Width) -> Self {
        Self {
            rows,
            per_row,
            width,
            f32: false,
            only: None,
        }
    }

    /// As [`Saved::new`], always in f32.
    pub fn f32(rows: Rows, per_row: f64, width: Width) -> Self {
        Self {
            f32: true,
            ..Self::new(rows, per_row, width)
        }
    }

    /// Bytes on one rank for a micro-batch of `shape`.
    pub fn bytes(&self, shape: &ActivationShape) -> f64 {
        if self.only.is_some_and(|k| k != shape.kernels) {
            return 0.0;
        }
        let rows = self.rows.count(shape.img as f64, shape.txt as f64) * shape.batch as f64;
        let tp = shape.tp as f64;
        let divisor = match self.width {
            Width::Split => tp,
            Width::Whole if shape.sequence_parallel && self.rows != Rows::Sample => tp,
            Width::Whole | Width::Gathered => 1.0,
        };
        let elt = if self.f32 { 4.0 } else { shape.elt as f64 };
        rows * self.per_row / divisor * elt
    }
}

/// The shape a micro-batch's activations are counted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationShape {
    /// Samples in the micro-batch.
    pub batch: i64,
    /// Image tokens per sample.
    pub img: i64,
    /// Text tokens per sample.
    pub txt: i64,
    /// Tensor-parallel ranks.
    pub tp: i64,
    /// Whether the group splits the sequence.
    pub sequence_parallel: bool,
    /// Bytes per element of the activations (4 in f32, 2 in bf16).
    pub elt: i64,
    /// The kernels that run.
    pub kernels: Kernels,
}

/// Sum of [`Saved::bytes`].
pub fn bytes_of(saved: &[Saved], shape: &ActivationShape) -> f64 {
    saved.iter().map(|s| s.bytes(shape)).sum()
}

/// What one layer saves.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerActivations {
    /// The name the layer runs under (its parameters' state-dict prefix, as
    /// [`RootBlock::layers`](crate::RootBlock::layers) gives it).
    pub name: String,
    /// Everything its operations save when it runs with gradients.
    pub saved: Vec<Saved>,
    /// Its inputs, all a recomputed layer keeps until backward reaches it.
    pub inputs: Vec<Saved>,
}

/// What a model's training forward pass saves.
#[derive(Debug, Clone, PartialEq)]
pub struct Activations {
    /// Its layers in the order they run.
    pub layers: Vec<LayerActivations>,
    /// The embedders, the output layer and the loss: whatever runs outside the layers.
    pub outside: Vec<Saved>,
    /// Whether the forward pass runs the parameters before and after its layers as the stem
    /// and the head ([`crate::execution::residency::STEM`], [`crate::execution::residency::HEAD`]), which fully
    /// sharded training gathers and gives back like a layer's (`None`: they stay whole); and
    /// if so, `Some(k)`: backward gathers the stem again, once one of its outputs has its whole
    /// gradient, for layers `k - 1` down to `0` (0 where every layer takes the stem's
    /// conditioning, as in FLUX.1; FLUX.2's single-stream modulation is complete once backward
    /// leaves the single-stream layers).
    pub stem_regathered_for: Option<usize>,
}

/// The saved tensors of one modulated (AdaLN) stream with an attention branch and an MLP branch
/// (FLUX's joint layers, DiT's blocks), per row of `rows` and model width `d`: for each branch the
/// norm's input and output, the modulated input of the column-parallel projection, the gated
/// branch output and the norm's statistics; plus `split` elements per row inside the branches
/// (attention's and the MLP's, all ranks together) and attention's log-sum-exp per head.
pub fn modulated_stream(rows: Rows, d: f64, heads: f64, split: f64) -> Vec<Saved> {
    vec![
        Saved::new(rows, 2.0 * 3.0 * d, Width::Whole),
        Saved::new(rows, 2.0 * d, Width::Gathered),
        Saved::new(rows, split, Width::Split),
        Saved::f32(rows, 2.0 * 2.0, Width::Whole),
        Saved::f32(rows, heads, Width::Split),
    ]
}

/// An MMDiT joint layer (FLUX.1's and FLUX.2's double blocks) named `name`: for the image and the
/// text stream, a modulated stream whose attention saves the fused projection `3d`, the rotated
/// queries and keys `2d`, the joined values and the output `2d` and the output gathered for its
/// projection `d`, with query-key norms; `mlp` elements per row in the MLP branch (all ranks
/// together); and `extra` (a modulation of its own).
pub fn joint_layer(
    name: String,
    d: f64,
    heads: f64,
    mlp: f64,
    extra: Vec<Saved>,
) -> LayerActivations {
    let mut saved = extra;
    for rows in [Rows::Image, Rows::Text] {
        saved.extend(modulated_stream(rows, d, heads, 8.0 * d + mlp));
        saved.extend(qk_norms(rows, d, heads));
    }
    LayerActivations {
        name,
        saved,
        inputs: vec![
            Saved::new(Rows::Image, d, Width::Whole),
            Saved::new(Rows::Text, d, Width::Whole),
        ],
    }
}

/// A single-stream layer over all tokens with parallel attention and MLP (FLUX.1's and FLUX.2's
/// single blocks) named `name`: the norm's input and output and the gated output, the modulated
/// input of the fused projection, `inner` elements per row between the fused projections (all
/// ranks together), the norm's statistics, attention's log-sum-exp and query-key norms; and
/// `extra`.
pub fn single_stream_layer(
    name: String,
    d: f64,
    heads: f64,
    inner: f64,
    extra: Vec<Saved>,
) -> LayerActivations {
    let mut saved = extra;
    saved.extend([
        Saved::new(Rows::Tokens, 3.0 * d, Width::Whole),
        Saved::new(Rows::Tokens, d, Width::Gathered),
        Saved::new(Rows::Tokens, inner, Width::Split),
        Saved::f32(Rows::Tokens, 2.0, Width::Whole),
        Saved::f32(Rows::Tokens, heads, Width::Split),
    ]);
    saved.extend(qk_norms(Rows::Tokens, d, heads));
    LayerActivations {
        name,
        saved,
        inputs: vec![Saved::new(Rows::Tokens, d, Width::Whole)],
    }
}

/// What query-key RMS norms over `d` elements per row (queries and keys together `2d`, `heads`
/// heads each) save besides their input: the inverse root mean square per head, and where
/// libtorch composes the norm from elementwise kernels (its CPU kernels), the normalised values
/// the scale multiplies.
pub fn qk_norms(rows: Rows, d: f64, heads: f64) -> Vec<Saved> {
    vec![
        Saved::f32(rows, 2.0 * heads, Width::Split),
        Saved {
            only: Some(Kernels::Composite),
            ..Saved::f32(rows, 2.0 * d, Width::Split)
        },
    ]
}

/// What runs outside the layers of a latent diffusion transformer of width `d` whose tokens
/// carry `channels` latent values and whose text rows are `text` wide (0 without text), with
/// `cond` conditioning values and `embedders` timestep-style MLP embedders per sample; the layers
/// run over `tokens` rows and the output layer over the image tokens:
///
/// - the micro-batch in f32: clean latents, noise, noisy latents and the target, the text and
///   the conditioning;
/// - the patch embedder's input, and each conditioning MLP's input, hidden and output;
/// - the output layer: the last layer's output gathered whole, the norm's output, the modulated
///   input of the projection and its prediction, and the loss's difference in f32.
pub fn diffusion_io(
    d: f64,
    channels: f64,
    text: f64,
    cond: f64,
    embedders: f64,
    tokens: Rows,
) -> Vec<Saved> {
    vec![
        Saved::f32(Rows::Image, 4.0 * channels, Width::Gathered),
        Saved::f32(Rows::Text, text, Width::Gathered),
        Saved::f32(Rows::Sample, cond, Width::Gathered),
        Saved::new(Rows::Image, channels, Width::Gathered),
        Saved::new(Rows::Sample, embedders * 3.0 * d + cond, Width::Gathered),
        Saved::new(tokens, d, Width::Gathered),
        Saved::new(Rows::Image, 2.0 * d + channels, Width::Gathered),
        Saved::f32(Rows::Image, channels + 2.0, Width::Gathered),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tp: i64, sequence_parallel: bool, kernels: Kernels) -> ActivationShape {
        ActivationShape {
            batch: 2,
            img: 16,
            txt: 4,
            tp,
            sequence_parallel,
            elt: 2,
            kernels,
        }
    }

    #[test]
    fn widths_divide_as_the_group_splits_them() {
        let s = |w| Saved::new(Rows::Tokens, 8.0, w);
        let plain = shape(4, false, Kernels::Fused);
        let sp = shape(4, true, Kernels::Fused);
        // 2 samples × 20 tokens × 8 elements × 2 bytes.
        assert_eq!(s(Width::Whole).bytes(&plain), 640.0);
        assert_eq!(s(Width::Whole).bytes(&sp), 160.0);
        assert_eq!(s(Width::Gathered).bytes(&sp), 640.0);
        assert_eq!(s(Width::Split).bytes(&plain), 160.0);
        // Per-sample rows are never split along the sequence; f32 ones take 4 bytes.
        assert_eq!(Saved::f32(Rows::Sample, 8.0, Width::Whole).bytes(&sp), 64.0);
    }

    #[test]
    fn composite_only_tensors_count_on_composite_kernels_alone() {
        let norms = qk_norms(Rows::Image, 64.0, 4.0);
        let fused = bytes_of(&norms, &shape(1, false, Kernels::Fused));
        let composite = bytes_of(&norms, &shape(1, false, Kernels::Composite));
        // 2 × 16 rows: 8 f32 statistics each, and 128 normalised f32 values more.
        assert_eq!(fused, 32.0 * 8.0 * 4.0);
        assert_eq!(composite, fused + 32.0 * 128.0 * 4.0);
    }
}
