// A step must return its loss (sum and token count), which the macro makes global.
use candle_core::Tensor;
use trl_runtime::context_parallel;
use trl_runtime::data::Batch;
use trl_runtime::dist::DistContext;

#[context_parallel]
fn step(batch: &Batch, ctx: &DistContext) -> trl_runtime::Result<Tensor> {
    let _ = ctx;
    Ok(batch.input_ids.clone())
}

fn main() {}
