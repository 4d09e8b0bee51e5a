//! What a `[lora]` run holds on a rank: the frozen base in its dtype, the adapters its targets
//! select (what the optimizer trains), and the smaller set of activations a frozen model saves.

use std::collections::HashSet;

use flux_model::activations::{LayerActivations, Saved, Serves, Training};
use flux_model::execution::residency::{units, STEM};
use flux_model::lora::{adapter_specs, saved_by_adapter};
use flux_model::tp::ParamSpec;
use flux_model::ConfigError;

use crate::config::sections::{LoraConfig, Precision};

/// A LoRA run on one rank of a tensor-parallel group.
pub(super) struct LoraPlan {
    /// Module names of the linears with adapters.
    adapted: HashSet<String>,
    /// The adapters' `A` and `B` at the group's size: what trains.
    pub specs: Vec<ParamSpec>,
    /// Bytes of the frozen base weights.
    pub base: u64,
    /// Bytes per element of the activations and of the base as built: bf16 on a bf16 or
    /// float8 base.
    pub activation_elt: u64,
    /// Elements of the largest linear weight a float8 base widens to bf16 while it runs (0 on
    /// other bases).
    pub widened: u64,
    /// Whether the stem's conditioning takes gradients (an adapter before the layers; one in
    /// the head after them sends no gradient into the layers).
    conditioning: bool,
    rank: i64,
    /// Whether the adapters compute in f32 on activations that are not.
    f32_adapters: bool,
    dropout: bool,
}

impl LoraPlan {
    /// `lora` on a model of parameter `specs` (a rank's) trained at `elt` bytes per element
    /// (what the adapters train in). Fails naming the `[lora]` field whose targets or rank do
    /// not fit the model.
    pub fn new(lora: &LoraConfig, specs: &[ParamSpec], elt: u64) -> Result<Self, ConfigError> {
        let pairs = adapter_specs(specs, lora.settings(), &lora.targets)?;
        let activation_elt = match lora.base_precision {
            Precision::Fp32 => elt,
            Precision::Bf16 | Precision::Fp8 => 2,
        };
        let fp8 = lora.base_precision == Precision::Fp8;
        let base = specs
            .iter()
            .map(|s| match fp8 && s.linear {
                // e4m3 values and an f32 scale per output row.
                true => s.local_numel() + 4 * s.local_shape()[0] as u64,
                false => s.local_numel() * activation_elt,
            })
            .sum();
        let widened = match fp8 {
            true => specs
                .iter()
                .filter(|s| s.linear)
                .map(ParamSpec::local_numel)
                .max(),
            false => None,
        };
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        let stem: HashSet<&str> = names
            .iter()
            .zip(units(&names))
            .filter(|(_, unit)| *unit == STEM)
            .map(|(name, _)| *name)
            .collect();
        Ok(Self {
            conditioning: pairs
                .iter()
                .any(|(module, _)| stem.contains(format!("{module}.weight").as_str())),
            adapted: pairs.iter().map(|(module, _)| module.clone()).collect(),
            specs: pairs.into_iter().flat_map(|(_, pair)| pair).collect(),
            base,
            activation_elt,
            widened: widened.unwrap_or(0),
            rank: lora.settings().rank,
            f32_adapters: elt == 4 && activation_elt != 4,
            dropout: lora.dropout > 0.0,
        })
    }

    /// The most a float8 base holds beside what it has built while one weight is created:
    /// the weight whole in f32 and its bf16 shard, and while a linear's is quantized three f32
    /// copies of the shard (widened, absolute, scaled).
    pub fn largest_creation(&self, specs: &[ParamSpec]) -> u64 {
        let creating = |s: &ParamSpec| {
            let quantizing = if s.linear { 3 * 4 * s.local_numel() } else { 0 };
            4 * s.numel() + 2 * s.local_numel() + quantizing
        };
        specs.iter().map(creating).max().unwrap_or(0)
    }

    /// Whether a linear of `layer` (layer-relative `name`) has an adapter.
    fn adapted(&self, layer: &str, name: &str) -> bool {
        self.adapted.contains(&format!("{layer}.{name}"))
    }

    /// Whether gradients reach `layer`: it, a layer before it (of `layers`, in the order they
    /// run) or the stem has an adapter; before that, nothing requires a gradient and nothing is
    /// saved.
    pub fn reaches(&self, layers: &[LayerActivations], layer: usize) -> bool {
        self.conditioning
            || layers[..=layer].iter().any(|l| {
                let prefix = format!("{}.", l.name);
                self.adapted.iter().any(|m| m.starts_with(&prefix))
            })
    }

    /// What `layer` saves: the tensors for its input's gradient; a modulation's only where the
    /// conditioning or the modulation's linear trains; no linear's input but through its
    /// adapter ([`saved_by_adapter`]); no norm scale's.
    pub fn saved(&self, layer: &LayerActivations) -> Vec<Saved> {
        let linear = |name: &str| self.adapted(&layer.name, name);
        let training = Training {
            linear: &linear,
            conditioning: self.conditioning,
            norms: false,
        };
        let kept = layer.saved.iter().filter(|s| s.kept(&training));
        kept.flat_map(|s| match s.serves {
            Serves::Weight(_) => saved_by_adapter(s, self.rank, self.f32_adapters, self.dropout),
            _ => vec![*s],
        })
        .collect()
    }
}
