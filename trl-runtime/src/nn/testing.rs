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
