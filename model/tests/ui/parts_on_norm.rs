struct Dims {
    width: i64,
}

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[norm(dim = config.width, parts = [a = 2, b = 2])]
    scale: flux_model::tp::RmsNorm,
}

fn main() {}
