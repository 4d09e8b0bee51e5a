//! DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers") with adaLN-Zero blocks, a
//! second model written with `#[diffusion_block]`: `architecture = "dit"`.

mod architecture;
mod block;
mod config;
mod model;
mod pos_embed;

pub use block::DitBlock;
pub use config::DitConfig;
pub use model::{Dit, DitTransformer};
pub use pos_embed::sincos_2d;
