//! The built-in model for a checkpoint's `model_type`, as transformers'
//! `AutoModelForCausalLM` picks it: [`AutoModelForCausalLM`] is a [`CausalModel`] (the
//! trainer's `Trainer::<AutoModelForCausalLM>` trains any supported checkpoint), and
//! [`AutoModelForCausalLM::from_pretrained`] + [`AutoModelForCausalLM::forward`] give logits
//! on one process, for evaluation scripts and for checking against transformers.
//!
//! Adding a model type: write it in its own file over [`CausalModel`] and add a line to the
//! `registry!` below (docs/models.md).

use super::causal::{CausalModel, LayerInputs};
use super::params::{read_config, shapes_and_aliases, FilesBackend, WeightFiles};
use super::{
    deepseek_v3, gemma3, gemma4, glm4_moe, gpt_oss, llama, llama4, mistral4, mixtral, olmo2, phi3,
    qwen3_moe, qwen3_next,
};
use crate::error::{Error, Result};
use crate::nn::module::Parallelize;
use crate::nn::module::TpContext;
use crate::nn::module::{EpShard, ExpertFn, LinearFn, ParamFn, WeightFn};
use crate::nn::{Linear, Weight};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::path::Path;
use std::sync::Arc;

/// One variant per model file, with the `model_type`s it reads.
macro_rules! registry {
    ($( $Variant:ident($Net:ty) = $model_types:expr ),* $(,)?) => {
        /// A built-in model of any supported `model_type` ([`model_types`]).
        pub enum AutoModelForCausalLM {
            $( $Variant($Net), )*
        }

        /// The config of an [`AutoModelForCausalLM`]: its model file's.
        #[derive(Debug, Clone, PartialEq)]
        // Built once per model: the variants' sizes do not matter.
        #[allow(clippy::large_enum_variant)]
        pub enum AutoConfig {
            $( $Variant(<$Net as CausalModel>::Config), )*
        }

        /// The sizes every transformers config names alike.
        impl AutoConfig {
            pub fn vocab_size(&self) -> usize {
                match self { $( AutoConfig::$Variant(c) => c.vocab_size, )* }
            }
            pub fn num_hidden_layers(&self) -> usize {
                match self { $( AutoConfig::$Variant(c) => c.num_hidden_layers, )* }
            }
        }

        /// Every `model_type` with a built-in model.
        pub fn model_types() -> Vec<&'static str> {
            [$( $model_types, )*].concat()
        }

        /// Delegates to the model inside.
        macro_rules! each {
            ($self:expr, $m:ident => $e:expr) => {
                match $self { $( AutoModelForCausalLM::$Variant($m) => $e, )* }
            };
        }

        impl CausalModel for AutoModelForCausalLM {
            type Config = AutoConfig;

            fn parse_config(text: &str, source: &str) -> Result<AutoConfig> {
                let model_type = model_type(text, source)?;
                $(
                    if $model_types.contains(&model_type.as_str()) {
                        return Ok(AutoConfig::$Variant(<$Net as CausalModel>::parse_config(text, source)?));
                    }
                )*
                Err(Error::Config {
                    file: source.into(),
                    key: "model_type".into(),
                    message: format!(
                        "'{model_type}' has no built-in model: supported are {} (or write \
                         your own model over CausalModel: docs/your-model.md)",
                        model_types().join(", ")
                    ),
                })
            }

            fn new(config: &AutoConfig, vb: VarBuilder) -> candle_core::Result<Self> {
                Ok(match config {
                    $( AutoConfig::$Variant(c) => AutoModelForCausalLM::$Variant(<$Net as CausalModel>::new(c, vb)?), )*
                })
            }

            fn embed(&self, input_ids: &Tensor, cx: &LayerInputs) -> candle_core::Result<Tensor> {
                each!(self, m => m.embed(input_ids, cx))
            }
            fn num_layers(&self) -> usize {
                each!(self, m => m.num_layers())
            }
            fn layer(&self, l: usize, x: &Tensor, cx: &LayerInputs) -> candle_core::Result<Tensor> {
                each!(self, m => m.layer(l, x, cx))
            }
            fn final_norm(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                each!(self, m => m.final_norm(x))
            }
            fn lm_head(&self) -> &Linear {
                each!(self, m => m.lm_head())
            }
            fn logit_softcap(&self) -> Option<f64> {
                each!(self, m => m.logit_softcap())
            }
            fn heads(&self) -> Option<(usize, usize)> {
                each!(self, m => m.heads())
            }
            fn supports_tiled_mlp(&self) -> bool {
                each!(self, m => m.supports_tiled_mlp())
            }
            fn may_skip_grad(&self, name: &str) -> bool {
                each!(self, m => m.may_skip_grad(name))
            }
        }

        impl Parallelize for AutoModelForCausalLM {
            fn parallelize(&mut self, name: &str, tp: &TpContext) -> Result<()> {
                each!(self, m => m.parallelize(name, tp))
            }
            fn visit_params(&self, name: &str, f: &mut ParamFn) {
                each!(self, m => m.visit_params(name, f))
            }
            fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> Result<()> {
                each!(self, m => m.visit_weights_mut(name, f))
            }
            fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> Result<()> {
                each!(self, m => m.visit_linears_mut(name, f))
            }
            fn visit_units(&self, name: &str, f: &mut dyn FnMut(&str)) {
                each!(self, m => m.visit_units(name, f))
            }
            fn shard_experts(&mut self, name: &str, ep: EpShard, f: &mut ExpertFn) -> Result<()> {
                each!(self, m => m.shard_experts(name, ep, f))
            }
        }
    };
}

registry! {
    Llama(llama::Llama) = llama::MODEL_TYPES,
    Gemma3(gemma3::Gemma3) = gemma3::MODEL_TYPES,
    Gemma4(gemma4::Gemma4) = gemma4::MODEL_TYPES,
    Olmo2(olmo2::Olmo2) = olmo2::MODEL_TYPES,
    Phi3(phi3::Phi3) = phi3::MODEL_TYPES,
    Qwen3Moe(qwen3_moe::Qwen3Moe) = qwen3_moe::MODEL_TYPES,
    Mixtral(mixtral::Mixtral) = mixtral::MODEL_TYPES,
    GptOss(gpt_oss::GptOss) = gpt_oss::MODEL_TYPES,
    Glm4Moe(glm4_moe::Glm4Moe) = glm4_moe::MODEL_TYPES,
    DeepseekV3(deepseek_v3::DeepseekV3) = deepseek_v3::MODEL_TYPES,
    Llama4(llama4::Llama4) = llama4::MODEL_TYPES,
    Mistral4(mistral4::Mistral4) = mistral4::MODEL_TYPES,
    Qwen3Next(qwen3_next::Qwen3Next) = qwen3_next::MODEL_TYPES,
}

/// `model_type` of a config.json's text, if it names one.
fn named_model_type(text: &str, source: &str) -> Result<Option<String>> {
    #[derive(serde::Deserialize)]
    struct Head {
        model_type: Option<String>,
    }
    let head: Head = serde_json::from_str(text).map_err(|e| {
        let at = format!("<line {} column {}>", e.line(), e.column());
        Error::config(source, at, format!("not a valid model config: {e}"))
    })?;
    Ok(head.model_type)
}

/// `model_type` of the config.json in model directory `dir`, if it names one (a user's
/// model may not).
pub fn config_model_type(dir: &Path) -> Result<Option<String>> {
    let (text, source) = read_config(dir)?;
    named_model_type(&text, &source)
}

/// `model_type` of a config.json's text.
fn model_type(text: &str, source: &str) -> Result<String> {
    named_model_type(text, source)?.ok_or_else(|| Error::Config {
        file: source.into(),
        key: "model_type".into(),
        message: format!(
            "missing: transformers' config.json names its model type (one of {})",
            model_types().join(", ")
        ),
    })
}

impl AutoModelForCausalLM {
    /// The model of the HF checkpoint in `dir` (config.json, and model.safetensors or a
    /// sharded index), in `dtype` on `device`: every tensor the model needs present with its
    /// shape, nothing unexpected.
    pub fn from_pretrained(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let (text, source) = read_config(dir)?;
        let config = Self::parse_config(&text, &source)?;
        let files = Arc::new(WeightFiles::open(dir)?);
        let vb = FilesBackend::var_builder(&files, dtype, device);
        let model = Self::new(&config, vb)?;
        let (shapes, aliases) = shapes_and_aliases(&model);
        files.check(&shapes, &aliases)?;
        Ok(model)
    }

    /// Applies a LoRA adapter that peft wrote (`PeftModel.save_pretrained`), or a LoRA run's
    /// checkpoint, to evaluate it: each adapted layer computes `x W^T + x A^T B^T * scale`,
    /// and the modules peft trained whole (`modules_to_save`) take their saved weights.
    /// To train it further, `parallel::Model::load_adapter`.
    pub fn load_adapter(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let Weight::Local(head) = &self.lm_head().weight else {
            return Err(Error::Parallelism(
                "load_adapter: the model is sharded".into(),
            ));
        };
        let (dtype, device) = (head.dtype(), head.device().clone());
        let sites = super::peft::lora_sites(self)?.1;
        let (config, tensors) = super::peft::read(dir, dtype, &device, &sites)?;
        let source = dir.join(super::peft::ADAPTER_WEIGHTS).display().to_string();
        super::peft::add_adapters(self, &config)?;
        super::peft::set_trainable(self, &tensors, &|_, t| Ok(t.clone()), &source)
    }

    /// Logits [batch, seq, vocab] for `input_ids` [batch, seq] (u32) at `position_ids`
    /// [batch, seq] (i64; positions restarting inside a row start a new document, which
    /// does not see the ones before it).
    pub fn forward(&self, input_ids: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
        super::generate::logits(self, (input_ids, position_ids), None, false)
    }

    /// transformers' `model.generate(input_ids, attention_mask=..., generation_config=cfg)`:
    /// tokens [batch, prompt + new] (u32) continuing `input_ids` [batch, prompt] (u32,
    /// left-padded; `attention_mask` 0 on the pads), with a KV cache.
    pub fn generate(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        cfg: &crate::generation::GenerationConfig,
    ) -> Result<Tensor> {
        crate::generation::generate(self, input_ids, attention_mask, cfg)
    }
}
