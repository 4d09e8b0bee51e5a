#[flux_macros::diffusion_block]
struct Block {
    #[linear(in = 8, out = 8)]
    proj: flux_model::tp::Linear,
}

fn main() {}
