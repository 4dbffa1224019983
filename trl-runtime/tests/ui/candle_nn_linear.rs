use trl_runtime::Parallelize;

// candle_nn's layers carry no sharding: swap the import for trl_runtime::nn's.
#[derive(Parallelize)]
struct Mlp {
    up: candle_nn::Linear,
}

fn main() {}
