//! Training beside the cached forward of candle-transformers' qwen3.rs: the port's only new
//! code (a child module, so it reads the model's private fields). The cached forward stays
//! as written, for generation; the trainer runs these, layer by layer.
//!
//! What differs from the cached forward, and why:
//! - no `&mut self`, no KV cache, no `offset`: the trainer runs each layer on whole
//!   sequences (or this rank's chunk of them), at `LayerInputs::position_ids`, which restart
//!   in packed rows (`cx.at_positions` picks the rotary rows an offset would have narrowed);
//! - rotary through `trl_runtime::nn::rotary_emb::rope` (candle_nn's has no backward pass);
//! - attention through `cx.attention` (candle_nn's CPU `flash_attn` and `softmax_last_dim`
//!   have no backward pass; `cx.attention` also runs ring attention / Ulysses under cp / sp
//!   and keeps packed documents apart).

use super::*;
use trl_runtime::models::{CausalModel, LayerInputs};
use trl_runtime::nn::rotary_emb::rope;

impl Qwen3Attention {
    fn forward_train(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let (b, l, _) = x.dims3()?;
        let heads = |t: Tensor, n: usize| t.reshape((b, l, n, self.head_dim))?.transpose(1, 2);
        let q = heads(self.q_proj.forward(x)?, self.num_heads)?;
        let k = heads(self.k_proj.forward(x)?, self.num_kv_heads)?;
        let v = heads(self.v_proj.forward(x)?, self.num_kv_heads)?;
        // Per-head RMSNorm over head_dim, as the cached forward does.
        let (q, k) = (self.q_norm.forward(&q)?, self.k_norm.forward(&k)?);
        let cos = cx.at_positions(&self.rotary_emb.cos)?;
        let sin = cx.at_positions(&self.rotary_emb.sin)?;
        let (q, k) = (rope(&q, &cos, &sin)?, rope(&k, &cos, &sin)?);
        let ctx = cx.attention(&q, &k, &v)?;
        ctx.transpose(1, 2)?
            .reshape((b, l, self.hidden_size))?
            .apply(&self.o_proj)
    }
}

impl DecoderLayer {
    fn forward_train(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let h = self.self_attn.forward_train(&self.ln1.forward(x)?, cx)?;
        let x = (x + h)?;
        let h2 = self.ln2.forward(&x)?.apply(&self.mlp)?;
        x + h2
    }
}

impl CausalModel for ModelForCausalLM {
    type Config = Config;

    /// transformers 5 keeps `rope_theta` in `rope_parameters`; the Config above reads it at
    /// the top, where older checkpoints have it.
    fn parse_config(text: &str, source: &str) -> trl_runtime::Result<Config> {
        let bad = |e: serde_json::Error| trl_runtime::Error::Config {
            file: source.into(),
            key: "<document>".into(),
            message: format!("not a Qwen3 config: {e}"),
        };
        let mut v: serde_json::Value = serde_json::from_str(text).map_err(bad)?;
        if v.get("rope_theta").is_none() {
            if let Some(theta) = v.pointer("/rope_parameters/rope_theta").cloned() {
                v["rope_theta"] = theta;
            }
        }
        serde_json::from_value(v).map_err(bad)
    }

    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        ModelForCausalLM::new(cfg, vb)
    }

    fn embed(&self, input_ids: &Tensor, _: &LayerInputs) -> Result<Tensor> {
        self.base.embed_tokens.forward(input_ids)
    }

    fn num_layers(&self) -> usize {
        self.base.layers.len()
    }

    fn layer(&self, l: usize, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        self.base.layers[l].forward_train(x, cx)
    }

    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.base.norm.forward(x)
    }

    fn lm_head(&self) -> &trl_runtime::nn::Linear {
        &self.lm_head
    }

    fn heads(&self) -> Option<(usize, usize)> {
        let a = &self.base.layers.first()?.self_attn;
        Some((a.num_heads, a.num_kv_heads))
    }
}
