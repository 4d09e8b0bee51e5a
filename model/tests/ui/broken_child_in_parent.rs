// A mistake in a child block is one error: the child still implements `Block`, so a parent that
// holds it as a module and as layers compiles without follow-on errors.
use flux_macros::diffusion_block;
use flux_model::execution::Layers;
use flux_model::tp::Linear;

pub struct Cfg {
    pub d: i64,
}

#[diffusion_block(config = Cfg)]
pub struct Child {
    #[linear(in = config.d, out = config.d, shard = diagonal)]
    fc: Linear,
}

impl Child {
    fn forward(&self) {}
}

#[diffusion_block(config = Cfg)]
pub struct Parent {
    #[module]
    child: Child,
    #[layers(count = 2, name = "layers")]
    layers: Layers<Child>,
}

impl Parent {
    fn forward(&self) {}
}

fn main() {}
