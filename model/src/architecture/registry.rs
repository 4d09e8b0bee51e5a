//! The registry of architectures, and [`ModelSpec`]: the `[model]` table of a run config as the
//! architecture it names, behind one type the rest of flux-hpc uses.

use std::fmt::{self, Debug};

use crate::architecture::{ModelConfig, Registered};
use crate::dit::DitConfig;
use crate::flux2::Flux2Config;
use crate::{ConfigError, FluxConfig};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One registered architecture: its name and how to read its `[model]` table.
pub struct Architecture {
    /// What `[model] architecture` says.
    pub name: &'static str,
    /// One line about it.
    pub about: &'static str,
    read: fn(toml::Table) -> Result<ModelSpec, ConfigError>,
    tiny: fn() -> ModelSpec,
}

impl Architecture {
    /// The entry for `C`.
    pub const fn of<C: Registered>() -> Self {
        Self {
            name: C::NAME,
            about: C::ABOUT,
            read: read_as::<C>,
            tiny: || ModelSpec::new(C::tiny()),
        }
    }

    /// The architecture's tiny test config ([`Registered::tiny`]).
    pub fn tiny(&self) -> ModelSpec {
        (self.tiny)()
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
fn read_as<C: Registered>(table: toml::Table) -> Result<ModelSpec, ConfigError> {
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

/// A model config of any registered architecture: the `[model]` table of a run config. It
/// (de)serialises as that table with `architecture = "NAME"` (absent means the first registered,
/// `"flux"`), and answers for the model everything that needs no weights.
/// Every [`ModelConfig`] method is called on it directly (it dereferences to the config).
pub struct ModelSpec(Box<dyn ModelConfig>);

impl ModelSpec {
    /// Wrap a typed config.
    pub fn new<C: Registered>(config: C) -> Self {
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
    pub fn get<C: Registered>(&self) -> Option<&C> {
        self.0.as_any().downcast_ref()
    }

    /// As [`ModelSpec::get`], mutable.
    pub fn get_mut<C: Registered>(&mut self) -> Option<&mut C> {
        self.0.as_any_mut().downcast_mut()
    }

    /// The `[model]` table, `architecture` first.
    pub fn to_table(&self) -> toml::Table {
        let mut table = toml::Table::new();
        table.insert(ARCHITECTURE_KEY.into(), self.architecture().into());
        table.extend(self.0.fields());
        table
    }
}

impl std::ops::Deref for ModelSpec {
    type Target = dyn ModelConfig;

    fn deref(&self) -> &Self::Target {
        &*self.0
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
        self.0.same_as(&*other.0)
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
    use crate::tp::TpContext;
    use tch::Device;

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
        for architecture in ARCHITECTURES {
            let spec = architecture.tiny();
            let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
            let names: Vec<String> = spec
                .activations()
                .layers
                .into_iter()
                .map(|l| l.name)
                .collect();
            let layers = model.layers();
            assert_eq!(layers.first().unwrap(), crate::execution::residency::STEM);
            assert_eq!(layers.last().unwrap(), crate::execution::residency::HEAD);
            assert_eq!(
                names,
                layers[1..layers.len() - 1],
                "{}",
                spec.architecture()
            );
        }
    }

    #[test]
    fn tiny_configs_are_valid_and_round_trip_through_their_tables() {
        for architecture in ARCHITECTURES {
            let spec = architecture.tiny();
            assert_eq!(spec.architecture(), architecture.name);
            spec.validate().unwrap();
            assert_eq!(ModelSpec::from_table(spec.to_table()).unwrap(), spec);
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
