// The step has no `&Batch` argument to cut along the sequence.
use candle_core::Tensor;
use trl_runtime::context_parallel;
use trl_runtime::dist::DistContext;
use trl_runtime::nn::LossSum;

#[context_parallel]
fn step(input_ids: &Tensor, ctx: &DistContext) -> trl_runtime::Result<LossSum> {
    let _ = (input_ids, ctx);
    unimplemented!()
}

fn main() {}
