//! DeepSeek-V3 (`model_type` deepseek_v3: DeepSeek-V3, V3.1, R1 and their distillations of
//! the same architecture) and GLM-4.7-Flash (`glm4_moe_lite`: the same layers, dense or
//! sparse by `mlp_layer_types`), as transformers' DeepseekV3ForCausalLM and
//! Glm4MoeLiteForCausalLM: Llama's layer order with multi-head latent attention and, after
//! the first `first_k_dense_replace` dense layers, DeepSeek's mixture of experts
//! (deepseek_moe.rs).
//!
//! Latent attention (`self_attn`): queries through a low-rank latent (`q_a_proj`, its
//! RMSNorm `q_a_layernorm`, `q_b_proj`; or `q_proj` alone when `q_lora_rank` is null); keys
//! and values through one shared latent of `kv_lora_rank` features (`kv_a_proj_with_mqa`,
//! `kv_a_layernorm`) expanded per head by `kv_b_proj` into `qk_nope_head_dim` key and
//! `v_head_dim` value features; rotary turns a separate `qk_rope_head_dim` part of each
//! query and one such key part shared by every head (laid out in interleaved pairs when
//! `rope_interleave`). Scores are scaled by 1/sqrt(qk_nope + qk_rope) times YaRN's
//! `mscale_all_dim` correction squared.
//!
//! The fused attention kernels take one head size: values narrower than queries are padded
//! with zeros to it, and the padding cut from the output (as transformers pads them for
//! flash-attention).
//!
//! Tensor parallelism as torchtitan splits DeepSeek-V3: `q_b_proj` (or `q_proj`) and
//! `kv_b_proj` column-parallel by heads, `o_proj` row-parallel; the latent projections and
//! their norms whole on every rank. The shared rotary key feeds every rank's heads, so its
//! gradient is summed over the group (`copy_to_group`).
//!
//! The checkpoints' multi-token prediction layers (`num_nextn_predict_layers`, stored after
//! the last layer) are not part of transformers' model, nor of this one.

use super::blocks::{deinterleave, lin, log_position_scale, Decoder, GatedMlp, Layer};
use super::deepseek_moe::{mlp_add, DeepseekMoe, DeepseekMoeConfig, SparseMlp};
use crate::comm::autograd::copy_to_group;
use crate::error::{Error, Result};
use crate::kernels::fused::rotary;
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::chain::Chain;
use crate::nn::{Linear, RmsNorm, RotaryEmbedding};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use std::sync::Arc;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["deepseek_v3", "glm4_moe_lite"];

/// DeepseekV3ForCausalLM.
pub type DeepseekV3 = Decoder<DeepseekV3Layer>;

/// The feature counts of latent attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatentDims {
    pub kv_rank: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    /// Rotary pairs interleaved (x0, x1), (x2, x3), ... rather than split in halves.
    pub interleave: bool,
    /// Multiplies the queries: the softmax scale over 1/sqrt(nope + rope).
    pub query_scale: f64,
    /// Mistral 4's position-dependent query scale (transformers' get_llama_4_attn_scale):
    /// 1 + beta * log(1 + floor(p / original_max)) at position p, as (beta, original_max).
    pub position_scale: Option<(f64, f64)>,
}

/// Multi-head latent attention (`self_attn`): queries through `q_a_proj`, `q_a_layernorm`
/// and `q_b_proj` (`q_lora_rank` set), or through `q_proj`.
#[derive(Debug, Clone, Parallelize)]
pub struct LatentAttention {
    #[parallel(tp = "replicate")]
    pub q_a_proj: Option<Linear>,
    #[parallel(tp = "replicate")]
    pub q_a_layernorm: Option<RmsNorm>,
    #[parallel(tp = "column")]
    pub q_b_proj: Option<Linear>,
    #[parallel(tp = "column")]
    pub q_proj: Option<Linear>,
    #[parallel(tp = "replicate")]
    pub kv_a_proj_with_mqa: Linear,
    #[parallel(tp = "replicate")]
    pub kv_a_layernorm: RmsNorm,
    #[parallel(tp = "column")]
    pub kv_b_proj: Linear,
    #[parallel(tp = "row")]
    pub o_proj: Linear,
    /// Heads on this rank.
    #[parallel(tp = "divide")]
    pub num_heads: usize,
    #[parallel(skip)]
    pub dims: LatentDims,
}

impl LatentAttention {
    pub(super) fn new(
        c: &ModelConfig,
        dims: LatentDims,
        q_rank: Option<usize>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let (h, n) = (c.hidden_size, c.num_attention_heads);
        let qk = dims.nope + dims.rope;
        let bias = c.attention_bias;
        // transformers builds the latents' norms with its default epsilon, not rms_norm_eps.
        let norm = |size, vb| crate::nn::rms_norm(size, 1e-6, vb);
        let latent = |f: &dyn Fn(usize) -> candle_core::Result<Linear>| q_rank.map(f).transpose();
        Ok(LatentAttention {
            q_a_proj: latent(&|r| lin(vb.pp("q_a_proj"), (h, r), bias))?,
            q_a_layernorm: q_rank
                .map(|r| norm(r, vb.pp("q_a_layernorm")))
                .transpose()?,
            q_b_proj: latent(&|r| lin(vb.pp("q_b_proj"), (r, n * qk), false))?,
            q_proj: match q_rank {
                Some(_) => None,
                None => Some(lin(vb.pp("q_proj"), (h, n * qk), false)?),
            },
            kv_a_proj_with_mqa: lin(
                vb.pp("kv_a_proj_with_mqa"),
                (h, dims.kv_rank + dims.rope),
                bias,
            )?,
            kv_a_layernorm: norm(dims.kv_rank, vb.pp("kv_a_layernorm"))?,
            kv_b_proj: lin(
                vb.pp("kv_b_proj"),
                (dims.kv_rank, n * (dims.nope + dims.v)),
                false,
            )?,
            o_proj: lin(vb.pp("o_proj"), (n * dims.v, h), bias)?,
            num_heads: n,
            dims,
        })
    }

    /// `residual + attention(h)` for `h` [batch, seq, hidden].
    pub fn forward_add(
        &self,
        h: &Tensor,
        residual: &Tensor,
        cx: &LayerInputs,
        rope: &RotaryEmbedding,
    ) -> Result<Tensor> {
        let (b, s, _) = h.dims3()?;
        let (d, n) = (self.dims, self.num_heads);
        let qk = d.nope + d.rope;
        let q = match (
            &self.q_a_proj,
            &self.q_a_layernorm,
            &self.q_b_proj,
            &self.q_proj,
        ) {
            (Some(a), Some(norm), Some(b), _) => b.forward(&norm.forward(&a.forward(h)?)?)?,
            (_, _, _, Some(q)) => q.forward(h)?,
            _ => {
                let why = "latent attention without queries";
                return Err(Error::Parallelism(why.into()));
            }
        };
        let q = q.reshape((b, s, n, qk))?.transpose(1, 2)?;
        let compressed = self.kv_a_proj_with_mqa.forward(h)?;
        let latent = compressed.narrow(2, 0, d.kv_rank)?.contiguous()?;
        let latent = self.kv_a_layernorm.forward(&latent)?.unsqueeze(1)?;
        let k_rot = compressed.narrow(2, d.kv_rank, d.rope)?.unsqueeze(1)?;
        let (cos, sin) = cx.cos_sin(rope)?;
        let turn = |t: Tensor| -> Result<Tensor> {
            let t = match d.interleave {
                true => deinterleave(&t)?,
                false => t.contiguous()?,
            };
            Ok(rotary(&t, &cos, &sin)?)
        };
        let q_rot = turn(q.narrow(3, d.nope, d.rope)?)?;
        let k_rot = turn(k_rot)?;
        // Every rank's heads read the one rotary key: its gradient is their sum.
        let k_rot = match cx.tp() {
            Some(tp) => copy_to_group(&k_rot, tp)?,
            None => k_rot,
        };
        // Generating, the cache holds each token's latent and rotary key [b, 1, tokens,
        // kv_rank + rope], as transformers' does, expanded per head at every step.
        let mut cache = cx.kv_cache();
        let (latent, k_rot) = match cache.as_mut() {
            Some(cache) => {
                let held = cache.hold(&Tensor::cat(&[&latent, &k_rot], 3)?)?;
                let rot = held.narrow(3, d.kv_rank, d.rope)?;
                (held.narrow(3, 0, d.kv_rank)?, rot)
            }
            None => (latent, k_rot),
        };
        let t = latent.dim(2)?;
        let kv = self.kv_b_proj.forward(&latent.squeeze(1)?)?;
        let kv = kv.reshape((b, t, n, d.nope + d.v))?.transpose(1, 2)?;
        let k_rot = k_rot.broadcast_as((b, n, t, d.rope))?;
        let k = Tensor::cat(&[kv.narrow(3, 0, d.nope)?, k_rot], 3)?;
        let q = Tensor::cat(&[q.narrow(3, 0, d.nope)?, q_rot], 3)?;
        // One head size for the kernels: the wider of the two, the other padded with zeros
        // (zero query/key features add nothing to the scores; the scale is corrected).
        let dim = qk.max(d.v);
        let pad = |t: Tensor, from: usize| -> Result<Tensor> {
            if from == dim {
                return Ok(t.contiguous()?);
            }
            let (b, n, s, _) = t.dims4()?;
            let zeros = Tensor::zeros((b, n, s, dim - from), t.dtype(), t.device())?;
            Ok(Tensor::cat(&[&t, &zeros], 3)?.contiguous()?)
        };
        let scale = d.query_scale * (dim as f64 / qk as f64).sqrt();
        let q = match (scale - 1.0).abs() > 1e-12 {
            true => (q * scale)?,
            false => q,
        };
        let q = match d.position_scale {
            Some((beta, max)) => {
                let t = log_position_scale(&cx.position_ids, (0.0, max), beta)?;
                q.broadcast_mul(&t.to_dtype(q.dtype())?)?
            }
            None => q,
        };
        let (q, k) = (pad(q, qk)?, pad(k, qk)?);
        let v = pad(kv.narrow(3, d.nope, d.v)?, d.v)?;
        let a = match cache.as_ref() {
            Some(cache) => cache.attend_held((&q, &k, &v), None, None, None)?,
            None => cx.attention_with(&q, &k, &v, None, None, None)?,
        };
        drop(cache);
        let a = a.narrow(3, 0, d.v)?.transpose(1, 2)?;
        let a = a.reshape((b, s, n * d.v))?;
        let out = Chain::merge_and_add(false, Some(residual));
        Ok(self.o_proj.forward_chain(&a, &out)?)
    }
}

/// x + attention(norm(x)), then + mlp(norm(x)) with a dense MLP or a mixture `M`
/// (DeepSeek's here, Mistral 4's in mistral4.rs).
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct LatentLayer<M: SparseMlp> {
    input_layernorm: RmsNorm,
    self_attn: LatentAttention,
    post_attention_layernorm: RmsNorm,
    #[parallel(name = "mlp")]
    dense: Option<GatedMlp>,
    #[parallel(name = "mlp")]
    sparse: Option<M>,
    #[parallel(skip)]
    rope: Arc<RotaryEmbedding>,
}

/// DeepSeek-V3's and GLM-4.7-Flash's layer.
pub type DeepseekV3Layer = LatentLayer<DeepseekMoe>;

impl<M: SparseMlp> LatentLayer<M>
where
    Self: Layer,
{
    /// The model of a latent-attention `config`: each layer's MLP dense, or (DeepSeek's
    /// `sparse` layers) the mixture `sparse(moe, vb)` builds from `mlp`'s `vb`.
    pub(super) fn build_latent(
        config: &ModelConfig,
        vb: VarBuilder,
        sparse: impl Fn(&DeepseekMoeConfig, VarBuilder) -> candle_core::Result<M>,
    ) -> candle_core::Result<Decoder<Self>> {
        let source = "config.json";
        let (dims, q_rank) = latent_dims(config, source).map_err(Error::into_candle)?;
        let moe = DeepseekMoeConfig::read(config, source).map_err(Error::into_candle)?;
        let rope = Arc::new(config.rotary().map_err(candle_core::Error::Msg)?);
        let (norm, _, body) = config.shapes();
        let h = config.hidden_size;
        Decoder::from_layers(body, vb, |l, vb| {
            let (dense, sparse) = moe.mlp(config, l, vb.pp("mlp"), |vb| sparse(&moe, vb))?;
            Ok(LatentLayer {
                input_layernorm: norm.build(h, vb.pp("input_layernorm"))?,
                self_attn: LatentAttention::new(config, dims, q_rank, vb.pp("self_attn"))?,
                post_attention_layernorm: norm.build(h, vb.pp("post_attention_layernorm"))?,
                dense,
                sparse,
                rope: rope.clone(),
            })
        })
    }

    /// The layer's output for `x`.
    pub(super) fn forward_latent(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = self.self_attn.forward_add(&h, x, cx, &self.rope)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        mlp_add(self.dense.as_ref(), self.sparse.as_ref(), cx, &h, &x)
    }

    /// Its query and key/value heads on this rank (the same: keys are expanded per head).
    pub(super) fn heads(&self) -> (usize, usize) {
        (self.self_attn.num_heads, self.self_attn.num_heads)
    }
}

/// The config keys of latent attention; errors name `source` and the key.
pub(super) fn latent_dims(c: &ModelConfig, source: &str) -> Result<(LatentDims, Option<usize>)> {
    let err = |key: &str, message: String| Error::config(source, key, message);
    let get = |key: &str| c.extra.get(key).filter(|v| !v.is_null());
    let count = |key: &str| -> Result<usize> {
        let v = get(key).ok_or_else(|| err(key, "missing".into()))?;
        match v.as_u64() {
            Some(n) if n > 0 => Ok(n as usize),
            _ => Err(err(key, format!("{v} is not a positive count"))),
        }
    };
    // Absent: transformers' default rank; null: queries projected directly.
    let q_rank = match c.extra.get("q_lora_rank") {
        Some(serde_json::Value::Null) => None,
        Some(_) => Some(count("q_lora_rank")?),
        None if c.model_type == "glm4_moe_lite" => Some(768),
        None if c.model_type == "mistral4" => Some(1024),
        None => Some(1536),
    };
    let (nope, rope, v) = (
        count("qk_nope_head_dim")?,
        count("qk_rope_head_dim")?,
        count("v_head_dim")?,
    );
    if !rope.is_multiple_of(2) {
        return Err(err(
            "qk_rope_head_dim",
            format!("{rope} must be even for rotary embeddings"),
        ));
    }
    if c.num_kv_heads() != c.num_attention_heads {
        return Err(err(
            "num_key_value_heads",
            format!(
                "{} for {} attention heads: latent attention expands keys and values for every head (transformers reads only equal counts)",
                c.num_kv_heads(),
                c.num_attention_heads
            ),
        ));
    }
    // transformers' yarn_apply_mscale: the softmax scale grows by mscale(factor,
    // mscale_all_dim)^2 under a non-default rotary scaling.
    let mut query_scale = 1.0;
    let mut position_scale = None;
    if let Some(p) = c.rope_parameters.as_ref().or(c.rope_scaling.as_ref()) {
        // Mistral 4 reads both from its rope_parameters.
        let number = |key: &str| p.extra.get(key).and_then(|v| v.as_f64());
        if c.model_type == "mistral4" {
            if let Some(beta) = number("llama_4_scaling_beta") {
                let max = p
                    .original_max_position_embeddings
                    .map(|m| m as f64)
                    .or_else(|| number("original_max_position_embeddings"))
                    .filter(|m| *m > 0.0)
                    .ok_or_else(|| {
                        let why = "llama_4_scaling_beta needs original_max_position_embeddings";
                        err("rope_parameters", why.into())
                    })?;
                position_scale = Some((beta, max));
            }
        }
        let all = p
            .extra
            .get("mscale_all_dim")
            .and_then(|v| v.as_f64())
            .unwrap_or(0.0);
        if p.rope_type != "default" && all != 0.0 {
            query_scale = crate::nn::rope::yarn_mscale(p.factor.unwrap_or(1.0), all).powi(2);
        }
    }
    let dims = LatentDims {
        kv_rank: count("kv_lora_rank")?,
        nope,
        rope,
        v,
        interleave: get("rope_interleave")
            .and_then(|v| v.as_bool())
            .unwrap_or(true),
        query_scale,
        position_scale,
    };
    Ok((dims, q_rank))
}

impl Layer for DeepseekV3Layer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        // head_dim is the rotary part (config.rs's transformers_defaults).
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        latent_dims(&config, source)?;
        DeepseekMoeConfig::read(&config, source)?;
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<DeepseekV3> {
        Self::build_latent(config, vb, |moe, vb| moe.moe(config, vb))
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        self.forward_latent(x, cx)
    }

    fn attention_heads(&self) -> (usize, usize) {
        self.heads()
    }

    fn may_skip_grad(name: &str) -> bool {
        crate::nn::lora::is_routed_expert(name) || super::deepseek_moe::is_correction_bias(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The halves layout of interleaved pairs, as transformers' interleaved rotary reads them.
    #[test]
    fn deinterleave_puts_even_features_first() {
        let t = Tensor::arange(0f32, 6.0, &Device::Cpu)
            .unwrap()
            .reshape((1, 1, 1, 6))
            .unwrap();
        let got: Vec<f32> = deinterleave(&t)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, vec![0.0, 2.0, 4.0, 1.0, 3.0, 5.0]);
    }
}
