//! The registry of architectures, and [`ModelSpec`]: the `[model]` table of a run config as the
//! architecture it names, behind one type the rest of flux-hpc uses.

use std::any::Any;
use std::fmt::{self, Debug};

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tch::{Device, Kind};

use crate::activations::Activations;
use crate::architecture::{forward_flops, DiffusionModel, InputSpec, ModelConfig};
use crate::convert::{Layout, Source};
use crate::dit::DitConfig;
use crate::flops::{ForwardFlops, Rows};
use crate::flux2::Flux2Config;
use crate::tp::{ParamSpec, TpContext};
use crate::{ConfigError, FluxConfig};

/// One registered architecture: its name and how to read its `[model]` table.
pub struct Architecture {
    /// What `[model] architecture` says.
    pub name: &'static str,
    /// One line about it.
    pub about: &'static str,
    read: fn(toml::Table) -> Result<ModelSpec, ConfigError>,
}

impl Architecture {
    /// The entry for `C`.
    pub const fn of<C: ModelConfig + Default>() -> Self {
        Self {
            name: C::NAME,
            about: C::ABOUT,
            read: read_as::<C>,
        }
    }
}

/// Every architecture `[model] architecture` can name; the first is the default. Adding a model
/// adds one line here.
pub const ARCHITECTURES: &[Architecture] = &[
    Architecture::of::<FluxConfig>(),
    Architecture::of::<DitConfig>(),
    Architecture::of::<Flux2Config>(),
];

/// The key of `[model]` that names the architecture.
pub const ARCHITECTURE_KEY: &str = "architecture";

/// Read `table` (without its `architecture` key) as `C`'s config: a key `C` does not have is an
/// error naming it and the architecture, as is a value of the wrong type.
fn read_as<C: ModelConfig + Default>(table: toml::Table) -> Result<ModelSpec, ConfigError> {
    let known = toml::Table::try_from(C::default()).expect("configs serialise to tables");
    if let Some(key) = table.keys().find(|k| !known.contains_key(*k)) {
        let keys: Vec<&str> = known.keys().map(String::as_str).collect();
        return Err(ConfigError::new(
            key.as_str(),
            format!(
                "not a key of architecture \"{}\" ({}); its keys are {}",
                C::NAME,
                C::ABOUT,
                keys.join(", ")
            ),
        ));
    }
    let parse = |table: toml::Table| toml::Value::Table(table).try_into::<C>();
    let config = parse(table.clone()).map_err(|e| {
        // Name the key: the first whose value alone, over the defaults, fails to read.
        let key = table.iter().find(|(key, value)| {
            let mut one = known.clone();
            one.insert(key.to_string(), (*value).clone());
            parse(one).is_err()
        });
        ConfigError::new(
            key.map_or("", |(k, _)| k.as_str()),
            format!("architecture \"{}\": {}", C::NAME, e.message().trim_end()),
        )
    })?;
    Ok(ModelSpec::new(config))
}

/// The object-safe face of a [`ModelConfig`], implemented for every one.
trait AnyConfig: Debug + Send + Sync {
    fn name(&self) -> &'static str;
    fn validate(&self) -> Result<(), ConfigError>;
    fn check_tp_size(&self, tp: usize) -> Result<(), ConfigError>;
    fn check_sequence_parallel(&self) -> Result<(), ConfigError>;
    fn inputs(&self) -> InputSpec;
    fn param_specs(&self, tp_size: i64) -> Vec<ParamSpec>;
    fn weight_matrices(&self) -> Vec<(f64, Rows)>;
    fn forward_flops(&self, batch: i64, img: i64, txt: i64) -> ForwardFlops;
    fn activations(&self) -> Activations;
    fn uses_dropout(&self) -> bool;
    fn weight_layouts(&self) -> Vec<Layout>;
    fn external_source(&self, native: &str, layout: Layout) -> Option<Source>;
    fn diffusers_config(&self) -> Result<serde_json::Value, String>;
    fn summary(&self) -> Vec<(&'static str, String)>;
    fn build_as(
        &self,
        device: Device,
        kind: Kind,
        tp: TpContext,
    ) -> Result<Box<dyn DiffusionModel>, ConfigError>;
    fn to_table(&self) -> toml::Table;
    fn clone_box(&self) -> Box<dyn AnyConfig>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<C: ModelConfig> AnyConfig for C {
    fn name(&self) -> &'static str {
        C::NAME
    }
    fn validate(&self) -> Result<(), ConfigError> {
        ModelConfig::validate(self)
    }
    fn check_tp_size(&self, tp: usize) -> Result<(), ConfigError> {
        ModelConfig::check_tp_size(self, tp)
    }
    fn check_sequence_parallel(&self) -> Result<(), ConfigError> {
        ModelConfig::check_sequence_parallel(self)
    }
    fn inputs(&self) -> InputSpec {
        ModelConfig::inputs(self)
    }
    fn param_specs(&self, tp_size: i64) -> Vec<ParamSpec> {
        ModelConfig::param_specs(self, tp_size)
    }
    fn weight_matrices(&self) -> Vec<(f64, Rows)> {
        ModelConfig::weight_matrices(self)
    }
    fn forward_flops(&self, batch: i64, img: i64, txt: i64) -> ForwardFlops {
        forward_flops(self, batch, img, txt)
    }
    fn activations(&self) -> Activations {
        ModelConfig::activations(self)
    }
    fn uses_dropout(&self) -> bool {
        ModelConfig::uses_dropout(self)
    }
    fn weight_layouts(&self) -> Vec<Layout> {
        ModelConfig::weight_layouts(self)
    }
    fn external_source(&self, native: &str, layout: Layout) -> Option<Source> {
        ModelConfig::external_source(self, native, layout)
    }
    fn diffusers_config(&self) -> Result<serde_json::Value, String> {
        ModelConfig::diffusers_config(self)
    }
    fn summary(&self) -> Vec<(&'static str, String)> {
        ModelConfig::summary(self)
    }
    fn build_as(
        &self,
        device: Device,
        kind: Kind,
        tp: TpContext,
    ) -> Result<Box<dyn DiffusionModel>, ConfigError> {
        ModelConfig::build_as(self, device, kind, tp)
    }
    fn to_table(&self) -> toml::Table {
        toml::Table::try_from(self).expect("configs serialise to tables")
    }
    fn clone_box(&self) -> Box<dyn AnyConfig> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// A model config of any registered architecture: the `[model]` table of a run config. It
/// (de)serialises as that table with `architecture = "NAME"` (absent means the first registered,
/// `"flux"`), and answers for the model everything that needs no weights.
pub struct ModelSpec(Box<dyn AnyConfig>);

impl ModelSpec {
    /// Wrap a typed config.
    pub fn new<C: ModelConfig>(config: C) -> Self {
        Self(Box::new(config))
    }

    /// Read a `[model]` table: its `architecture` key (default `"flux"`) picks the entry of
    /// [`ARCHITECTURES`] that reads the rest. Errors name the key within `[model]`.
    pub fn from_table(mut table: toml::Table) -> Result<Self, ConfigError> {
        let name = match table.remove(ARCHITECTURE_KEY) {
            None => ARCHITECTURES[0].name.to_string(),
            Some(toml::Value::String(name)) => name,
            Some(other) => {
                return Err(ConfigError::new(
                    ARCHITECTURE_KEY,
                    format!("must be a string naming the architecture, got {other}"),
                ))
            }
        };
        let entry = ARCHITECTURES
            .iter()
            .find(|a| a.name == name)
            .ok_or_else(|| {
                let known: Vec<String> = ARCHITECTURES
                    .iter()
                    .map(|a| format!("\"{}\" ({})", a.name, a.about))
                    .collect();
                ConfigError::new(
                    ARCHITECTURE_KEY,
                    format!(
                        "unknown architecture \"{name}\"; known: {}",
                        known.join(", ")
                    ),
                )
            })?;
        (entry.read)(table)
    }

    /// The architecture's registered name.
    pub fn architecture(&self) -> &'static str {
        self.0.name()
    }

    /// The typed config, when the architecture is `C`'s.
    pub fn get<C: ModelConfig>(&self) -> Option<&C> {
        self.0.as_any().downcast_ref()
    }

    /// As [`ModelSpec::get`], mutable.
    pub fn get_mut<C: ModelConfig>(&mut self) -> Option<&mut C> {
        self.0.as_any_mut().downcast_mut()
    }

    /// Check every rule of the architecture; the error names the field within `[model]`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.0.validate()
    }

    /// Whether `tp` ranks can split the model (error field: `tensor_parallel_size`).
    pub fn check_tp_size(&self, tp: usize) -> Result<(), ConfigError> {
        self.0.check_tp_size(tp)
    }

    /// Whether the model's layers can work on slices of the sequence (error field:
    /// `sequence_parallel`, or the `[model]` field that rules it out).
    pub fn check_sequence_parallel(&self) -> Result<(), ConfigError> {
        self.0.check_sequence_parallel()
    }

    /// The inputs the model takes.
    pub fn inputs(&self) -> InputSpec {
        self.0.inputs()
    }

    /// Every parameter's logical name, shape and split for a group of `tp_size` ranks, computed
    /// without allocating.
    pub fn param_specs(&self, tp_size: i64) -> Vec<ParamSpec> {
        self.0.param_specs(tp_size)
    }

    /// Number of parameters (from the specs; nothing is allocated).
    pub fn num_params(&self) -> u64 {
        self.param_specs(1).iter().map(ParamSpec::numel).sum()
    }

    /// Every weight matrix as `(in · out, rows it is applied to)`.
    pub fn weight_matrices(&self) -> Vec<(f64, Rows)> {
        self.0.weight_matrices()
    }

    /// Forward FLOPs on `batch` samples of `img` image and `txt` text tokens.
    pub fn forward_flops(&self, batch: i64, img: i64, txt: i64) -> ForwardFlops {
        self.0.forward_flops(batch, img, txt)
    }

    /// What the training forward pass saves for backward, layer by layer.
    pub fn activations(&self) -> Activations {
        self.0.activations()
    }

    /// Whether training draws dropout masks.
    pub fn uses_dropout(&self) -> bool {
        self.0.uses_dropout()
    }

    /// The external weight layouts the model is imported from and exported to.
    pub fn weight_layouts(&self) -> Vec<Layout> {
        self.0.weight_layouts()
    }

    /// Where native parameter `native` lives in `layout`.
    pub fn external_source(&self, native: &str, layout: Layout) -> Option<Source> {
        self.0.external_source(native, layout)
    }

    /// diffusers' `config.json` for this model; the error says why there is none.
    pub fn diffusers_config(&self) -> Result<serde_json::Value, String> {
        self.0.diffusers_config()
    }

    /// `(label, value)` lines describing the shape.
    pub fn summary(&self) -> Vec<(&'static str, String)> {
        self.0.summary()
    }

    /// Validate and build this rank's shards for the group `tp` on `device` (f32).
    pub fn build(
        &self,
        device: Device,
        tp: TpContext,
    ) -> Result<Box<dyn DiffusionModel>, ConfigError> {
        self.build_as(device, Kind::Float, tp)
    }

    /// As [`ModelSpec::build`], the weights in `kind` (initialised in f32, rounded one by one).
    pub fn build_as(
        &self,
        device: Device,
        kind: Kind,
        tp: TpContext,
    ) -> Result<Box<dyn DiffusionModel>, ConfigError> {
        self.0.build_as(device, kind, tp)
    }

    /// The `[model]` table, `architecture` first.
    pub fn to_table(&self) -> toml::Table {
        let mut table = toml::Table::new();
        table.insert(ARCHITECTURE_KEY.into(), self.architecture().into());
        table.extend(self.0.to_table());
        table
    }
}

impl Default for ModelSpec {
    /// FLUX.1 [dev]'s shape.
    fn default() -> Self {
        Self::new(FluxConfig::default())
    }
}

impl Clone for ModelSpec {
    fn clone(&self) -> Self {
        Self(self.0.clone_box())
    }
}

impl Debug for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for ModelSpec {
    fn eq(&self, other: &Self) -> bool {
        self.to_table() == other.to_table()
    }
}

impl Serialize for ModelSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_table().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for ModelSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let table = toml::Table::deserialize(deserializer)?;
        Self::from_table(table).map_err(|e| D::Error::custom(e.within("model")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        text.parse().unwrap()
    }

    #[test]
    fn no_architecture_key_means_flux_and_tables_round_trip() {
        let spec =
            ModelSpec::from_table(table("hidden_size = 64\nnum_attention_heads = 4")).unwrap();
        assert_eq!(spec.architecture(), "flux");
        assert_eq!(spec.get::<FluxConfig>().unwrap().hidden_size, 64);
        assert!(spec.get::<DitConfig>().is_none());
        let again = ModelSpec::from_table(spec.to_table()).unwrap();
        assert_eq!(again, spec);
        assert_eq!(spec.to_table().keys().next().unwrap(), ARCHITECTURE_KEY);
    }

    #[test]
    fn activations_name_the_layers_the_built_model_runs() {
        for text in [
            "hidden_size = 32\nnum_attention_heads = 2\nnum_joint_layers = 2\nnum_single_layers = 1\naxes_dim = [4, 6, 6]",
            "architecture = \"dit\"\nhidden_size = 32\nnum_attention_heads = 2\ndepth = 3",
            "architecture = \"flux2\"\nnum_layers = 1\nnum_single_layers = 2\nnum_attention_heads = 2\nattention_head_dim = 16\naxes_dims_rope = [4, 4, 4, 4]",
        ] {
            let spec = ModelSpec::from_table(table(text)).unwrap();
            let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
            let names: Vec<String> = spec.activations().layers.into_iter().map(|l| l.name).collect();
            let layers = model.layers();
            assert_eq!(layers.first().unwrap(), crate::execution::residency::STEM);
            assert_eq!(layers.last().unwrap(), crate::execution::residency::HEAD);
            assert_eq!(names, layers[1..layers.len() - 1], "{}", spec.architecture());
        }
    }

    #[test]
    fn names_are_unique() {
        for (i, a) in ARCHITECTURES.iter().enumerate() {
            assert!(
                ARCHITECTURES[..i].iter().all(|b| b.name != a.name),
                "{}",
                a.name
            );
        }
    }

    #[test]
    fn unknown_architectures_and_foreign_keys_are_named() {
        let e = ModelSpec::from_table(table("architecture = \"flux3\"")).unwrap_err();
        assert_eq!(e.field, "architecture");
        assert!(
            e.message.contains("\"flux3\"") && e.message.contains("\"dit\""),
            "{e}"
        );
        let e = ModelSpec::from_table(table("architecture = 2")).unwrap_err();
        assert_eq!(e.field, "architecture");
        // A DiT key in a Flux table, and the other way round.
        let e = ModelSpec::from_table(table("depth = 4")).unwrap_err();
        assert_eq!(e.field, "depth");
        assert!(e.message.contains("\"flux\""), "{e}");
        let e = ModelSpec::from_table(table("architecture = \"dit\"\nnum_joint_layers = 2"))
            .unwrap_err();
        assert_eq!(e.field, "num_joint_layers");
        assert!(e.message.contains("\"dit\""), "{e}");
        let e =
            ModelSpec::from_table(table("architecture = \"dit\"\ndepth = \"deep\"")).unwrap_err();
        assert_eq!(e.field, "depth");
        assert!(e.message.contains("\"dit\""), "{e}");
    }
}
