//! What a model keeps for its backward pass, from its config alone: the tensors each layer's
//! operations save (inputs of matrix multiplications, norms, activations and gates; attention's
//! queries, keys, values, output and log-sum-exp), per row they act on. `flux-hpc plan` turns it
//! into bytes per rank for a micro-batch, a tensor-parallel size and sequence parallelism
//! ([`ModelConfig::activations`](crate::ModelConfig::activations)).
//!
//! Counts are in elements per row (an image token, a text token, or one sample), in the
//! activations' dtype unless `f32`; tensors that are views of others are counted once, with the
//! tensor that owns the memory. Each says which gradient it is kept for ([`Serves`]): with
//! frozen weights (a LoRA run) libtorch saves only what the gradients still computed need.

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

/// Which gradient a saved tensor is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    /// The gradient of the operation's input: kept while any gradient flows back through.
    Input,
    /// Only the weight gradient of the layer's linear of this name (relative to the layer,
    /// e.g. `self_attention.linear_proj`): the linear's input.
    Weight(&'static str),
    /// Only the gradients of a modulation's shift, scale and gate (the normalised stream they
    /// scale, the branch output a gate multiplies), made by the layer's linear of this name, or
    /// by the stem for every layer where it is empty.
    Modulation(&'static str),
    /// Only the gradient of a norm's own scale (the normalised values it multiplies).
    NormScale,
}

/// What takes gradients in a run, as far as one layer's saved tensors care.
pub struct Training<'a> {
    /// Whether the layer's linear of this layer-relative name takes a weight gradient (it
    /// trains, or carries an adapter that does).
    pub linear: &'a dyn Fn(&str) -> bool,
    /// Whether the conditioning the stem computes (embedders, shared modulations) takes
    /// gradients.
    pub conditioning: bool,
    /// Whether the norms' scales train.
    pub norms: bool,
}

impl Training<'_> {
    /// Full training: every weight takes its gradient.
    pub const FULL: Training<'static> = Training {
        linear: &|_| true,
        conditioning: true,
        norms: true,
    };
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
    /// An f32 copy a kernel makes of an activation: nothing more where the activations are f32
    /// already (the copy is the tensor itself, counted with it).
    pub upcast: bool,
    /// Saved only by these kernels (`None`: by all).
    pub only: Option<Kernels>,
    /// The gradient it is kept for.
    pub serves: Serves,
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
            upcast: false,
            only: None,
            serves: Serves::Input,
        }
    }

    /// The same tensors, kept only for `serves`.
    pub fn serving(self, serves: Serves) -> Self {
        Self { serves, ..self }
    }

    /// Whether a run training as `training` keeps them.
    pub fn kept(&self, training: &Training) -> bool {
        match self.serves {
            Serves::Input => true,
            Serves::Weight(linear) => (training.linear)(linear),
            Serves::Modulation("") => training.conditioning,
            Serves::Modulation(linear) => training.conditioning || (training.linear)(linear),
            Serves::NormScale => training.norms,
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
        if self.only.is_some_and(|k| k != shape.kernels) || (self.upcast && shape.elt == 4) {
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
    kept_bytes_of(saved, shape, &Training::FULL)
}

/// Sum of [`Saved::bytes`] of the tensors a run training as `training` keeps.
pub fn kept_bytes_of(saved: &[Saved], shape: &ActivationShape, training: &Training) -> f64 {
    saved
        .iter()
        .filter(|s| s.kept(training))
        .map(|s| s.bytes(shape))
        .sum()
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

/// The linears of one modulated stream, named relative to its layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLinears {
    /// The modulation's (shift, scale, gate); empty where the stem computes it for every layer.
    pub modulation: &'static str,
    /// Attention's input projection.
    pub qkv: &'static str,
    /// Attention's output projection.
    pub proj: &'static str,
    /// The MLP's input projection.
    pub fc1: &'static str,
    /// The MLP's output projection.
    pub fc2: &'static str,
}

/// The saved tensors of one modulated (AdaLN) stream with an attention branch and an MLP branch
/// (FLUX's joint layers, DiT's blocks), per row of `rows`, model width `d`, MLP width `m`: for
/// each branch the norm's input, its output (for the scale's gradient), the gated branch output
/// (for the gate's), the modulated input of the column-parallel projection and the norm's
/// statistics; inside the branches `attention` and `mlp` elements per row for the input's
/// gradient (all ranks together) and the inputs of the output projections, `d` and `m`; and
/// attention's log-sum-exp per head.
pub fn modulated_stream(
    rows: Rows,
    (d, m, heads): (f64, f64, f64),
    linears: &StreamLinears,
    attention: f64,
    mlp: f64,
) -> Vec<Saved> {
    let weight = |name| Serves::Weight(name);
    vec![
        Saved::new(rows, 2.0 * d, Width::Whole),
        Saved::new(rows, 2.0 * 2.0 * d, Width::Whole)
            .serving(Serves::Modulation(linears.modulation)),
        Saved::new(rows, d, Width::Gathered).serving(weight(linears.qkv)),
        Saved::new(rows, d, Width::Gathered).serving(weight(linears.fc1)),
        Saved::new(rows, attention + mlp, Width::Split),
        Saved::new(rows, d, Width::Split).serving(weight(linears.proj)),
        Saved::new(rows, m, Width::Split).serving(weight(linears.fc2)),
        Saved::f32(rows, 2.0 * 2.0, Width::Whole),
        Saved::f32(rows, heads, Width::Split),
    ]
}

/// An MMDiT joint layer (FLUX.1's and FLUX.2's double blocks) named `name`, of width `d`, MLP
/// width `m` and `heads` heads: for the image and the text stream (`linears`, in that order), a
/// modulated stream whose attention saves the fused projection `3d`, the rotated queries and
/// keys `2d`, the joined values and the output `2d` (and the output gathered for its
/// projection), with query-key norms; `mlp` elements per row in the MLP branch besides its
/// output projection's input (all ranks together); and `extra` (a modulation of its own).
pub fn joint_layer(
    name: String,
    (d, m, heads): (f64, f64, f64),
    linears: [&StreamLinears; 2],
    mlp: f64,
    extra: Vec<Saved>,
) -> LayerActivations {
    let mut saved = extra;
    for (rows, linears) in [Rows::Image, Rows::Text].into_iter().zip(linears) {
        saved.extend(modulated_stream(rows, (d, m, heads), linears, 7.0 * d, mlp));
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
/// single blocks) named `name`, of width `d` with `heads` heads, whose linears are `modulation`,
/// the fused input projection `fused_in` and the fused output projection `fused_out`: the norm's
/// input, output and the gated output, the modulated input of the fused projection, `inner`
/// elements per row between the fused projections for the input's gradient and the
/// `out_input` of the output projection (all ranks together), the norm's statistics,
/// attention's log-sum-exp and query-key norms; and `extra`.
pub fn single_stream_layer(
    name: String,
    (d, heads): (f64, f64),
    [modulation, fused_in, fused_out]: [&'static str; 3],
    (inner, out_input): (f64, f64),
    extra: Vec<Saved>,
) -> LayerActivations {
    let mut saved = extra;
    saved.extend([
        Saved::new(Rows::Tokens, d, Width::Whole),
        Saved::new(Rows::Tokens, 2.0 * d, Width::Whole).serving(Serves::Modulation(modulation)),
        Saved::new(Rows::Tokens, d, Width::Gathered).serving(Serves::Weight(fused_in)),
        Saved::new(Rows::Tokens, inner, Width::Split),
        Saved::new(Rows::Tokens, out_input, Width::Split).serving(Serves::Weight(fused_out)),
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
/// libtorch composes the norm from elementwise kernels (its CPU kernels) the input in f32 (in
/// bf16, a copy) and the normalised values the scale multiplies (for the scale's gradient).
pub fn qk_norms(rows: Rows, d: f64, heads: f64) -> Vec<Saved> {
    let composite = |saved: Saved| Saved {
        only: Some(Kernels::Composite),
        ..saved
    };
    vec![
        Saved::f32(rows, 2.0 * heads, Width::Split),
        composite(Saved {
            upcast: true,
            ..Saved::f32(rows, 2.0 * d, Width::Split)
        }),
        composite(Saved::f32(rows, 2.0 * d, Width::Split).serving(Serves::NormScale)),
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
        // 2 × 16 rows: 8 f32 statistics each; composed, 128 f32 copies of the bf16 input and
        // 128 normalised f32 values more.
        assert_eq!(fused, 32.0 * 8.0 * 4.0);
        assert_eq!(composite, fused + 32.0 * 256.0 * 4.0);
        // In f32 the input's copy is the input itself.
        let f32_shape = ActivationShape {
            elt: 4,
            ..shape(1, false, Kernels::Composite)
        };
        assert_eq!(bytes_of(&norms, &f32_shape), fused + 32.0 * 128.0 * 4.0);
    }

    #[test]
    fn frozen_weights_keep_only_what_the_gradients_still_computed_need() {
        let stream = StreamLinears {
            modulation: "adaln.linear",
            qkv: "attn.qkv",
            proj: "attn.proj",
            fc1: "mlp.fc1",
            fc2: "mlp.fc2",
        };
        let saved = modulated_stream(Rows::Image, (8.0, 32.0, 2.0), &stream, 10.0, 5.0);
        let s = shape(1, false, Kernels::Fused);
        let full = kept_bytes_of(&saved, &s, &Training::FULL);
        assert_eq!(full, bytes_of(&saved, &s));
        let only_qkv = |name: &str| name == "attn.qkv";
        let frozen = Training {
            linear: &only_qkv,
            conditioning: false,
            norms: false,
        };
        // Per row: the norms' inputs 16, the qkv input 8, the branches' 15, 4 f32 statistics
        // and 2 log-sum-exps; not the norms' outputs and gated branches (32), the MLP's input
        // (8) or the output projections' (8 + 32).
        let per_row = 16.0 + 8.0 + 15.0;
        assert_eq!(
            kept_bytes_of(&saved, &s, &frozen),
            32.0 * (per_row * 2.0 + 6.0 * 4.0)
        );
        assert_eq!(full - kept_bytes_of(&saved, &s, &frozen), 32.0 * 80.0 * 2.0);
    }
}
