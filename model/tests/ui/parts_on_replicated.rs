struct Dims {
    width: i64,
}

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[linear(in = config.width, parts = [q = config.width, k = config.width])]
    qk: flux_model::tp::Linear,
}

fn main() {}
