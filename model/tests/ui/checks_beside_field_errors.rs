// A field that fails to parse does not hide the cross-field checks of the fields that did: the
// bad norm key and the row-parallel linear without a column-parallel producer are both reported.
use flux_macros::diffusion_block;
use flux_model::tp::{Linear, RmsNorm};

pub struct Cfg {
    pub d: i64,
}

#[diffusion_block(config = Cfg)]
pub struct Out {
    #[norm(dim = config.d, epsilon = 1e-6)]
    norm: RmsNorm,
    #[linear(in = config.d, out = config.d, shard = row)]
    proj: Linear,
}

impl Out {
    fn forward(&self) {}
}

fn main() {}
