use trl_runtime::nn::{Linear, RmsNorm};
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Block {
    #[parallel(tp = "column")]
    norm: RmsNorm,
    #[parallel(tp = "column")]
    up: Linear,
    #[parallel(tp = "row")]
    down: Linear,
}

fn main() {}
