//! LoRA, as peft's `LoraLayer` computes it: `y = x W^T + b + dropout(x) A^T B^T * scale`, with
//! `A` [r, in] and `B` [out, r] trained and the base `W`, `b` frozen. The adapter path runs
//! beside the base GEMM (two thin matmuls through rank r); no merged weight is built.
//!
//! DoRA (`use_dora`) adds a trained magnitude `m` [out], as peft's DoraLinearLayer: with
//! `g = m / ||W + scale B A||` (each output row's norm, detached, as the paper's section 4.3
//! and peft do), `y = g (x W^T + x A^T B^T * scale) + b` without dropout, and with it
//! `y = x W^T + b + (g - 1) d W^T + g d A^T B^T * scale` for `d = dropout(x)`.
//!
//! What is adapted is chosen as peft chooses it ([`LoraConfig::targets`]); the layer side is
//! [`crate::nn::Linear`] holding a [`Lora`]. Names follow peft: the adapter of
//! `model.layers.0.self_attn.q_proj` is `model.layers.0.self_attn.q_proj.lora_A.weight` and
//! `...lora_B.weight` (peft's files prefix them with `base_model.model.`).

use super::chain::adapter_product;
use crate::kernels::fused::{splitmix, GOLDEN};
use crate::kernels::grouped::ExpertLayout;
use candle_core::{DType, Device, Result, Tensor};

/// Which linear layers get adapters (peft's `target_modules`).
#[derive(Debug, Clone, PartialEq)]
pub enum Targets {
    /// Every linear layer but the output layer (peft's `all-linear`).
    AllLinear,
    /// Layers whose name is one of these or ends with `.` and one of these (peft's list
    /// matching: `q_proj` matches `model.layers.0.self_attn.q_proj`).
    Names(Vec<String>),
}

/// As peft and TRL spell it: `all-linear`, or the names.
impl std::fmt::Display for Targets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Targets::AllLinear => write!(f, "all-linear"),
            Targets::Names(names) => write!(f, "{}", names.join(" ")),
        }
    }
}

/// TRL's ModelConfig LoRA keys, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Targets,
    /// Layers trained whole beside the adapters (peft's `modules_to_save`), by name suffix.
    pub modules_to_save: Vec<String>,
    /// Scale by alpha / sqrt(r) instead of alpha / r (rank-stabilised LoRA).
    pub rslora: bool,
    /// Seeds `A`'s initialisation (per layer, from its name: the same on every rank).
    pub seed: u64,
    /// Weight-decomposed LoRA: a trained magnitude per output feature (see the module docs).
    pub dora: bool,
    /// Parameters adapted directly (peft's `target_parameters`): names or name suffixes of 2-D
    /// and 3-D parameters that are not linear layers (gpt-oss's fused experts,
    /// `mlp.experts.gate_up_proj`; its router, `mlp.router.weight`).
    pub target_parameters: Vec<String>,
    /// peft's `ensure_weight_tying`: on a model whose LM head is tied to its embedding, the
    /// tied pair trains as one tensor (a module trained whole is one copy for both). Off, as
    /// peft's default: each module named in `modules_to_save` gets its own copy, the pair
    /// parts.
    pub ensure_weight_tying: bool,
    /// peft's `trainable_token_indices`: rows of an embedding table (by module name suffix,
    /// `embed_tokens` for a plain list) trained whole, the rest frozen; a head tied to that
    /// table trains the same rows (peft ties them).
    pub trainable_token_indices: Vec<(String, Vec<u32>)>,
    /// peft's `task_type` SEQ_CLS: the model is a sequence classifier (a reward model), whose
    /// `score` head is the output layer all-linear leaves out; peft trains it whole (it adds
    /// `score` to `modules_to_save`). False: CAUSAL_LM.
    pub sequence_classification: bool,
}

impl LoraConfig {
    /// Rank `r`, `alpha`, `dropout` on the `targets`, peft's defaults for the rest (no
    /// modules trained whole, plain scaling, no DoRA, no parameters adapted directly).
    pub fn new(r: usize, alpha: f64, dropout: f64, targets: Targets) -> Self {
        LoraConfig {
            r,
            alpha,
            dropout,
            targets,
            modules_to_save: Vec::new(),
            rslora: false,
            seed: 0,
            dora: false,
            target_parameters: Vec::new(),
            ensure_weight_tying: false,
            trainable_token_indices: Vec::new(),
            sequence_classification: false,
        }
    }

    /// peft's `scaling`.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Whether the linear layer `name` gets an adapter (`output_layer`: the LM head, which
    /// `all-linear` leaves out as peft does).
    pub fn targets(&self, name: &str, output_layer: bool) -> bool {
        match &self.targets {
            Targets::AllLinear => !output_layer,
            Targets::Names(names) => names.iter().any(|t| suffix_match(name, t)),
        }
    }

    /// Whether the parameter `name` (held as a tensor, not a layer) gets an adapter: peft's
    /// `target_parameters` matching, by name or name suffix.
    pub fn targets_parameter(&self, name: &str) -> bool {
        self.target_parameters.iter().any(|t| suffix_match(name, t))
    }

    /// Whether parameter `name` belongs to a module trained whole (`modules_to_save`).
    pub fn saves(&self, param: &str) -> bool {
        let module = param.rsplit_once('.').map_or(param, |(m, _)| m);
        self.modules_to_save.iter().any(|t| suffix_match(module, t))
    }

    /// peft's default targets for a model type when none are given
    /// (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
    pub fn default_targets(model_type: &str) -> Vec<String> {
        let names: &[&str] = match model_type {
            "phi3" => &["qkv_proj"],
            _ => &["q_proj", "v_proj"],
        };
        names.iter().map(|s| s.to_string()).collect()
    }
}

/// An expert's projections by transformers 4's names, [Qwen3-MoE's, Mixtral's]: what
/// transformers 5 fuses over all experts (gate and up into one `gate_up_proj`, down into
/// `down_proj`) and peft maps its targets onto.
pub const EXPERT_GATE: [&str; 2] = ["gate_proj", "w1"];
pub const EXPERT_UP: [&str; 2] = ["up_proj", "w3"];
pub const EXPERT_DOWN: [&str; 2] = ["down_proj", "w2"];

/// One adapted layer, as peft adapts it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedAdapter {
    pub name: String,
    /// Its rank and alpha (an expert's gate and up projections: 2r and 2 x alpha).
    pub config: LoraConfig,
    /// The layer whose `A` it uses: an expert's up projection shares its gate's.
    pub shares_a: Option<String>,
    /// A parameter adapted directly (`target_parameters`), not a linear layer.
    pub parameter: bool,
}

/// The adapters of a model ([`adapter_plan`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterPlan {
    pub layers: Vec<PlannedAdapter>,
    /// Targeted layers that get no adapter: dense MLP projections beside experts.
    pub left_out: Vec<String>,
}

/// Whether the parameter `name` (a full HF name) belongs to a mixture of experts' routed
/// experts (`...mlp.experts.{e}.*`, or the fused `...mlp.experts.gate_up_proj`): the
/// transformers naming every built-in MoE and peft follow (adapters here, the routing's
/// unused-parameter check and the estimate's active parameters elsewhere).
pub fn is_routed_expert(name: &str) -> bool {
    name.contains(".experts.")
}

/// Which of `linears` (every linear layer's name, in the model's order) get adapters, and of
/// what rank, as peft (0.17+) adapts a transformers 5 model:
/// - those `config.targets` names; never the output layer (all-linear leaves it out; naming
///   it is an error);
/// - in a model with experts, transformers 5 holds each layer's experts as fused 3-D
///   parameters and peft adapts them with `target_parameters`: each expert's gate and up
///   projections share one `A` of rank 2r (peft's `rank_pattern` and `alpha_pattern` for
///   `gate_up_proj`: 2r and 2 x alpha) with a `B` each, its down projection has rank r. peft
///   maps every gate_proj / up_proj / down_proj (w1 / w3 / w2) target onto the experts, so
///   the same projections of a dense MLP beside them get none (`left_out`), and it adapts
///   parameters without dropout or DoRA, so neither is accepted on experts or router;
/// - of `parameters` (2-D and 3-D parameters held as tensors, not layers: gpt-oss's fused
///   experts and router), those `config.target_parameters` names, at rank r per expert
///   (peft's ParamWrapper); a name that matches none is an error listing them.
pub fn adapter_plan(
    config: &LoraConfig,
    linears: &[String],
    parameters: &[String],
) -> crate::error::Result<AdapterPlan> {
    let fail = |key: &str, message: String| {
        Err(crate::error::Error::config(
            "training arguments",
            key,
            message,
        ))
    };
    let leaf = |n: &str| n.rsplit('.').next().unwrap_or(n).to_string();
    let has_experts = linears.iter().any(|n| is_routed_expert(n));
    let (mut layers, mut left_out) = (Vec::new(), Vec::new());
    let mut gates: std::collections::HashMap<String, String> = Default::default();
    for name in linears {
        let output = name == "lm_head"
            || name.ends_with(".lm_head")
            || (config.sequence_classification && name == "score");
        if !config.targets(name, output) {
            continue;
        }
        let l = leaf(name);
        let projection = [EXPERT_GATE, EXPERT_UP, EXPERT_DOWN]
            .iter()
            .any(|names| names.contains(&l.as_str()));
        if has_experts && !is_routed_expert(name) && projection {
            left_out.push(name.clone());
            continue;
        }
        let mut c = config.clone();
        let mut shares_a = None;
        // The experts and the router are parameters peft adapts directly.
        if is_routed_expert(name) || (has_experts && l == "gate") {
            if config.dropout > 0.0 {
                return fail("lora_dropout", format!("{}: {name} is a mixture-of-experts parameter, which peft adapts without dropout (it refuses lora_dropout != 0 there too): set lora_dropout 0 or leave the experts and router out of lora_target_modules", config.dropout));
            }
            if config.dora {
                return fail("use_dora", format!("{name} is a mixture-of-experts parameter, which peft adapts without DoRA (it refuses use_dora there too): drop use_dora or leave the experts and router out of lora_target_modules"));
            }
        }
        if let Some((g, u)) = EXPERT_GATE
            .iter()
            .zip(&EXPERT_UP)
            .find(|(g, u)| is_routed_expert(name) && (l == **g || l == **u))
        {
            let (prefix, _) = name.rsplit_once('.').expect("an expert's projection");
            let other = if l == *g { u } else { g };
            if !config.targets(&format!("{prefix}.{other}"), false) {
                return fail("lora_target_modules", format!("the experts' {l} without their {other}: transformers 5 fuses the two into gate_up_proj, which peft adapts whole: target both"));
            }
            c.r = 2 * config.r;
            c.alpha = 2.0 * config.alpha;
            match gates.get(prefix) {
                Some(first) => shares_a = Some(first.clone()),
                None => {
                    gates.insert(prefix.to_string(), name.clone());
                }
            }
        }
        layers.push(PlannedAdapter {
            name: name.clone(),
            config: c,
            shares_a,
            parameter: false,
        });
    }
    for target in &config.target_parameters {
        let matched: Vec<&String> = parameters
            .iter()
            .filter(|p| suffix_match(p, target))
            .collect();
        if matched.is_empty() {
            // One name per kind of parameter: without the layer index.
            let mut kinds: Vec<String> = parameters
                .iter()
                .map(|p| match p.split_once(".layers.") {
                    Some((_, rest)) => rest.split_once('.').map_or(rest, |(_, r)| r).to_string(),
                    None => p.clone(),
                })
                .collect();
            kinds.sort();
            kinds.dedup();
            let have = match kinds.is_empty() {
                true => "this model holds none. Its experts, if any, are linear layers here: \
                         lora_target_modules adapts them where peft maps gate_proj / up_proj \
                         / down_proj onto transformers 5's fused experts (Qwen3-MoE, Mixtral, \
                         Qwen3-Next); peft maps none for Qwen3.5-MoE, whose experts and router \
                         are not adapted here (peft's all-linear leaves them out too)"
                    .to_string(),
                false => format!("this model's are {}", kinds.join(", ")),
            };
            return fail(
                "lora_target_parameters",
                format!("'{target}' matches no 2-D or 3-D parameter held outside a linear layer; {have}"),
            );
        }
    }
    for name in parameters.iter().filter(|p| config.targets_parameter(p)) {
        if config.dropout > 0.0 {
            return fail("lora_dropout", format!("{}: {name} is adapted as a parameter (lora_target_parameters), which peft does without dropout (it refuses lora_dropout != 0 there): set lora_dropout 0", config.dropout));
        }
        if config.dora {
            return fail("use_dora", format!("{name} is adapted as a parameter (lora_target_parameters), which peft does without DoRA (it refuses use_dora there): drop use_dora"));
        }
        layers.push(PlannedAdapter {
            name: name.clone(),
            config: config.clone(),
            shares_a: None,
            parameter: true,
        });
    }
    // An embedding named as a target (or trained tokens) is adapted beside the linear layers
    // (models::peft::add_adapters).
    let tables = !config.trainable_token_indices.is_empty()
        || matches!(&config.targets, Targets::Names(names)
            if names.iter().any(|n| n.rsplit('.').next() == Some("embed_tokens")));
    if layers.is_empty() && !tables {
        let mut leaves: Vec<String> = linears.iter().map(|n| leaf(n)).collect();
        leaves.sort();
        leaves.dedup();
        return fail(
            "lora_target_modules",
            format!(
                "'{}' matches no linear layer of this model that takes an adapter; its linear layers are {}",
                match &config.targets {
                    Targets::AllLinear => "all-linear".to_string(),
                    Targets::Names(names) => names.join(" "),
                },
                leaves.join(", ")
            ),
        );
    }
    Ok(AdapterPlan { layers, left_out })
}

fn suffix_match(name: &str, target: &str) -> bool {
    name == target
        || name
            .strip_suffix(target)
            .is_some_and(|rest| rest.ends_with('.'))
}

/// A layer's adapter: `A` [r, in], `B` [out, r] (this rank's slices under tensor
/// parallelism), trainable variables; with DoRA, the magnitude [out] too.
#[derive(Clone, Debug)]
pub struct Lora {
    pub a: Tensor,
    pub b: Tensor,
    /// DoRA's magnitude (this rank's output features), set by the layer from its weight.
    pub magnitude: Option<Tensor>,
    pub scale: f64,
    pub dropout: f64,
}

impl Lora {
    /// peft's initialisation at full size: `A` Kaiming-uniform (a = sqrt(5), bound
    /// 1/sqrt(in)), `B` zeros, so the adapted layer starts equal to the base. `A` is drawn
    /// from `seed` and `name`, identically on every rank.
    pub fn init(
        name: &str,
        (out_features, in_features): (usize, usize),
        config: &LoraConfig,
        (dtype, device): (DType, &Device),
    ) -> Result<Self> {
        let bound = 1.0 / (in_features as f64).sqrt();
        let mut state = config.seed ^ fnv(name);
        let a: Vec<f32> = (0..config.r * in_features)
            .map(|_| ((uniform(&mut state) * 2.0 - 1.0) * bound) as f32)
            .collect();
        let a = Tensor::from_vec(a, (config.r, in_features), device)?.to_dtype(dtype)?;
        let b = Tensor::zeros((out_features, config.r), dtype, device)?;
        Ok(Lora {
            a,
            b,
            magnitude: None,
            scale: config.scale(),
            dropout: config.dropout,
        })
    }

    /// A 3-D parameter's adapter (`experts` stacked, as peft's ParamWrapper holds them: `A`
    /// [experts x r, in], rows expert-major; `B` [out, r x experts], column `k x experts + e`
    /// expert e's k-th) as one pair per expert: [experts, in, r] and [experts, r, out].
    pub fn expert_stacks(&self, experts: usize) -> Result<(Tensor, Tensor)> {
        let (rows, inp) = self.a.dims2()?;
        let (out, cols) = self.b.dims2()?;
        let a = self.a.reshape((experts, rows / experts, inp))?;
        let b = self.b.reshape((out, cols / experts, experts))?;
        Ok((
            a.transpose(1, 2)?.contiguous()?,
            b.permute((2, 1, 0))?.contiguous()?,
        ))
    }

    /// The change the adapter makes to the weight it adapts, of shape `dims`: `scale B A`
    /// for a 2-D [out, in] weight, per expert for a 3-D one that peft reads as `layout` says
    /// (peft's ParamWrapper: [experts, out, in], or [experts, in, out] when transposed).
    pub fn weight_delta(&self, dims: &[usize], layout: ExpertLayout) -> Result<Tensor> {
        let delta = match *dims {
            [experts, _, _] => {
                let (a, b) = self.expert_stacks(experts)?;
                let in_out = a.matmul(&b)?;
                match layout {
                    ExpertLayout::InOut => in_out,
                    ExpertLayout::OutIn => in_out.transpose(1, 2)?,
                }
            }
            _ => self.b.matmul(&self.a)?,
        };
        (delta * self.scale)?.reshape(dims)
    }

    /// `dropout(x) A^T B^T * scale` for `x` [..., in] (`x` as the base layer sees it).
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
        self.path(&self.dropped(x)?)
    }

    /// The adapter cut at its rank: `dropout(x) A^T * scale` [..., r] and `B` in `x`'s
    /// dtype, whose product is [`Lora::delta`] (a chained layer runs it inside its op).
    pub fn halves(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        self.halves_of(&self.dropped(x)?)
    }

    /// `x A^T B^T * scale` (no dropout: `x` is already what the adapter sees).
    pub fn path(&self, x: &Tensor) -> Result<Tensor> {
        let (h, b) = self.halves_of(x)?;
        let mut dims = h.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = b.dim(0)?;
        adapter_product(&h, &b)?.reshape(dims)
    }

    /// `x A^T * scale` [..., r] (the scale on the r-wide side: a pass over it rather than
    /// over the output, and its gradient in backward) and `B` in `x`'s dtype.
    fn halves_of(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let h = (self.down(x)? * self.scale)?;
        Ok((h, self.b.to_dtype(x.dtype())?))
    }

    /// The adapter's input: `x` through this layer's dropout (drawing its mask).
    pub fn dropped(&self, x: &Tensor) -> Result<Tensor> {
        dropout(x, self.dropout)
    }

    /// Whether a forward now applies dropout (a training forward with p > 0).
    pub fn dropout_active(&self) -> bool {
        self.dropout > 0.0 && DROPOUT_KEY.with(|k| k.get()).is_some()
    }

    /// Each output row's squared norm of `w + scale B A` (`w` [out, in], this rank's block),
    /// in f32 and detached: DoRA's weight norm before any tensor-parallel sum.
    pub fn weight_norm_sq(&self, w: &Tensor) -> Result<Tensor> {
        let ba = self
            .b
            .detach()
            .to_dtype(DType::F32)?
            .matmul(&self.a.detach().to_dtype(DType::F32)?)?;
        let merged = (w.detach().to_dtype(DType::F32)? + (ba * self.scale)?)?;
        merged.sqr()?.sum(1)
    }

    /// `x A^T`: [..., r].
    fn down(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let inner = dims[dims.len() - 1];
        let rows = x.elem_count() / inner;
        let h = x
            .reshape((rows, inner))?
            .matmul(&self.a.to_dtype(x.dtype())?.t()?)?;
        let mut out = dims;
        *out.last_mut().expect("rank >= 1") = self.a.dim(0)?;
        h.reshape(out)
    }
}

thread_local! {
    /// Set while a training forward runs (dropout is on); its value keys the masks.
    static DROPOUT_KEY: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
    /// Calls within the current key, so that each layer draws its own mask.
    static DROPOUT_CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Runs `f` as a training forward with dropout masks drawn from `key` (a micro-batch's
/// identity). A layer recomputed in backward (activation checkpointing) runs again under the
/// same key with [`recompute_dropout`] and draws the same mask.
pub fn with_dropout<T>(key: u64, f: impl FnOnce() -> T) -> T {
    let before = DROPOUT_KEY.with(|k| k.replace(Some(key)));
    let calls = DROPOUT_CALLS.with(|c| c.replace(0));
    let out = f();
    DROPOUT_KEY.with(|k| k.set(before));
    DROPOUT_CALLS.with(|c| c.set(calls));
    out
}

/// The dropout key and how many masks were drawn under it.
pub type DropoutState = (Option<u64>, u64);

/// The dropout state at this point of a forward, to replay a stretch of it (a checkpointed
/// layer's recomputation) with [`recompute_dropout`].
pub fn dropout_state() -> DropoutState {
    (
        DROPOUT_KEY.with(|k| k.get()),
        DROPOUT_CALLS.with(|c| c.get()),
    )
}

/// Runs `f` from a state [`dropout_state`] returned (the same masks as then).
pub fn recompute_dropout<T>(state: DropoutState, f: impl FnOnce() -> T) -> T {
    let before = (
        DROPOUT_KEY.with(|k| k.replace(state.0)),
        DROPOUT_CALLS.with(|c| c.replace(state.1)),
    );
    let out = f();
    DROPOUT_KEY.with(|k| k.set(before.0));
    DROPOUT_CALLS.with(|c| c.set(before.1));
    out
}

/// Inverted dropout with probability `p` during a training forward; the identity otherwise
/// (evaluation, generation). The mask is a function of the key, the call's order and the
/// element (`kernels::fused::dropout`), so a replayed forward draws the same one.
fn dropout(x: &Tensor, p: f64) -> Result<Tensor> {
    let Some(key) = DROPOUT_KEY.with(|k| k.get()).filter(|_| p > 0.0) else {
        return Ok(x.clone());
    };
    let call = DROPOUT_CALLS.with(|c| {
        let n = c.get();
        c.set(n + 1);
        n
    });
    crate::kernels::fused::dropout(x, key ^ call.wrapping_mul(GOLDEN), p)
}

/// splitmix64's next value as a uniform in [0, 1).
pub(crate) fn uniform(state: &mut u64) -> f64 {
    *state = state.wrapping_add(GOLDEN);
    (splitmix(*state) >> 11) as f64 / (1u64 << 53) as f64
}

/// FNV-1a of a name: a stable per-layer seed.
pub(crate) fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(targets: Targets) -> LoraConfig {
        LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets,
            modules_to_save: vec!["lm_head".into()],
            rslora: false,
            seed: 1,
            dora: false,
            target_parameters: Vec::new(),
            ensure_weight_tying: false,
            trainable_token_indices: Vec::new(),
            sequence_classification: false,
        }
    }

    #[test]
    fn targets_match_as_peft_matches_them() {
        let c = config(Targets::Names(vec!["q_proj".into(), "v_proj".into()]));
        assert!(c.targets("model.layers.0.self_attn.q_proj", false));
        assert!(!c.targets("model.layers.0.self_attn.qq_proj", false));
        assert!(!c.targets("model.layers.0.mlp.up_proj", false));
        let all = config(Targets::AllLinear);
        assert!(all.targets("model.layers.0.mlp.up_proj", false));
        assert!(!all.targets("lm_head", true));
        assert!(c.saves("lm_head.weight") && !c.saves("model.norm.weight"));
        assert_eq!(c.scale(), 2.0);
        assert_eq!(LoraConfig { rslora: true, ..c }.scale(), 4.0);
    }

    #[test]
    fn a_starts_in_peft_bounds_and_b_at_zero() {
        let c = config(Targets::AllLinear);
        let l = Lora::init("x.q_proj", (6, 16), &c, (DType::F32, &Device::Cpu)).unwrap();
        let a = l.a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(a.iter().all(|v| v.abs() <= 0.25) && a.iter().any(|v| v.abs() > 0.1));
        let again = Lora::init("x.q_proj", (6, 16), &c, (DType::F32, &Device::Cpu)).unwrap();
        assert_eq!(a, again.a.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let b =
            l.b.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
        assert_eq!(b, 0.0);
    }

    #[test]
    fn dropout_masks_replay_and_scale() {
        let x = Tensor::ones((64, 32), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            dropout(&x, 0.5).unwrap().to_vec2::<f32>().unwrap()[0][0],
            1.0
        );
        let (a, state) = with_dropout(3, || {
            let s = dropout_state();
            (dropout(&x, 0.5).unwrap(), s)
        });
        let b = with_dropout(3, || recompute_dropout(state, || dropout(&x, 0.5).unwrap()));
        let (a, b) = (a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        assert_eq!(a, b);
        let kept = a.iter().flatten().filter(|v| **v == 2.0).count();
        assert!((900..1150).contains(&kept), "{kept} of 2048 kept");
    }

    /// peft's plan for a model with experts beside a dense MLP: experts' gate and up at rank
    /// 2r sharing the gate's A, the down at r, the router adapted, the dense MLP left out; what
    /// peft refuses on experts is refused with its key.
    #[test]
    fn experts_are_adapted_as_peft_adapts_fused_experts() {
        let names: Vec<String> = [
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.mlp.gate",
            "model.layers.0.mlp.experts.0.gate_proj",
            "model.layers.0.mlp.experts.0.up_proj",
            "model.layers.0.mlp.experts.0.down_proj",
            "model.layers.1.mlp.gate_proj",
            "model.layers.1.mlp.up_proj",
            "lm_head",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let config = LoraConfig::new(4, 8.0, 0.0, Targets::AllLinear);
        let plan = adapter_plan(&config, &names, &[]).unwrap();
        let got: Vec<(&str, usize, Option<&str>)> = plan
            .layers
            .iter()
            .map(|p| {
                (
                    p.name.rsplit('.').next().unwrap(),
                    p.config.r,
                    p.shares_a.as_deref(),
                )
            })
            .collect();
        let gate = "model.layers.0.mlp.experts.0.gate_proj";
        assert_eq!(
            got,
            [
                ("q_proj", 4, None),
                ("gate", 4, None),
                ("gate_proj", 8, None),
                ("up_proj", 8, Some(gate)),
                ("down_proj", 4, None),
            ]
        );
        assert_eq!(plan.left_out, names[5..7]);
        let refused = |c: LoraConfig| adapter_plan(&c, &names, &[]).unwrap_err().to_string();
        let dropout = refused(LoraConfig {
            dropout: 0.05,
            ..config.clone()
        });
        assert!(dropout.contains("lora_dropout"), "{dropout}");
        let dora = refused(LoraConfig {
            dora: true,
            ..config.clone()
        });
        assert!(dora.contains("use_dora"), "{dora}");
        let half = refused(LoraConfig {
            targets: Targets::Names(vec!["gate_proj".into()]),
            ..config.clone()
        });
        assert!(
            half.contains("lora_target_modules") && half.contains("up_proj"),
            "{half}"
        );
    }
}
