struct Dims;

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[linear(in = 64, out = 192, shard = column, parts = [q = 64, k = 64, v = 32])]
    qkv: flux_model::tp::Linear,
    #[linear(in = 64, out = 64, shard = row)]
    proj: flux_model::tp::Linear,
}

fn main() {}
