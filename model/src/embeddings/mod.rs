//! Input embeddings: timestep sinusoids, MLP embedders and multi-axis RoPE.

mod mlp;
mod rope;
mod timestep;

pub use mlp::{EmbedderDims, MlpEmbedder};
pub use rope::{generate_image_position_ids, text_position_ids, token_grid_ids, EmbedNd, Rope};
pub use timestep::{timestep_embedding, TimeStepEmbedder, TIME_FACTOR};
