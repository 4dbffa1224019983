//! AdamW against a scalar re-implementation of PyTorch's update, schedules against HF's
//! formulas at known points, and global-norm clipping.

use candle_core::{Device, Tensor};
use std::collections::BTreeMap;
use trl_runtime::train::optim::grad_norm_sq;

mod common;

use trl_runtime::train::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule, SchedulerKind};

/// torch.optim.AdamW for one scalar, step by step.
fn reference(p0: f64, grads: &[f64], lr: f64, c: AdamWConfig, decay: bool) -> f64 {
    let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
    for (t, g) in grads.iter().enumerate() {
        let t = (t + 1) as i32;
        if decay {
            p *= 1.0 - lr * c.weight_decay;
        }
        m = c.beta1 * m + (1.0 - c.beta1) * g;
        v = c.beta2 * v + (1.0 - c.beta2) * g * g;
        let denom = v.sqrt() / (1.0 - c.beta2.powi(t)).sqrt() + c.eps;
        p -= lr / (1.0 - c.beta1.powi(t)) * m / denom;
    }
    p
}

#[test]
fn adamw_matches_pytorch_update() {
    let c = AdamWConfig {
        weight_decay: 0.1,
        ..Default::default()
    };
    let w0 = [0.5f32, -1.25, 2.0];
    let params: Vec<(String, Tensor)> = vec![
        (
            "layer.weight".into(),
            Tensor::new(&w0, &Device::Cpu).unwrap(),
        ),
        ("layer.bias".into(), Tensor::new(&w0, &Device::Cpu).unwrap()),
    ];
    let mut opt = AdamW::new(params.iter().map(|(n, t)| (n, t)), c).unwrap();
    let grad_steps = [
        [0.1f32, -0.3, 0.05],
        [0.2, 0.1, -0.4],
        [-0.05, 0.0, 0.3],
        [0.7, -0.2, 0.1],
    ];
    let lr = 0.01;
    for g in &grad_steps {
        let mut grads = BTreeMap::new();
        for (n, _) in &params {
            grads.insert(n.clone(), Tensor::new(g, &Device::Cpu).unwrap());
        }
        opt.update(&grads, lr).unwrap();
    }
    assert_eq!(opt.step, 4);
    for (name, decay) in [("layer.weight", true), ("layer.bias", false)] {
        let got: Vec<f32> = opt.states[name].master.to_vec1().unwrap();
        for i in 0..3 {
            let gs: Vec<f64> = grad_steps.iter().map(|g| g[i] as f64).collect();
            let want = reference(w0[i] as f64, &gs, lr, c, decay);
            assert!(
                (got[i] as f64 - want).abs() < 1e-6,
                "{name}[{i}]: {} vs {want}",
                got[i]
            );
        }
    }
    assert_eq!(opt.state_bytes(), 2 * 3 * 3 * 4);
}

#[test]
fn schedules_follow_transformers() {
    let lin = LrSchedule::new(SchedulerKind::Linear, 1.0, 100, 10, 0.0);
    assert_eq!(lin.factor(0), 0.0);
    assert_eq!(lin.factor(5), 0.5);
    assert_eq!(lin.factor(10), 1.0);
    assert!((lin.factor(55) - 0.5).abs() < 1e-12);
    assert_eq!(lin.factor(100), 0.0);

    let cos = LrSchedule::new(SchedulerKind::Cosine, 2.0, 110, 0, 0.1 / 1.1);
    assert_eq!(cos.warmup_steps, 10); // ceil(0.0909.. x 110)
    assert_eq!(cos.lr(10), 2.0);
    assert!((cos.factor(60) - 0.5).abs() < 1e-12);
    assert!(cos.factor(110).abs() < 1e-12);

    let c = LrSchedule::new(SchedulerKind::ConstantWithWarmup, 1.0, 50, 4, 0.0);
    assert_eq!((c.factor(2), c.factor(4), c.factor(49)), (0.5, 1.0, 1.0));
    let c = LrSchedule::new(SchedulerKind::Constant, 1.0, 50, 4, 0.0);
    assert_eq!(c.factor(0), 1.0);
    assert!(SchedulerKind::parse("cosine_with_hard_restarts")
        .unwrap_err()
        .to_string()
        .contains("cosine_with_min_lr"));
    assert!(SchedulerKind::parse("reduce_lr_on_plateau")
        .unwrap_err()
        .to_string()
        .contains("evaluation loss"));
}

/// Every schedule we accept, with and without its keyword arguments, against transformers'
/// `get_scheduler` on the same settings: the learning rate of every step (1e-12 relative),
/// through warmup, decay and past the end. Skipped with a message without torch and
/// transformers.
#[test]
fn schedules_and_their_kwargs_equal_transformers_get_scheduler() {
    use trl_runtime::train::{CliValue, KwArgs, SchedulerArgs};
    let Some(python) = common::python_with(&["torch", "transformers"]) else {
        return;
    };
    // (name, kwargs, warmup steps, total steps)
    let cases: &[(&str, &str, usize, usize)] = &[
        ("linear", "{}", 7, 40),
        ("cosine", "{}", 5, 40),
        ("cosine", r#"{"num_cycles": 1.25}"#, 5, 40),
        ("cosine_with_restarts", r#"{"num_cycles": 3}"#, 4, 40),
        ("polynomial", r#"{"lr_end": 1e-4, "power": 2.0}"#, 6, 40),
        ("inverse_sqrt", "{}", 8, 40),
        ("inverse_sqrt", r#"{"timescale": 3}"#, 0, 40),
        ("constant_with_warmup", "{}", 9, 40),
        ("cosine_with_min_lr", r#"{"min_lr_rate": 0.1}"#, 4, 40),
        (
            "cosine_with_min_lr",
            r#"{"min_lr": 2e-4, "num_cycles": 0.75}"#,
            0,
            40,
        ),
        (
            "cosine_warmup_with_min_lr",
            r#"{"min_lr_rate": 0.05}"#,
            6,
            40,
        ),
        (
            "cosine_warmup_with_min_lr",
            r#"{"min_lr_rate": 0.05, "warmup_lr_rate": 0.2}"#,
            6,
            40,
        ),
        ("warmup_stable_decay", r#"{"num_decay_steps": 12}"#, 5, 40),
        (
            "warmup_stable_decay",
            r#"{"num_decay_steps": 10, "num_stable_steps": 15, "warmup_type": "cosine", "decay_type": "1-sqrt", "min_lr_ratio": 0.1}"#,
            5,
            40,
        ),
        (
            "warmup_stable_decay",
            r#"{"num_decay_steps": 9, "decay_type": "linear", "warmup_type": "1-sqrt"}"#,
            5,
            40,
        ),
    ];
    let lr = 1e-3;
    let spec: Vec<String> = cases
        .iter()
        .map(|(n, k, w, t)| format!("[{n:?}, {k}, {w}, {t}]"))
        .collect();
    let script = format!(
        "import json, torch\n\
         from transformers import get_scheduler\n\
         out = []\n\
         for name, kw, w, t in json.loads({:?}):\n\
         \x20   opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr={lr})\n\
         \x20   s = get_scheduler(name, opt, num_warmup_steps=w, num_training_steps=t, scheduler_specific_kwargs=kw)\n\
         \x20   lrs = []\n\
         \x20   for _ in range(t + 3):\n\
         \x20       lrs.append(opt.param_groups[0]['lr'])\n\
         \x20       opt.step(); s.step()\n\
         \x20   out.append(lrs)\n\
         print(json.dumps(out))\n",
        format!("[{}]", spec.join(", "))
    );
    let o = std::process::Command::new(&python)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: Vec<Vec<f64>> = serde_json::from_slice(&o.stdout).unwrap();
    for ((name, kwargs, w, t), want) in cases.iter().zip(&want) {
        let kind = SchedulerKind::parse(name).unwrap();
        let kwargs = KwArgs::parse_cli(kwargs).unwrap();
        let args = SchedulerArgs::from_kwargs(kind, &kwargs, lr).unwrap();
        let s = LrSchedule::new(kind, lr, *t, *w, 0.0).with_args(args);
        for (step, want) in want.iter().enumerate() {
            let got = s.lr(step);
            assert!(
                (got - want).abs() <= 1e-12 * want.abs().max(1e-12),
                "{name} {kwargs:?} step {step}: {got} vs transformers' {want}"
            );
        }
    }
}

/// What transformers refuses (TypeError, ValueError) is refused naming the key.
#[test]
fn schedule_kwargs_transformers_refuses_are_refused() {
    use trl_runtime::train::{CliValue, KwArgs, SchedulerArgs};
    for (name, kwargs, key) in [
        ("linear", r#"{"num_cycles": 2}"#, "num_cycles"),
        ("cosine", r#"{"min_lr_rate": 0.1}"#, "min_lr_rate"),
        ("cosine_with_min_lr", "{}", "min_lr_rate"),
        (
            "cosine_with_min_lr",
            r#"{"min_lr": 1e-5, "min_lr_rate": 0.1}"#,
            "min_lr",
        ),
        ("polynomial", r#"{"lr_end": 0.01}"#, "lr_end"),
        ("warmup_stable_decay", "{}", "num_decay_steps"),
        (
            "warmup_stable_decay",
            r#"{"num_decay_steps": 3, "decay_type": "exp"}"#,
            "decay_type",
        ),
        (
            "cosine_with_restarts",
            r#"{"num_cycles": 1.5}"#,
            "num_cycles",
        ),
    ] {
        let kind = SchedulerKind::parse(name).unwrap();
        let (k, why) = SchedulerArgs::from_kwargs(kind, &KwArgs::parse_cli(kwargs).unwrap(), 1e-3)
            .unwrap_err();
        assert_eq!(
            k,
            format!("lr_scheduler_kwargs.{key}"),
            "{name} {kwargs}: {why}"
        );
    }
}

#[test]
fn clipping_by_global_norm() {
    let mut grads = BTreeMap::new();
    grads.insert(
        "a".to_string(),
        Tensor::new(&[3.0f32, 0.0], &Device::Cpu).unwrap(),
    );
    grads.insert(
        "b".to_string(),
        Tensor::new(&[[0.0f32, 4.0]], &Device::Cpu).unwrap(),
    );
    let norm = clip_grad_norm(&mut grads, 1.0, None).unwrap();
    assert!((norm - 5.0).abs() < 1e-6);
    let after = grad_norm_sq(&grads).unwrap().sqrt();
    assert!((after - 1.0).abs() < 1e-5, "{after}");
    // Below the limit nothing changes.
    let before = grads["a"].to_vec1::<f32>().unwrap();
    clip_grad_norm(&mut grads, 10.0, None).unwrap();
    assert_eq!(grads["a"].to_vec1::<f32>().unwrap(), before);
}

/// The patched candle (vendor/candle-core, `GradStore::accumulate`) stores a variable's
/// gradient detached: one computed from the forward's tensors, or summed from several uses,
/// would otherwise keep that graph and every addend alive for as long as the store (under
/// checkpointing, a layer's backward into the next; measured 3-14% of a sharded step's peak).
#[test]
fn a_variables_gradient_holds_no_graph() {
    use candle_core::Var;
    let dev = Device::Cpu;
    let w = Var::new(&[[1f32, 2.], [3., 4.]], &dev).unwrap();
    let x = Var::new(&[[1f32, 1.]], &dev).unwrap();
    // x is used twice: its gradient is a sum.
    let y = x.matmul(&w.t().unwrap()).unwrap();
    let z = (y.sum_all().unwrap() + x.sum_all().unwrap()).unwrap();
    let store = z.backward().unwrap();
    let gx = store.get(x.as_tensor()).unwrap();
    let gw = store.get(w.as_tensor()).unwrap();
    assert!(
        !gx.track_op() && !gw.track_op(),
        "a stored gradient tracks its graph"
    );
    assert_eq!(gx.to_vec2::<f32>().unwrap(), [[5., 7.]]);
    assert_eq!(gw.to_vec2::<f32>().unwrap(), [[1., 1.], [1., 1.]]);
}
