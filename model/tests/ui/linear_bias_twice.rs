struct Dims {
    width: i64,
}

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[linear(in = config.width, out = config.width, bias = false, shard = replicated, bias = true)]
    proj: flux_model::tp::Linear,
}

fn main() {}
