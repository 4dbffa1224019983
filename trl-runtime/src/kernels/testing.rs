//! Comparisons the layer tests share (f32 tensors).

use candle_core::Tensor;

/// The largest absolute difference between `a` and `b`.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The largest absolute difference relative to the largest magnitude of `b`.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    max_abs_diff(a, b) / scale
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
