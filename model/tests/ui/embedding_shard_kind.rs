struct Dims {
    vocab: i64,
    width: i64,
}

#[flux_macros::diffusion_block(config = Dims)]
struct Block {
    #[embedding(num = config.vocab, dim = config.width, shard = column)]
    tokens: flux_model::tp::Embedding,
    #[embedding(num = config.vocab)]
    positions: flux_model::tp::Embedding,
}

fn main() {}
