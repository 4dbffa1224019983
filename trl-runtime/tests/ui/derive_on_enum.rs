use trl_runtime::nn::Linear;
use trl_runtime::Parallelize;

#[derive(Parallelize)]
enum Head {
    Tied(Linear),
    Separate(Linear),
}

fn main() {}
