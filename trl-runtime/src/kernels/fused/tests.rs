use super::*;
use candle_core::{Device, Var};

fn rel(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let diff = (&a - &b).unwrap().sqr().unwrap().sum_all().unwrap();
    let norm = b.sqr().unwrap().sum_all().unwrap();
    (diff.to_scalar::<f32>().unwrap() / norm.to_scalar::<f32>().unwrap().max(1e-30)).sqrt()
}

/// Forward and both gradients of `fused` against `reference` on fresh random inputs.
fn check(
    dtype: DType,
    tol: f32,
    shape: (usize, usize, usize),
    fused: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    reference: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    second_is_row: bool,
) {
    let dev = Device::Cpu;
    let a = Var::from_tensor(
        &Tensor::randn(0f32, 1.0, shape, &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    )
    .unwrap();
    let b_shape: Shape = if second_is_row {
        shape.2.into()
    } else {
        shape.into()
    };
    let b = Var::from_tensor(
        &Tensor::randn(0f32, 1.0, b_shape, &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    )
    .unwrap();
    let probe = Tensor::randn(0f32, 1.0, shape, &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let run = |f: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>| {
        let y = f(a.as_tensor(), b.as_tensor()).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * probe.to_dtype(DType::F32).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let g = loss.backward().unwrap();
        (
            y,
            g.get(a.as_tensor()).unwrap().clone(),
            g.get(b.as_tensor()).unwrap().clone(),
        )
    };
    let (y1, da1, db1) = run(&fused);
    let (y0, da0, db0) = run(&reference);
    for (what, ours, theirs) in [
        ("out", &y1, &y0),
        ("grad a", &da1, &da0),
        ("grad b", &db1, &db0),
    ] {
        let e = match (what, second_is_row) {
            // A row's gradient sums every row's probe: two summation orders differ by
            // rounding on the terms' scale, which a sum that cancels to near zero would
            // inflate relative to itself. Measured against the terms' root sum of squares
            // (what such a sum is on average) instead.
            ("grad b", true) => {
                let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let diff = (f32s(ours) - f32s(theirs)).unwrap().sqr().unwrap();
                let terms = f32s(&probe).sqr().unwrap().sum_all().unwrap();
                let diff = diff.sum_all().unwrap().to_scalar::<f32>().unwrap();
                (diff / terms.to_scalar::<f32>().unwrap().max(1e-30)).sqrt()
            }
            _ => rel(ours, theirs),
        };
        assert!(e < tol, "{dtype:?} {what}: relative error {e}");
    }
}

#[test]
fn exp_is_accurate_over_the_f32_range() {
    let mut worst = 0f64;
    for i in 0..=200_000 {
        let x = -87.0 + 175.0 * i as f64 / 200_000.0;
        let ours = exp_f32(x as f32) as f64;
        let exact = (x as f32 as f64).exp();
        worst = worst.max(((ours - exact) / exact).abs());
    }
    assert!(worst < 3e-7, "worst relative error {worst}");
    assert!(sigmoid(-200.0) < 1e-37 && sigmoid(200.0) == 1.0);
}

#[test]
fn rms_norm_matches_the_candle_ops() {
    let eps = 1e-6;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        for shape in [(2, 7, 64), (1, 33, 96), (3, 1, 8)] {
            check(
                dtype,
                tol,
                shape,
                |x, w| rms_norm(x, w, eps),
                |x, w| rms_norm_reference(x, w, eps),
                true,
            );
        }
    }
}

#[test]
fn rotary_matches_the_candle_ops() {
    let dev = Device::Cpu;
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        for (b, h, s, d) in [(2, 3, 5, 8), (1, 4, 33, 64)] {
            // Angles as the model makes them: per batch row and position, halves repeated.
            let ang = Tensor::randn(0f32, 3.0, (b, s, d / 2), &dev).unwrap();
            let ang = Tensor::cat(&[&ang, &ang], 2).unwrap();
            let (cos, sin) = (
                ang.cos().unwrap().to_dtype(dtype).unwrap(),
                ang.sin().unwrap().to_dtype(dtype).unwrap(),
            );
            let x = Var::from_tensor(
                &Tensor::randn(0f32, 1.0, (b, h, s, d), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
            let probe = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
            let run = |f: &dyn Fn(&Tensor) -> Result<Tensor>| {
                let y = f(x.as_tensor()).unwrap();
                let loss = (y.to_dtype(DType::F32).unwrap() * &probe)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let g = loss.backward().unwrap();
                (y, g.get(x.as_tensor()).unwrap().clone())
            };
            let (y1, g1) = run(&|x| rotary(x, &cos, &sin));
            let (y0, g0) = run(&|x| apply_rotary(x, &cos, &sin));
            assert!(rel(&y1, &y0) < tol, "{dtype:?} out {}", rel(&y1, &y0));
            assert!(rel(&g1, &g0) < tol, "{dtype:?} grad {}", rel(&g1, &g0));
        }
    }
}

#[test]
fn swiglu_matches_the_candle_ops() {
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        for shape in [(2, 7, 64), (1, 5000, 3)] {
            check(dtype, tol, shape, swiglu, |g, u| g.silu()? * u, false);
        }
    }
}

/// gpt-oss's activation against transformers' ops, values and gradient, with inputs on
/// both sides of the clamps (std 3 around a limit of 2.01).
#[test]
fn clamped_swiglu_matches_the_candle_ops() {
    let dev = Device::Cpu;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let x = Var::from_tensor(
            &(Tensor::randn(0f32, 1.0, (3, 5, 64), &dev).unwrap() * 3.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let probe = Tensor::randn(0f32, 1.0, (3, 5, 32), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let run = |f: &dyn Fn(&Tensor) -> Result<Tensor>| {
            let y = f(x.as_tensor()).unwrap();
            let g = (&y * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let grad = g.get(x.as_tensor()).unwrap().to_dtype(DType::F32).unwrap();
            (y.to_dtype(DType::F32).unwrap(), grad)
        };
        // A limit off bf16's grid: no input sits exactly on it (where Candle's minimum
        // splits the gradient and torch's clamp passes it).
        let (y1, g1) = run(&|x| clamped_swiglu(x, 1.702, 2.01));
        // The reference in f32 from the same inputs (bf16 rounds each of its ops).
        let (y0, g0) = run(&|x| {
            clamped_swiglu_reference(&x.to_dtype(DType::F32)?, 1.702, 2.01)?.to_dtype(dtype)
        });
        assert!(rel(&y1, &y0) < tol, "{dtype:?} out {}", rel(&y1, &y0));
        assert!(rel(&g1, &g0) < tol, "{dtype:?} grad {}", rel(&g1, &g0));
        // The clamps bite: some gradients are 0.
        let zeros = g1
            .eq(0f32)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap();
        assert!(zeros.to_scalar::<f32>().unwrap() > 100.0);
    }
}

#[test]
fn bias_add_matches_the_broadcast_add() {
    // 5000 rows: the bias gradient is summed over several row chunks, in another order
    // than Candle's sum (hence 1e-5 in f32).
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
        for shape in [(2, 7, 64), (1, 5000, 3)] {
            // The reference adds in f32: Candle sums a bf16 gradient in bf16.
            let reference = |y: &Tensor, b: &Tensor| {
                y.to_dtype(DType::F32)?
                    .broadcast_add(&b.to_dtype(DType::F32)?)?
                    .to_dtype(dtype)
            };
            check(dtype, tol, shape, add_bias, reference, true);
        }
    }
}

/// The parallel mask is splitmix64's sequential stream (the draw LoRA's dropout made one
/// element at a time on the host), crossing the op's chunks; the gradient goes through the
/// same mask; f64 (the host path) draws it too.
#[test]
fn dropout_draws_the_sequential_stream_and_its_gradient_the_same_mask() {
    // splitmix64's published first output from state 0: the stream is the standard one
    // (the expectation below is built from the same function).
    assert_eq!(splitmix(GOLDEN), 0xE220_A839_7B1D_CDAF);
    let (n, p, seed) = (40_000, 0.3, 0x1234_5678_9abc_def0u64);
    let mut state = seed;
    let expected: Vec<f32> = (0..n)
        .map(|_| {
            state = state.wrapping_add(GOLDEN);
            let u = (splitmix(state) >> 11) as f64 / (1u64 << 53) as f64;
            if u < 1.0 - p {
                (1.0 / (1.0 - p)) as f32
            } else {
                0.0
            }
        })
        .collect();
    let kept = expected.iter().filter(|v| **v != 0.0).count();
    assert!((27_500..28_500).contains(&kept), "{kept} of {n} kept");
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, n, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let mask = Tensor::new(expected.as_slice(), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let y = dropout(&x, seed, p).unwrap();
        let want = (x.as_tensor() * &mask).unwrap();
        assert_eq!(rel(&y, &want), 0.0, "{dtype:?} forward");
        let dy = Tensor::randn(0f32, 1.0, n, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = grads.get(&x).unwrap();
        assert_eq!(rel(dx, &(&dy * &mask).unwrap()), 0.0, "{dtype:?} gradient");
    }
}

/// A frozen layer's rows (a LoRA base's, an expert's) come out the same in a training forward
/// whatever other rows the call holds: every training forward takes the GEMM. When one of a
/// decode step's size took the skinny kernel, whose sums run in another order, a strategy that
/// handed an expert fewer rows moved its outputs in the last bits (expert parallelism against
/// the same ranks without it).
#[test]
fn a_frozen_layers_rows_do_not_depend_on_the_rows_beside_them() {
    let dev = Device::Cpu;
    let x = Var::randn(0f32, 1.0, (40, 96), &dev).unwrap();
    let w = Tensor::randn(0f32, 1.0, (64, 96), &dev).unwrap();
    let few = linear_frozen(&x.as_tensor().narrow(0, 0, 8).unwrap(), &w, None).unwrap();
    let all = linear_frozen(x.as_tensor(), &w, None).unwrap();
    let d = crate::kernels::testing::max_abs_diff(&few, &all.narrow(0, 0, 8).unwrap());
    assert_eq!(d, 0.0, "8 rows alone against 8 of 40");
}
