use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Experts {
    #[parallel(tp = "column")]
    up: Vec<Linear>,
    #[parallel(tp = "row")]
    down: Linear,
}

fn main() {}
