use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "column", shard_dim = 0)]
    up: Linear,
    #[parallel(tp = "row")]
    down: Linear,
}

fn main() {}
