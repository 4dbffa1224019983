//! The gated delta rule (Gated DeltaNet, `nn::gated_delta`) against transformers' own,
//! Qwen3-Next's torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule, on the
//! same random inputs with an initial state (skipped with a message without torch and
//! transformers: TRL_PYTHON).

mod common;

use candle_core::{DType, Device, Tensor};
use trl_runtime::nn::gated_delta::{chunked, l2_normalize, recurrent, DeltaInputs};

#[test]
fn chunks_and_recurrence_equal_transformers() {
    let Some(python) = common::python_with(&["torch", "transformers", "safetensors"]) else {
        return;
    };
    let dev = Device::Cpu;
    let (b, s, h, dk, dv) = (2, 13, 3, 8, 6);
    // transformers' layout: [b, s, heads, ...].
    let query = Tensor::randn(0f64, 1.0, (b, s, h, dk), &dev).unwrap();
    let key = Tensor::randn(0f64, 1.0, (b, s, h, dk), &dev).unwrap();
    let value = Tensor::randn(0f64, 1.0, (b, s, h, dv), &dev).unwrap();
    let g = (Tensor::rand(0f64, 1.0, (b, s, h), &dev).unwrap() * -0.7).unwrap();
    let beta = Tensor::rand(0.05f64, 0.95, (b, s, h), &dev).unwrap();
    let initial = Tensor::randn(0f64, 0.3, (b, h, dk, dv), &dev).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (input, output) = (
        tmp.path().join("in.safetensors"),
        tmp.path().join("out.safetensors"),
    );
    let tensors = [
        ("query", &query),
        ("key", &key),
        ("value", &value),
        ("g", &g),
        ("beta", &beta),
        ("initial_state", &initial),
    ];
    candle_core::safetensors::save(
        &tensors
            .iter()
            .map(|(n, t)| (n.to_string(), (*t).clone()))
            .collect(),
        &input,
    )
    .unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts/gated_delta_reference.py");
    common::stdout_of(
        std::process::Command::new(python)
            .arg(script)
            .arg(&input)
            .arg(&output)
            .arg("4"),
    );
    let want = candle_core::safetensors::load(&output, &dev).unwrap();
    // Ours: [b, heads, s, ...], queries and keys normalised and the queries scaled as
    // Qwen3-Next's layer does before the rule; one document a row, continued from the state.
    let heads = |t: &Tensor| t.transpose(1, 2).unwrap().contiguous().unwrap();
    let q = (l2_normalize(&heads(&query), 1e-6).unwrap() / (dk as f64).sqrt()).unwrap();
    let k = l2_normalize(&heads(&key), 1e-6).unwrap();
    let v = heads(&value);
    let (g, beta) = (heads(&g), heads(&beta));
    let starts = vec![vec![false; s]; b];
    let x = DeltaInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
        starts: &starts,
    };
    let diff = |a: &Tensor, w: &Tensor| {
        common::max_abs_diff(
            &a.to_dtype(DType::F32).unwrap(),
            &w.to_dtype(DType::F32).unwrap(),
        )
    };
    for (name, (out, state)) in [
        ("chunked", chunked(&x, Some(&initial), 4).unwrap()),
        ("recurrent", recurrent(&x, Some(&initial)).unwrap()),
    ] {
        let out = heads(&out);
        for (theirs, got) in [("chunk", (&out, &state)), ("recurrent", (&out, &state))] {
            let (o, st) = got;
            let (d_out, d_state) = (
                diff(o, &want[&format!("{theirs}_out")]),
                diff(st, &want[&format!("{theirs}_state")]),
            );
            eprintln!(
                "ours {name} vs transformers' {theirs}: outputs {d_out:e}, state {d_state:e}"
            );
            // transformers computes in float32.
            assert!(d_out < 1e-5 && d_state < 1e-5, "{name} vs {theirs}");
        }
    }
}

/// The whole Gated DeltaNet layer (projections, the short convolution, gates, the rule in
/// chunks of 4 over 13 tokens, the gated norm) equals transformers' Qwen3NextGatedDeltaNet on
/// the same random weights and inputs.
#[test]
fn the_layer_equals_transformers() {
    use trl_runtime::models::gated_deltanet::{DeltaNetShape, GatedDeltaNet, Projections};
    use trl_runtime::models::LayerInputs;
    use trl_runtime::nn::AttentionImpl;
    let Some(python) = common::python_with(&["torch", "transformers", "safetensors"]) else {
        return;
    };
    let dev = Device::Cpu;
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("layer.safetensors");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts/gated_deltanet_reference.py");
    common::stdout_of(std::process::Command::new(python).arg(script).arg(&file));
    let tensors = candle_core::safetensors::load(&file, &dev).unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(tensors.clone(), DType::F32, &dev);
    let shape = DeltaNetShape {
        hidden: 32,
        key_heads: 2,
        value_heads: 4,
        key_dim: 8,
        value_dim: 6,
        conv_kernel: 4,
        eps: 1e-6,
        chunk: 4,
        projections: Projections::Grouped,
    };
    let layer = GatedDeltaNet::new(shape, vb).unwrap();
    let hidden = &tensors["hidden"];
    let pos = Tensor::arange(0i64, 13, &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((2, 1))
        .unwrap();
    let cx = LayerInputs::new(&pos, None, AttentionImpl::Eager, DType::F32, &dev).unwrap();
    let got = layer.forward(hidden, &cx).unwrap();
    let diff = common::max_abs_diff(&got, &tensors["output"]);
    eprintln!("Gated DeltaNet layer vs transformers: {diff:e}");
    assert!(diff < 1e-5, "{diff}");
}
