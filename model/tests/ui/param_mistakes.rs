use tch::Tensor;

struct Dims {
    width: i64,
}

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[param(shape = [6, config.width], split = 2)]
    split_past_the_shape: Tensor,
    #[param(shape = [6, config.width], split = 1, on_shards)]
    split_and_on_shards: Tensor,
    #[param(shape = [config.width], init = normal)]
    normal_without_std: Tensor,
    #[param(init = ones)]
    no_shape: Tensor,
    #[param(shape = [config.width])]
    not_a_tensor: Vec<f32>,
}

fn main() {}
