use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "column")]
    up: Linear,
    down: Linear,
}

fn main() {}
