use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Attention {
    #[parallel(tp = "column")]
    q: Linear,
    #[parallel(tp = "row")]
    o: Linear,
    #[parallel(tp = "divide")]
    scale: f64,
}

fn main() {}
