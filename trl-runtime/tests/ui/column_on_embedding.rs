use trl_runtime::nn::{Embedding, Linear};
use trl_runtime::Parallelize;

#[derive(Parallelize)]
struct Lm {
    #[parallel(tp = "column")]
    embed: Embedding,
    #[parallel(tp = "row")]
    proj: Linear,
}

fn main() {}
