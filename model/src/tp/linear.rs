//! `Linear`: `y = x Wᵀ + b`, replicated or split Megatron-style over the tensor-parallel group.

use std::cell::OnceCell;

use tch::nn::Path;
use tch::Tensor;

use crate::execution::residency::release_storage;
use crate::float8::{Float8Gemm, Float8Weight};
use crate::lora::Adapter;
use crate::tp::{creation, GradSync, ParamSpec, Pass, Shard, TpContext};

/// How a linear's weight starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearInit {
    /// Xavier-uniform `U(±sqrt(6 / (fan_in + fan_out)))` on the logical shape (Megatron's default).
    Xavier,
    /// All zeros (adaLN-Zero modulation, zero-initialised output layers).
    Zeros,
}

/// Everything `#[linear(..)]` says about one linear.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearDecl {
    /// Logical input features.
    pub in_dim: i64,
    /// Logical output features.
    pub out_dim: i64,
    /// Whether there is a bias.
    pub bias: bool,
    /// Replicated, column- or row-parallel.
    pub shard: Shard,
    /// Named slices of the split dimension (fused tensors); empty for a plain split.
    pub parts: Vec<(String, i64)>,
    /// Initial weights (biases start at zero).
    pub init: LinearInit,
}

impl LinearDecl {
    fn checked(&self) -> &Self {
        let split = if self.shard == Shard::Row {
            self.in_dim
        } else {
            self.out_dim
        };
        let sum: i64 = self.parts.iter().map(|(_, s)| s).sum();
        assert!(
            self.parts.is_empty() || sum == split,
            "linear parts {:?} sum to {sum} but the split dimension has {split} features",
            self.parts
        );
        self
    }

    /// Specs of `name.weight` and `name.bias` for a group of `tp_size` ranks.
    pub fn param_specs(&self, name: &str, tp_size: i64) -> Vec<ParamSpec> {
        self.checked();
        let split = |shape: Vec<i64>, dim: usize, leaf: &str| ParamSpec {
            name: format!("{name}.{leaf}"),
            shape,
            split_dim: Some(dim),
            parts: self.parts.clone(),
            tp_size,
            grad_sync: GradSync::Complete,
            all_reduce: None,
            linear: leaf == "weight",
        };
        let whole = |shape: Vec<i64>, leaf: &str| ParamSpec {
            linear: leaf == "weight",
            ..ParamSpec::replicated(format!("{name}.{leaf}"), shape, tp_size)
        };
        let (w, b) = (vec![self.out_dim, self.in_dim], vec![self.out_dim]);
        let mut specs = vec![match self.shard {
            Shard::Replicated => whole(w, "weight"),
            Shard::Column => ParamSpec {
                all_reduce: Some(Pass::Backward),
                ..split(w, 0, "weight")
            },
            Shard::Row => ParamSpec {
                all_reduce: Some(Pass::Forward),
                ..split(w, 1, "weight")
            },
        }];
        if self.bias {
            specs.push(match self.shard {
                Shard::Column => split(b, 0, "bias"),
                Shard::Replicated | Shard::Row => whole(b, "bias"),
            });
        }
        specs
    }
}

/// Create `p.{leaf}` holding this rank's shard of a logical tensor made by `init`, and tell the
/// running [`creation::while_creating`] hook, if any.
pub(crate) fn shard_var(
    p: &Path,
    spec: &ParamSpec,
    tp: &TpContext,
    init: impl FnOnce(&[i64]) -> Tensor,
) -> Tensor {
    let leaf = spec.name.rsplit('.').next().expect("non-empty name");
    let full = tch::no_grad(|| init(&spec.shape));
    let var = p.var_copy(leaf, &spec.shard_of(&full, tp.rank()));
    let name: Vec<&str> = p.components().chain([leaf]).collect();
    creation::created(&name.join("."), &var);
    var
}

/// A dense layer holding this rank's shard, optionally with a low-rank adapter.
#[derive(Debug)]
pub struct Linear {
    /// State-dict name of the module (`transformer.layers.0.linear_qkv`).
    name: String,
    /// Local weight: `[out, in]`, `[out/tp, in]` (column) or `[out, in/tp]` (row).
    pub weight: Tensor,
    /// Local bias: `[out]`, or `[out/tp]` when column-parallel.
    pub bias: Option<Tensor>,
    shard: Shard,
    /// This rank's width of each named part of a column-parallel output (empty: no parts).
    local_parts: Vec<i64>,
    tp: TpContext,
    adapter: OnceCell<Adapter>,
    float8: OnceCell<Float8Gemm>,
    /// The frozen weight in e4m3, when held so (`weight` then holds no memory).
    frozen: OnceCell<Float8Weight>,
}

impl Linear {
    /// Allocate this rank's shard of `decl` under `p`.
    pub fn new(p: &Path, decl: &LinearDecl, tp: &TpContext) -> Self {
        let device = p.device();
        let specs = decl.param_specs("", tp.size() as i64);
        let weight = shard_var(p, &specs[0], tp, |shape| match decl.init {
            LinearInit::Zeros => Tensor::zeros(shape, (tch::Kind::Float, device)),
            LinearInit::Xavier => {
                let bound = (6.0 / (decl.in_dim + decl.out_dim) as f64).sqrt();
                Tensor::empty(shape, (tch::Kind::Float, device)).uniform_(-bound, bound)
            }
        });
        let bias = specs.get(1).map(|spec| {
            shard_var(p, spec, tp, |s| {
                Tensor::zeros(s, (tch::Kind::Float, device))
            })
        });
        let local_parts = match decl.shard {
            Shard::Column => decl
                .parts
                .iter()
                .map(|(_, size)| size / tp.size() as i64)
                .collect(),
            Shard::Replicated | Shard::Row => Vec::new(),
        };
        Self {
            name: p.components().collect::<Vec<_>>().join("."),
            weight,
            bias,
            shard: decl.shard,
            local_parts,
            tp: tp.clone(),
            adapter: OnceCell::new(),
            float8: OnceCell::new(),
            frozen: OnceCell::new(),
        }
    }

    /// State-dict name of the module; its parameters are `{name}.weight` and `{name}.bias`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tensor-parallel group the layer is split over.
    pub fn tp(&self) -> &TpContext {
        &self.tp
    }

    /// How the weight is split over the group.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Add `adapter`'s low-rank update to every later forward pass; refused (handing it back)
    /// when the layer has one already.
    pub fn attach(&self, adapter: Adapter) -> Result<(), Adapter> {
        self.adapter.set(adapter)
    }

    /// The attached adapter, if any.
    pub fn adapter(&self) -> Option<&Adapter> {
        self.adapter.get()
    }

    /// Run every later product `x Wᵀ` through float8 GEMMs as `gemm` says; refused (handing it
    /// back) when the layer runs in float8 already.
    pub fn use_float8(&self, gemm: Float8Gemm) -> Result<(), Float8Gemm> {
        self.float8.set(gemm)
    }

    /// How the layer's GEMMs run in float8, when they do.
    pub fn float8(&self) -> Option<&Float8Gemm> {
        self.float8.get()
    }

    /// Hold this frozen layer's weight in e4m3 with per-row scales and give back the memory of
    /// `weight` (whose shape and dtype stay); later passes widen it to `weight`'s dtype. Bytes
    /// the float8 copy holds (0 when it was held so already). The weight must not train.
    pub fn hold_in_float8(&self) -> u64 {
        if self.frozen.get().is_some() {
            return 0;
        }
        self.hold_float8(Float8Weight::quantize(&self.weight))
    }

    /// As [`Linear::hold_in_float8`] with `held`, this layer's weight already in float8 (taken
    /// as the weight was created, whose memory may be given back already). Bytes it holds.
    pub fn hold_float8(&self, held: Float8Weight) -> u64 {
        assert!(
            !self.weight.requires_grad(),
            "`{}`: only a frozen weight is held in float8",
            self.name
        );
        assert_eq!(held.size(), self.weight.size(), "`{}`", self.name);
        let bytes = held.bytes();
        release_storage(&self.weight);
        if self.frozen.set(held).is_err() {
            panic!("`{}` is held in float8 already", self.name);
        }
        bytes
    }

    /// Bytes of the weight held in float8 ([`Linear::hold_in_float8`]); 0 when it is not.
    pub fn float8_weight_bytes(&self) -> u64 {
        self.frozen.get().map_or(0, Float8Weight::bytes)
    }

    /// `x Wᵀ + b` with this rank's weight (widened from float8 where it is held so), in float8
    /// GEMMs when the layer was switched to them (the bias added in the output's precision, as
    /// torchao does).
    fn product(&self, x: &Tensor, bias: Option<&Tensor>) -> Tensor {
        let y = match (self.frozen.get(), self.float8.get()) {
            (Some(held), None) => held.product(x),
            (held, gemm) => {
                let widened = held.map(|h| h.dequantize(self.weight.kind()));
                let weight = widened.as_ref().unwrap_or(&self.weight);
                match gemm {
                    None => return x.linear(weight, bias),
                    Some(gemm) => gemm.product(x, weight, &self.tp),
                }
            }
        };
        match bias {
            Some(b) => y + b,
            None => y,
        }
    }

    /// `y` plus the adapter's update of `x`, when there is one.
    fn adapted(&self, y: Tensor, x: &Tensor) -> Tensor {
        match self.adapter.get() {
            Some(adapter) => y + adapter.delta(x),
            None => y,
        }
    }

    /// `x [.., in]` → `[.., out]`; column-parallel gives this rank's `[.., out/tp]` slice, and a
    /// row-parallel layer takes the `[.., in/tp]` slice and returns the all-reduced full output.
    /// Under sequence parallelism a column-parallel layer takes this rank's slice of the tokens
    /// `[B, L/tp, in]` (gathering the rest) and a row-parallel one returns one `[B, L/tp, out]`.
    /// An adapter's update joins the base output before the row-parallel sum, so it costs no
    /// collective of its own.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        match self.shard {
            Shard::Replicated => self.adapted(self.product(x, self.bias.as_ref()), x),
            Shard::Column => {
                let x = self.tp.column_input(x);
                self.adapted(self.product(&x, self.bias.as_ref()), &x)
            }
            Shard::Row => {
                let partial = self.adapted(self.product(x, None), x);
                let y = self.tp.row_output(&partial);
                match &self.bias {
                    Some(b) => y + self.tp.broadcast_over_sequence(b),
                    None => y,
                }
            }
        }
    }

    /// This rank's slice of each named part of a column-parallel output `y [.., out/tp]`, in part
    /// order (`[q, k, v, mlp]` of Flux's fused projection): the widths come from the layer, so
    /// blocks never compute `size / tp` themselves.
    pub fn split_parts(&self, y: &Tensor) -> Vec<Tensor> {
        assert!(
            !self.local_parts.is_empty(),
            "split_parts needs a column-parallel linear with named parts"
        );
        y.split_with_sizes(self.local_parts.as_slice(), -1)
    }
}
