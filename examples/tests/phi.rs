//! The Phi example model (examples/src/phi.rs) against transformers' PhiForCausalLM on the
//! fixture scripts/make_phi_fixture.py wrote: same logits within 1e-4.

use candle_core::{DType, Device, Tensor};
use trl_examples::phi::Phi;
use trl_runtime::parallel::Model;

#[test]
fn phi_logits_match_transformers() {
    logits_match("tiny-phi");
}

/// With qk_layernorm: per-head LayerNorms on queries and keys.
#[test]
fn phi_with_qk_norms_logits_match_transformers() {
    logits_match("tiny-phi-qk");
}

fn logits_match(fixture: &str) {
    let dir = trl_examples::assets::default_dir()
        .parent()
        .unwrap()
        .join(fixture);
    let model = Model::<Phi>::from_pretrained(dir.join("model"), DType::F32, &Device::Cpu).unwrap();
    let parity =
        candle_core::safetensors::load(dir.join("parity.safetensors"), &Device::Cpu).unwrap();
    let ids = parity["input_ids"].to_dtype(DType::U32).unwrap();
    let (b, s) = ids.dims2().unwrap();
    let pos = Tensor::arange(0i64, s as i64, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((b, 1))
        .unwrap();
    let want = &parity["logits"];
    // Through the trainer's path (layer by layer) and through the model's own forward.
    for got in [
        model.forward(&ids, &pos).unwrap(),
        model.net().forward(&ids, &pos).unwrap(),
    ] {
        let diff = (got - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        eprintln!("max |ours - transformers| = {diff:e}");
        assert!(diff < 1e-4, "max |ours - transformers| = {diff}");
    }
}
