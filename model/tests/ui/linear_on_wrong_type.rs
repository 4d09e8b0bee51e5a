struct Dims {
    width: i64,
}

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[linear(in = config.width, out = config.width)]
    scale: flux_model::tp::RmsNorm,
}

fn main() {}
