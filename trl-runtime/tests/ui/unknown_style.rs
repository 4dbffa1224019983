use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "colum")]
    up: Linear,
    #[parallel(tp = "row")]
    down: Linear,
}

fn main() {}
