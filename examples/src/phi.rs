//! A Phi-style decoder (transformers' `PhiForCausalLM`: Phi-1, Phi-1.5, Phi-2) written the
//! plain Candle way (a `Config` read from config.json, constructors over a `VarBuilder`,
//! `forward` functions) and made trainable under every strategy of `cargo trl launch`.
//!
//! Its differences from the built-in Llama / Qwen2 decoder are the point: LayerNorm with
//! biases, biases on every projection, GELU (tanh) MLP, rotary embeddings on only part of
//! each head (`partial_rotary_factor`), attention and MLP in parallel on the same normed
//! input, an LM head with a bias, and optionally (`qk_layernorm`) a LayerNorm over each
//! head's queries and keys.
//!
//! What changed against the plain Candle model (docs/your-model.md shows the whole diff):
//! the `trl_runtime::nn` layers instead of candle_nn's (same constructors), `flash_attn`
//! from `trl_runtime::nn` instead of `candle_flash_attn`, the `#[derive(Parallelize)]`
//! attributes, and the `CausalModel` impl at the end.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::Deserialize;
use trl_runtime::models::{CausalModel, LayerInputs};
use trl_runtime::nn::{embedding, flash_attn, layer_norm, linear, Embedding, LayerNorm, Linear};
use trl_runtime::Parallelize;

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub hidden_act: String,
    pub max_position_embeddings: usize,
    pub layer_norm_eps: f64,
    /// Older configs keep the rotary settings at the top; transformers 5 in `rope_parameters`.
    pub rope_theta: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub qk_layernorm: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    pub rope_theta: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
}

impl Config {
    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    fn rope_theta(&self) -> f64 {
        let nested = self.rope_parameters.as_ref().and_then(|r| r.rope_theta);
        self.rope_theta.or(nested).unwrap_or(10_000.0)
    }

    fn partial_rotary_factor(&self) -> f64 {
        let nested = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r.partial_rotary_factor);
        self.partial_rotary_factor.or(nested).unwrap_or(0.5)
    }
}

/// cos and sin tables [max_position_embeddings, rotary_dim] (angles in f32, as transformers
/// computes them), looked up by position: packed rows restart their positions.
#[derive(Clone)]
struct Rotary {
    cos: Tensor,
    sin: Tensor,
    dim: usize,
}

impl Rotary {
    fn new(cfg: &Config, device: &Device) -> Result<Self> {
        let dim = (cfg.head_dim() as f64 * cfg.partial_rotary_factor()) as usize;
        let theta = cfg.rope_theta();
        let inv_freq: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / dim as f64) as f32)
            .collect();
        let mut angles = Vec::with_capacity(cfg.max_position_embeddings * dim);
        for p in 0..cfg.max_position_embeddings {
            let row: Vec<f32> = inv_freq.iter().map(|f| p as f32 * f).collect();
            angles.extend_from_slice(&row);
            angles.extend_from_slice(&row);
        }
        let angles = Tensor::from_vec(angles, (cfg.max_position_embeddings, dim), device)?;
        Ok(Rotary {
            cos: angles.cos()?,
            sin: angles.sin()?,
            dim,
        })
    }

    /// cos and sin [batch, seq, 1, dim] at `position_ids` [batch, seq].
    fn at(&self, position_ids: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, s) = position_ids.dims2()?;
        let ids = position_ids.flatten_all()?.to_dtype(DType::U32)?;
        let pick = |t: &Tensor| {
            t.index_select(&ids, 0)?
                .reshape((b, s, 1, self.dim))?
                .to_dtype(dtype)
        };
        Ok((pick(&self.cos)?, pick(&self.sin)?))
    }

    /// Rotates the first `dim` features of every head of `x` [batch, seq, heads, head_dim].
    fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let head_dim = x.dim(D::Minus1)?;
        let (rot, pass) = (
            x.narrow(D::Minus1, 0, self.dim)?,
            x.narrow(D::Minus1, self.dim, head_dim - self.dim)?,
        );
        let half = self.dim / 2;
        let (x1, x2) = (
            rot.narrow(D::Minus1, 0, half)?,
            rot.narrow(D::Minus1, half, half)?,
        );
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        let rot = (rot.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?;
        Tensor::cat(&[&rot, &pass], D::Minus1)
    }
}

#[derive(Parallelize)]
struct Attention {
    #[parallel(tp = "column")]
    q_proj: Linear,
    #[parallel(tp = "column")]
    k_proj: Linear,
    #[parallel(tp = "column")]
    v_proj: Linear,
    #[parallel(tp = "row")]
    dense: Linear,
    // Per-head norms (qk_layernorm) act on heads split over tp, so each rank computes part
    // of their gradients. Unannotated beside column and row layers they are `auto`: the first
    // step finds their gradients differ across ranks and sums them from then on.
    q_layernorm: Option<LayerNorm>,
    k_layernorm: Option<LayerNorm>,
    #[parallel(tp = "divide")]
    num_heads: usize,
    #[parallel(tp = "divide")]
    num_kv_heads: usize,
    #[parallel(skip)]
    head_dim: usize,
}

impl Attention {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let heads = cfg.num_attention_heads;
        let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
        let qk_norm = |name: &str| match cfg.qk_layernorm {
            true => layer_norm(d, cfg.layer_norm_eps, vb.pp(name)).map(Some),
            false => Ok(None),
        };
        Ok(Attention {
            q_layernorm: qk_norm("q_layernorm")?,
            k_layernorm: qk_norm("k_layernorm")?,
            q_proj: linear(h, heads * d, vb.pp("q_proj"))?,
            k_proj: linear(h, kv_heads * d, vb.pp("k_proj"))?,
            v_proj: linear(h, kv_heads * d, vb.pp("v_proj"))?,
            dense: linear(heads * d, h, vb.pp("dense"))?,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: d,
        })
    }

    fn forward(&self, x: &Tensor, rotary: &Rotary, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let heads = |t: Tensor, n: usize| t.reshape((b, s, n, self.head_dim));
        let q = heads(self.q_proj.forward(x)?, self.num_heads)?;
        let k = heads(self.k_proj.forward(x)?, self.num_kv_heads)?;
        let v = heads(self.v_proj.forward(x)?, self.num_kv_heads)?;
        let norm = |t: Tensor, n: &Option<LayerNorm>| match n {
            Some(n) => n.forward(&t),
            None => Ok(t),
        };
        let (q, k) = (norm(q, &self.q_layernorm)?, norm(k, &self.k_layernorm)?);
        let (q, k) = (rotary.apply(&q, cos, sin)?, rotary.apply(&k, cos, sin)?);
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let y = flash_attn(&q, &k, &v, scale, true)?;
        self.dense
            .forward(&y.reshape((b, s, self.num_heads * self.head_dim))?)
    }
}

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "column")]
    fc1: Linear,
    #[parallel(tp = "row")]
    fc2: Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // gelu_new: the tanh approximation (Candle's `gelu`).
        self.fc2.forward(&self.fc1.forward(x)?.gelu()?)
    }
}

#[derive(Parallelize)]
#[parallel(fsdp_unit)]
struct Block {
    input_layernorm: LayerNorm,
    self_attn: Attention,
    mlp: Mlp,
}

impl Block {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let mlp = vb.pp("mlp");
        Ok(Block {
            input_layernorm: layer_norm(h, cfg.layer_norm_eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, vb.pp("self_attn"))?,
            mlp: Mlp {
                fc1: linear(h, i, mlp.pp("fc1"))?,
                fc2: linear(i, h, mlp.pp("fc2"))?,
            },
        })
    }

    /// Attention and MLP side by side on the same normed input, both added to the residual.
    fn forward(&self, x: &Tensor, rotary: &Rotary, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let attn = self.self_attn.forward(&h, rotary, cos, sin)?;
        let ff = self.mlp.forward(&h)?;
        (attn + ff)? + x
    }
}

#[derive(Parallelize)]
pub struct Phi {
    #[parallel(tp = "vocab", name = "model.embed_tokens")]
    embed_tokens: Embedding,
    #[parallel(name = "model.layers")]
    layers: Vec<Block>,
    #[parallel(name = "model.final_layernorm")]
    final_layernorm: LayerNorm,
    #[parallel(tp = "vocab")]
    lm_head: Linear,
    #[parallel(skip)]
    rotary: Rotary,
}

impl Phi {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        if cfg.hidden_act != "gelu_new" {
            candle_core::bail!(
                "config.json: hidden_act = {} (this model implements gelu_new)",
                cfg.hidden_act
            );
        }
        let m = vb.pp("model");
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| Block::new(cfg, m.pp("layers").pp(l)))
            .collect::<Result<Vec<_>>>()?;
        let embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, m.pp("embed_tokens"))?;
        let lm_head = match cfg.tie_word_embeddings {
            true => Linear::new(embed_tokens.embeddings().clone(), None),
            false => linear(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?,
        };
        Ok(Phi {
            embed_tokens,
            layers,
            final_layernorm: layer_norm(
                cfg.hidden_size,
                cfg.layer_norm_eps,
                m.pp("final_layernorm"),
            )?,
            lm_head,
            rotary: Rotary::new(cfg, vb.device())?,
        })
    }

    /// Logits [batch, seq, vocab] of `input_ids` at `position_ids` (both [batch, seq]).
    pub fn forward(&self, input_ids: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
        let mut x = self.embed_tokens.forward(input_ids)?;
        let (cos, sin) = self.rotary.at(position_ids, x.dtype())?;
        for layer in &self.layers {
            x = layer.forward(&x, &self.rotary, &cos, &sin)?;
        }
        self.lm_head.forward(&self.final_layernorm.forward(&x)?)
    }
}

/// What the trainer and the strategies need: the forward above, one layer at a time.
impl CausalModel for Phi {
    type Config = Config;

    fn parse_config(text: &str, source: &str) -> trl_runtime::Result<Config> {
        serde_json::from_str(text).map_err(|e| trl_runtime::Error::Config {
            file: source.into(),
            key: "<document>".into(),
            message: format!("not a Phi config: {e}"),
        })
    }

    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        Phi::new(cfg, vb)
    }

    fn embed(&self, input_ids: &Tensor, _: &LayerInputs) -> Result<Tensor> {
        self.embed_tokens.forward(input_ids)
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer(&self, l: usize, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let (cos, sin) = self.rotary.at(&cx.position_ids, x.dtype())?;
        self.layers[l].forward(x, &self.rotary, &cos, &sin)
    }

    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.final_layernorm.forward(x)
    }

    fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    fn heads(&self) -> Option<(usize, usize)> {
        let a = &self.layers.first()?.self_attn;
        Some((a.num_heads, a.num_kv_heads))
    }
}
