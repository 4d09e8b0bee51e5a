struct Dims {
    width: i64,
}

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[norm(dim = config.width, bias = true)]
    scale: flux_model::tp::RmsNorm,
}

fn main() {}
