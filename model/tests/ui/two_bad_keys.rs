// Every bad key of one attribute is reported, not only the first.
use flux_macros::diffusion_block;
use flux_model::tp::Linear;

pub struct Cfg {
    pub d: i64,
}

#[diffusion_block(config = Cfg)]
pub struct Proj {
    #[linear(in = config.d, colour = 1, out = config.d, shape = [2])]
    fc: Linear,
}

impl Proj {
    fn forward(&self) {}
}

fn main() {}
