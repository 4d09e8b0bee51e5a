//! The model as a parameter of everything else: an architecture's config implements
//! [`ModelConfig`] and builds a [`DiffusionModel`]; [`ARCHITECTURES`] maps
//! `[model] architecture = "…"` to it; [`ModelSpec`] is a config of whichever one a run names.
//!
//! ```text
//! [model] table ─ModelSpec::from_table→ ModelSpec ─build(device, tp)→ Box<dyn DiffusionModel>
//!                   (ARCHITECTURES)        │ inputs, param_specs,        │ store (shards),
//!                                          │ FLOPs, summary              │ forward(DiffusionBatch)
//! ```

mod built;
mod inputs;
mod model;
mod registry;

pub use built::{Built, RootBlock};
pub(crate) use inputs::check_sequence_split;
pub use inputs::{DiffusionBatch, InputError, InputSpec};
pub use model::{DiffusionModel, Erased, ModelConfig, Registered};
pub use registry::{Architecture, ModelSpec, ARCHITECTURES, ARCHITECTURE_KEY};
