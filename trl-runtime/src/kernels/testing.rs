//! Comparisons the layer tests share (f32 tensors).

use candle_core::Tensor;

/// The largest absolute difference between `a` and `b`.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a - b).unwrap())
}

/// The largest magnitude in `t`.
pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The largest absolute difference relative to the largest magnitude of `b`.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs_diff(a, b) / max_abs(b)
}

/// `out` and the gradients of `q`, `k`, `v` of the loss sum(out * w): an attention's output
/// and input gradients under one random upstream gradient.
pub fn out_and_grads(
    out: Tensor,
    w: &Tensor,
    [q, k, v]: [&candle_core::Var; 3],
) -> (Tensor, Vec<Tensor>) {
    let grads = (&out * w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = [q, k, v]
        .iter()
        .map(|t| grads.get(t).unwrap().clone())
        .collect();
    (out, g)
}

/// Asserts that an output and its q, k, v gradients (as [`out_and_grads`] gives them) are
/// within `tol` of the wanted ones, naming `what` and the tensor that is not.
pub fn assert_out_and_grads(
    got: &(Tensor, Vec<Tensor>),
    want: &(Tensor, Vec<Tensor>),
    tol: f32,
    what: &str,
) {
    let diff = max_abs_diff(&got.0, &want.0);
    assert!(diff < tol, "{what}: output differs by {diff}");
    for (x, (g, w)) in ["q", "k", "v"].iter().zip(got.1.iter().zip(&want.1)) {
        let diff = max_abs_diff(g, w);
        assert!(diff < tol, "{what}: d{x} differs by {diff}");
    }
}

/// Normal draws (mean 0, `std`) from a generator seeded with `seed`, rounded to values bf16
/// holds exactly: f32 and bf16 runs start from the same inputs, and every run from the same.
pub fn bf16_exact_randn(shape: impl Into<candle_core::Shape>, std: f32, seed: u64) -> Tensor {
    use rand::SeedableRng;
    use rand_distr::Distribution;
    let shape = shape.into();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = rand_distr::Normal::new(0f32, std).unwrap();
    let values: Vec<f32> = (0..shape.elem_count())
        .map(|_| half::bf16::from_f32(normal.sample(&mut rng)).to_f32())
        .collect();
    Tensor::from_vec(values, shape, &candle_core::Device::Cpu).unwrap()
}
