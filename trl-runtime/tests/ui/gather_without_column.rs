use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "column")]
    up: Linear,
    #[parallel(tp = "row", gather_output)]
    down: Linear,
}

fn main() {}
