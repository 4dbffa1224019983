use trl_runtime::nn::{Linear, RmsNorm};
use trl_runtime::Parallelize;

// Every mistake of the struct is reported in one compile.
#[derive(Parallelize)]
#[parallel(shard)]
struct Block {
    #[parallel(tp = "rows")]
    a: Linear,
    #[parallel(tp = "row")]
    norm: RmsNorm,
    #[parallel(fsdp_unit, tp = "column")]
    b: Linear,
    #[parallel(skip, skip)]
    c: usize,
}

fn main() {}
