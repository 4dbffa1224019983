use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "column", tp = "row")]
    up: Linear,
    #[parallel(tp = "row")]
    down: Linear,
}

fn main() {}
