// Every mistake of a block is reported at once, and the struct is still emitted: code that uses
// it (`heads` below) gets no follow-on errors.
use flux_macros::diffusion_block;
use flux_model::tp::Linear;

pub struct Cfg {
    pub d: i64,
}

#[diffusion_block(config = Cfg)]
pub struct Attn {
    #[linear(in = config.d, out = config.d, shard = diagonal)]
    qkv: Linear,
    heads: i64,
    #[linear(in = config.d, out = config.d, shard = row)]
    proj: Linear,
}

impl Attn {
    fn forward(&self) -> i64 {
        self.heads
    }
}

fn main() {}
