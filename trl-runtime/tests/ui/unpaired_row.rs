use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Out {
    #[parallel(tp = "row")]
    o_proj: Linear,
}

fn main() {}
