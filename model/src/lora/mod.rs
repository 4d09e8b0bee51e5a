//! LoRA (Hu et al., 2021) on any `#[linear]` of any model: adapters split over the
//! tensor-parallel group like the weight they wrap, in a parameter store of their own that
//! training, checkpoints and export use while the base model stays frozen.
//!
//! - [`targets`]: which linears a `[lora] targets` pattern selects.
//! - [`Adapter`]: the update one layer adds.
//! - [`Adapters`]: every adapter of a model, with its store.
//! - [`export`]: adapters in diffusers/PEFT's and kohya's layouts.
//! - [`import`]: adapters from those files, per native module.

mod adapter;
pub mod export;
pub mod import;
pub mod peft_config;
pub mod targets;

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;

use tch::{Kind, Tensor};

use crate::tp::{shard_var, GradSync, Linear, ParamSpec, ShardedStore};
use crate::{ConfigError, DiffusionModel};

pub use adapter::{saved_by_adapter, Adapter};
pub use import::{ImportError, ImportedAdapter};

/// Rank, strength and dropout of every adapter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraSettings {
    /// Rank `r` of each update `B · A`.
    pub rank: i64,
    /// `α`: the update is scaled by `α / r`.
    pub alpha: f64,
    /// Dropout probability on each adapter's input while training.
    pub dropout: f64,
}

impl LoraSettings {
    /// Check the values; the error names the `[lora]` field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.rank <= 0 {
            return Err(ConfigError::new(
                "lora.rank",
                format!("must be positive, got {}", self.rank),
            ));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(ConfigError::new(
                "lora.alpha",
                format!("must be positive, got {}", self.alpha),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::new(
                "lora.dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            ));
        }
        Ok(())
    }

    /// `α / r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// The adapters of one model on one rank: their parameters (`{module}.lora_A.weight`,
/// `{module}.lora_B.weight`) and the modules they wrap.
#[derive(Debug)]
pub struct Adapters {
    store: ShardedStore,
    modules: Vec<String>,
    settings: LoraSettings,
    training: Rc<Cell<bool>>,
}

/// The specs of the adapter on a linear whose weight is `base` (`[out, in]`): `A [r, in]` takes
/// the base's input split, `B [out, r]` its output split (parts included); the half that stays
/// whole on a split base sees partial gradients on each rank, summed over the group.
fn pair_specs(module: &str, base: &ParamSpec, rank: i64) -> [ParamSpec; 2] {
    let (out_dim, in_dim) = (base.shape[0], base.shape[1]);
    let spec = |leaf: &str, shape: Vec<i64>, split: usize| {
        let mut s = ParamSpec::replicated(format!("{module}.{leaf}.weight"), shape, base.tp_size);
        if base.split_dim == Some(split) {
            s.split_dim = Some(split);
            s.parts = base.parts.clone();
        } else if base.split_dim.is_some() {
            s.grad_sync = GradSync::SumOverGroup;
        }
        s
    };
    [
        spec("lora_A", vec![rank, in_dim], 1),
        spec("lora_B", vec![out_dim, rank], 0),
    ]
}

/// The linears a pattern of `targets` selects (see [`targets::matches`]) among a model's
/// parameter `specs`, by module name in spec order, each with its adapter's `A` and `B` specs:
/// what [`Adapters::attach`] wraps, known from the config alone (`flux-hpc plan` counts it).
/// Fails, naming the `[lora]` field, for bad settings, a pattern that selects nothing, or a rank
/// above a layer's smaller side.
pub fn adapter_specs(
    specs: &[ParamSpec],
    settings: LoraSettings,
    targets: &[String],
) -> Result<Vec<(String, [ParamSpec; 2])>, ConfigError> {
    settings.validate()?;
    if targets.is_empty() {
        return Err(ConfigError::new("lora.targets", "names no layer pattern"));
    }
    let linears: Vec<(&str, &ParamSpec)> = specs
        .iter()
        .filter(|s| s.linear)
        .filter_map(|s| Some((s.name.strip_suffix(".weight")?, s)))
        .collect();
    for pattern in targets {
        if !linears
            .iter()
            .any(|(name, _)| targets::matches(pattern, name))
        {
            let examples: Vec<&str> = linears.iter().take(4).map(|(name, _)| *name).collect();
            return Err(ConfigError::new(
                "lora.targets",
                format!(
                    "`{pattern}` matches no linear layer of this model (its linears are named \
                     like {})",
                    examples.join(", ")
                ),
            ));
        }
    }
    let chosen = linears
        .into_iter()
        .filter(|(name, _)| targets.iter().any(|p| targets::matches(p, name)));
    chosen
        .map(|(name, base)| {
            let smaller = base.shape[0].min(base.shape[1]);
            if settings.rank > smaller {
                return Err(ConfigError::new(
                    "lora.rank",
                    format!(
                        "{} is larger than `{name}` ({:?}): the rank must be at most {smaller}",
                        settings.rank, base.shape
                    ),
                ));
            }
            Ok((name.to_string(), pair_specs(name, base, settings.rank)))
        })
        .collect()
}

impl Adapters {
    /// Wrap every linear of `model` that a pattern of `targets` selects (see
    /// [`targets::matches`]) with a new adapter: `A` Kaiming-uniform (PEFT's initialisation,
    /// `U(±1/√in)`), `B` zero, drawn from libtorch's global generator on the logical shapes so
    /// every tensor-parallel size starts alike. Fails, naming the `[lora]` field, for bad
    /// settings, a pattern that selects nothing, a rank above a layer's smaller side, or a
    /// linear that has an adapter already.
    pub fn attach(
        model: &dyn DiffusionModel,
        settings: LoraSettings,
        targets: &[String],
    ) -> Result<Self, ConfigError> {
        let mut pairs: HashMap<String, [ParamSpec; 2]> =
            adapter_specs(model.store().param_specs(), settings, targets)?
                .into_iter()
                .collect();
        let mut linears: Vec<&Linear> = Vec::new();
        model.visit_linears(&mut |l| linears.push(l));
        let chosen: Vec<&Linear> = linears
            .into_iter()
            .filter(|l| pairs.contains_key(l.name()))
            .collect();
        let mut specs = Vec::new();
        for linear in &chosen {
            if linear.adapter().is_some() {
                return Err(ConfigError::new(
                    "lora.targets",
                    format!("`{}` has an adapter already", linear.name()),
                ));
            }
            let pair = pairs.remove(linear.name()).expect("chosen by name");
            specs.extend(pair);
        }
        let training = Rc::new(Cell::new(false));
        let store = model.store();
        // Adapters train in f32 whatever the base weights' dtype.
        let (store, ()) = ShardedStore::build(
            store.vs.device(),
            Kind::Float,
            store.tp().clone(),
            specs.clone(),
            |root, tp| {
                let device = root.device();
                for (linear, pair) in chosen.iter().zip(specs.chunks(2)) {
                    let path = |leaf: &str| {
                        format!("{}.{leaf}", linear.name())
                            .split('.')
                            .fold(root.clone(), |p, part| p.sub(part))
                    };
                    let fan_in = pair[0].shape[1] as f64;
                    let a = shard_var(&path("lora_A"), &pair[0], tp, |s| {
                        let bound = 1.0 / fan_in.sqrt();
                        Tensor::empty(s, (Kind::Float, device)).uniform_(-bound, bound)
                    });
                    let b = shard_var(&path("lora_B"), &pair[1], tp, |s| {
                        Tensor::zeros(s, (Kind::Float, device))
                    });
                    let adapter = Adapter {
                        a,
                        b,
                        scale: settings.scale(),
                        dropout: settings.dropout,
                        training: training.clone(),
                    };
                    linear
                        .attach(adapter)
                        .expect("checked above: no adapter yet");
                }
            },
        )?;
        Ok(Self {
            store,
            modules: chosen.iter().map(|l| l.name().to_string()).collect(),
            settings,
            training,
        })
    }

    /// Start from the adapters of a file (`imported`, read by [`import::import`]; `file` names it
    /// in errors, which name `lora.init`): each of its modules must be one this set wraps, at
    /// this rank, with one `A` shared by all parts of a fused module; `B` is rescaled so that the
    /// update is the file's under this set's `α / r`. Modules the file lacks keep their fresh
    /// initialisation.
    pub fn load_imported(
        &mut self,
        imported: &[ImportedAdapter],
        file: &str,
    ) -> Result<(), ConfigError> {
        let refuse = |why: String| ConfigError::new("lora.init", format!("{file}: {why}"));
        let mut values: HashMap<String, Tensor> =
            self.store.gather_logical(false).into_iter().collect();
        for adapter in imported {
            let module = &adapter.module;
            if !self.modules.contains(module) {
                return Err(refuse(format!(
                    "has an adapter for `{module}`, which [lora] targets do not select"
                )));
            }
            if adapter.rank() != self.settings.rank {
                return Err(refuse(format!(
                    "`{module}` has rank {}, [lora] rank is {}",
                    adapter.rank(),
                    self.settings.rank
                )));
            }
            let (a, b, scale) = adapter.shared().ok_or_else(|| {
                refuse(format!(
                    "the parts of `{module}` ({}) have adapters of their own, which one fused \
                     adapter cannot continue; fold them into the base weights instead \
                     (`flux-hpc lora merge --adapter`)",
                    adapter.source.keys.join(", ")
                ))
            })?;
            let kind = values[&format!("{module}.lora_A.weight")].kind();
            let b = b.to_kind(Kind::Float) * (scale / self.settings.scale());
            values.insert(format!("{module}.lora_A.weight"), a.to_kind(kind));
            values.insert(format!("{module}.lora_B.weight"), b.to_kind(kind));
        }
        self.store
            .load_logical(&values)
            .map_err(|e| refuse(e.to_string()))
    }

    /// The adapters' parameters (what training updates and checkpoints hold).
    pub fn store(&self) -> &ShardedStore {
        &self.store
    }

    /// As [`Adapters::store`], to load or cast.
    pub fn store_mut(&mut self) -> &mut ShardedStore {
        &mut self.store
    }

    /// State-dict names of the wrapped modules, in model order.
    pub fn modules(&self) -> &[String] {
        &self.modules
    }

    /// Rank, strength and dropout.
    pub fn settings(&self) -> LoraSettings {
        self.settings
    }

    /// Switch the adapters' dropout on (training forward passes) or off.
    pub fn set_training(&self, on: bool) {
        self.training.set(on);
    }

    /// The weights of `base` (the model the adapters wrap) with every update folded in,
    /// `W + (α/r) · B · A`, at logical shapes (a collective under tensor parallelism): a plain
    /// model that computes what base and adapters compute together.
    pub fn merged(&self, base: &ShardedStore) -> Vec<(String, Tensor)> {
        let adapters: HashMap<String, Tensor> =
            self.store.gather_logical(false).into_iter().collect();
        let scale = self.settings.scale();
        base.gather_logical(false)
            .into_iter()
            .map(|(name, weight)| {
                let module = name.strip_suffix(".weight").unwrap_or(&name);
                let pair = (
                    adapters.get(&format!("{module}.lora_A.weight")),
                    adapters.get(&format!("{module}.lora_B.weight")),
                );
                let merged = match pair {
                    (Some(a), Some(b)) if self.modules.iter().any(|m| m == module) => {
                        let update = b.to_kind(Kind::Float).mm(&a.to_kind(Kind::Float)) * scale;
                        (weight.to_kind(Kind::Float) + update).to_kind(weight.kind())
                    }
                    _ => weight,
                };
                (name, merged)
            })
            .collect()
    }
}
