use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

struct MyProjection {
    weight: candle_core::Tensor,
}

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "column")]
    up: MyProjection,
    #[parallel(tp = "row")]
    down: Linear,
}

fn main() {}
