struct Dims {
    width: i64,
}

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[linear(in = config.width, out = 4 * config.width)]
    up: flux_model::tp::Linear,
    #[linear(in = 4 * config.width, out = config.width, shard = row)]
    down: flux_model::tp::Linear,
}

fn main() {}
