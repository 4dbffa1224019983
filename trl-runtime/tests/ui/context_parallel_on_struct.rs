// #[context_parallel] belongs on the training-step function, not on a type.
use trl_runtime::context_parallel;

#[context_parallel]
struct Step {
    steps: usize,
}

fn main() {}
