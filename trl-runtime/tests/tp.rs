//! Tensor parallelism by annotation: a small decoder written the plain Candle way (VarBuilder
//! constructors, `Module::forward`), annotated with #[derive(Parallelize)], trains at tp = 2
//! and tp = 4 exactly as at tp = 1 (fp32, CPU): logits, loss, every gradient and the weights
//! after three AdamW steps within 1e-5 relative.

mod common;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use common::{max_abs, max_abs_diff, rel_diff};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use trl_runtime::comm::{Communicator, InProcessWorld};
use trl_runtime::nn::{embedding, linear, linear_no_bias, rms_norm, Embedding, Linear, RmsNorm};
use trl_runtime::tp::{self, vocab_parallel_cross_entropy, Split, TpContext, TpStyle};
use trl_runtime::Parallelize;

const VOCAB: usize = 32;
const HIDDEN: usize = 16;
const HEADS: usize = 4;
const FFN: usize = 24;
const LAYERS: usize = 2;
const STEPS: usize = 3;
const TOL: f64 = 1e-5;

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "column")]
    gate_proj: Linear,
    #[parallel(tp = "column")]
    up_proj: Linear,
    #[parallel(tp = "row")]
    down_proj: Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = (self.gate_proj.forward(x)?.silu()? * self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }
}

#[derive(Parallelize)]
#[parallel(fsdp_unit)]
struct Block {
    input_layernorm: RmsNorm,
    #[parallel(tp = "column", name = "self_attn.q_proj")]
    q_proj: Linear,
    #[parallel(tp = "column", name = "self_attn.k_proj")]
    k_proj: Linear,
    #[parallel(tp = "column", name = "self_attn.v_proj")]
    v_proj: Linear,
    #[parallel(tp = "row", name = "self_attn.o_proj")]
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    #[parallel(tp = "divide")]
    num_heads: usize,
    #[parallel(skip)]
    head_dim: usize,
}

impl Block {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let attn = vb.pp("self_attn");
        let mlp = vb.pp("mlp");
        Ok(Block {
            input_layernorm: rms_norm(HIDDEN, 1e-6, vb.pp("input_layernorm"))?,
            q_proj: linear(HIDDEN, HIDDEN, attn.pp("q_proj"))?,
            // No key bias: its gradient is zero up to rounding (softmax ignores a shift shared
            // by a row's scores), and Adam would turn that noise into updates of size lr.
            k_proj: linear_no_bias(HIDDEN, HIDDEN, attn.pp("k_proj"))?,
            v_proj: linear(HIDDEN, HIDDEN, attn.pp("v_proj"))?,
            // A row-parallel bias is added once, after the sum over ranks.
            o_proj: linear(HIDDEN, HIDDEN, attn.pp("o_proj"))?,
            post_attention_layernorm: rms_norm(HIDDEN, 1e-6, vb.pp("post_attention_layernorm"))?,
            mlp: Mlp {
                gate_proj: linear_no_bias(HIDDEN, FFN, mlp.pp("gate_proj"))?,
                up_proj: linear_no_bias(HIDDEN, FFN, mlp.pp("up_proj"))?,
                down_proj: linear_no_bias(FFN, HIDDEN, mlp.pp("down_proj"))?,
            },
            num_heads: HEADS,
            head_dim: HIDDEN / HEADS,
        })
    }

    /// Plain causal self-attention and MLP, written against the per-rank head count.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let h = self.input_layernorm.forward(x)?;
        let heads = |t: Tensor| -> candle_core::Result<Tensor> {
            t.reshape((b, s, self.num_heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = heads(self.q_proj.forward(&h)?)?;
        let k = heads(self.k_proj.forward(&h)?)?;
        let v = heads(self.v_proj.forward(&h)?)?;
        let scores = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?.broadcast_add(mask)?;
        let max = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let a = p
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, s, self.num_heads * self.head_dim))?;
        let x = (x + self.o_proj.forward(&a)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        x + self.mlp.forward(&h)?
    }
}

#[derive(Parallelize)]
struct TinyLm {
    #[parallel(tp = "vocab", name = "model.embed_tokens")]
    embed_tokens: Embedding,
    #[parallel(name = "model.layers", fsdp_unit)]
    layers: Vec<Block>,
    #[parallel(name = "model.norm")]
    norm: RmsNorm,
    #[parallel(tp = "vocab")]
    lm_head: Linear,
}

impl TinyLm {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let m = vb.pp("model");
        Ok(TinyLm {
            embed_tokens: embedding(VOCAB, HIDDEN, m.pp("embed_tokens"))?,
            layers: (0..LAYERS)
                .map(|l| Block::new(m.pp(format!("layers.{l}"))))
                .collect::<candle_core::Result<_>>()?,
            norm: rms_norm(HIDDEN, 1e-6, m.pp("norm"))?,
            lm_head: linear_no_bias(HIDDEN, VOCAB, vb.pp("lm_head"))?,
        })
    }

    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let s = ids.dim(1)?;
        let mask: Vec<f32> = (0..s * s)
            .map(|i| {
                if i % s > i / s {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (s, s), ids.device())?;
        let mut x = self.embed_tokens.forward(ids)?;
        for layer in &self.layers {
            x = layer.forward(&x, &mask)?;
        }
        self.lm_head.forward(&self.norm.forward(&x)?)
    }
}

/// Random values for every variable, shared by all ranks (names as the VarBuilder paths).
fn reference_values() -> HashMap<String, Tensor> {
    use rand::SeedableRng;
    use rand_distr::{Distribution, Normal};
    let vm = VarMap::new();
    let _ = TinyLm::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    // Fixed values, so that a failure reproduces: Adam turns the rounding noise of tiny
    // gradients into updates, and only some draws make that visible at 1e-5.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let normal = Normal::new(0f32, 1.0).unwrap();
    names
        .into_iter()
        .map(|n| {
            let shape = data[n].shape().clone();
            let fan_in = *shape.dims().last().unwrap() as f32;
            // Norms near 1 and biases near 0 (perturbed so they are really tested), matrices
            // as Candle initialises them.
            let (mean, std) = if n.ends_with("norm.weight") {
                (1.0, 0.1)
            } else if n.ends_with("bias") {
                (0.0, 0.1)
            } else {
                (0.0, 1.0 / fan_in.sqrt())
            };
            let values: Vec<f32> = (0..shape.elem_count())
                .map(|_| mean + std * normal.sample(&mut rng))
                .collect();
            (
                n.clone(),
                Tensor::from_vec(values, shape, &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn build(values: &HashMap<String, Tensor>) -> TinyLm {
    let vm = VarMap::new();
    let model = TinyLm::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
    for (n, v) in vm.data().lock().unwrap().iter() {
        v.set(&values[n]).unwrap();
    }
    model
}

struct Run {
    /// Full logits of the first step (gathered over the vocabulary).
    logits: Tensor,
    losses: Vec<f64>,
    /// Each step's summed entropy and top-1 count (TRL's entropy and mean_token_accuracy).
    stats: Vec<Vec<f32>>,
    /// First-step gradient and final weight per parameter, as this rank holds them.
    grads: BTreeMap<String, Tensor>,
    weights: BTreeMap<String, Tensor>,
    splits: BTreeMap<String, Split>,
}

fn train(comm: Arc<dyn Communicator>, values: &HashMap<String, Tensor>) -> Run {
    let mut model = build(values);
    let ctx = TpContext::new(comm.clone());
    tp::parallelize(&mut model, &ctx).unwrap();
    let params = tp::named_parameters(&model).unwrap();
    let mut splits = BTreeMap::new();
    model.visit_params("", &mut |n, _, s| {
        splits.insert(n.to_string(), s);
    });
    let vars: Vec<_> = params.iter().map(|(_, v)| v.clone()).collect();
    // Adam scales every update to about lr, also for entries whose gradient is rounding
    // noise; a small lr keeps that noise (different split orders round differently) below 1e-5.
    let mut opt = candle_nn::AdamW::new_lr(vars, 1e-3).unwrap();
    let ids = Tensor::new(
        &[[3u32, 17, 5, 9, 30, 2, 11, 7], [1, 4, 29, 8, 8, 13, 21, 0]],
        &Device::Cpu,
    )
    .unwrap();
    let labels = ids.narrow(1, 1, 7).unwrap().to_dtype(DType::I64).unwrap();
    let (mut logits0, mut grads, mut losses) = (None, BTreeMap::new(), Vec::new());
    let mut stats = Vec::new();
    for step in 0..STEPS {
        let logits = model.forward(&ids).unwrap();
        let loss =
            vocab_parallel_cross_entropy(&logits.narrow(1, 0, 7).unwrap(), &labels, &comm).unwrap();
        stats.push(loss.stats.to_vec1::<f32>().unwrap());
        let mean = (loss.sum / loss.count as f64).unwrap();
        losses.push(mean.to_scalar::<f32>().unwrap() as f64);
        let g = mean.backward().unwrap();
        if step == 0 {
            logits0 = Some(comm.all_gather(&logits, 2).unwrap());
            for (n, v) in params.iter() {
                grads.insert(n.clone(), g.get(v.as_tensor()).unwrap().clone());
            }
        }
        opt.step(&g).unwrap();
    }
    let weights = params
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect();
    Run {
        logits: logits0.unwrap(),
        losses,
        stats,
        grads,
        weights,
        splits,
    }
}

/// This rank's slice of a full tensor under `split` (of each section of a fused weight).
fn slice(full: &Tensor, split: Split, rank: usize, tp: usize) -> Tensor {
    split.part("test", full, rank, tp).unwrap()
}

#[test]
fn tp_2_and_4_train_like_tp_1() {
    let values = reference_values();
    let reference = InProcessWorld::run(1, |_, c| train(c, &values)).remove(0);
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0],
        "training lowers the loss"
    );
    for tp in [2, 4] {
        let runs = InProcessWorld::run(tp, |_, c| train(c, &values));
        for (rank, run) in runs.iter().enumerate() {
            let d = rel_diff(&run.logits, &reference.logits);
            assert!(d < TOL, "tp={tp} rank {rank}: logits differ by {d:e}");
            for (a, b) in run.losses.iter().zip(&reference.losses) {
                assert!((a - b).abs() / b.abs() < TOL, "tp={tp}: loss {a} vs {b}");
            }
            // The vocab-parallel entropy and top-1 count equal the whole vocabulary's.
            for (a, b) in run.stats.iter().zip(&reference.stats) {
                assert!(
                    (a[0] - b[0]).abs() / b[0] < TOL as f32,
                    "tp={tp}: entropy {a:?} vs {b:?}"
                );
                assert_eq!(a[1], b[1], "tp={tp}: top-1 count");
            }
            assert_eq!(run.grads.len(), reference.grads.len(), "same parameters");
            for (name, g) in &run.grads {
                let split = run.splits[name];
                let want = slice(&reference.grads[name], split, rank, tp);
                let d = rel_diff(g, &want);
                assert!(
                    d < TOL,
                    "tp={tp} rank {rank}: gradient of {name} differs by {d:e}"
                );
                let w = slice(&reference.weights[name], split, rank, tp);
                let d = rel_diff(&run.weights[name], &w);
                assert!(
                    d < TOL,
                    "tp={tp} rank {rank}: {name} after {STEPS} steps differs by {d:e}"
                );
            }
        }
    }
}

#[test]
fn the_plan_names_every_parameter_as_hf_does() {
    let model = build(&reference_values());
    let plan = tp::plan(&model, 2, false);
    let find = |n: &str| {
        plan.iter()
            .find(|e| e.name == n)
            .unwrap_or_else(|| panic!("{n} missing"))
    };
    let q = find("model.layers.1.self_attn.q_proj.weight");
    assert_eq!(
        q.split.style,
        TpStyle::Column {
            gather_output: false
        }
    );
    assert_eq!(
        (q.local_shape.clone(), q.full_shape.clone()),
        (vec![8, 16], vec![16, 16])
    );
    let o_bias = find("model.layers.0.self_attn.o_proj.bias");
    assert_eq!((o_bias.split.style, o_bias.split.dim), (TpStyle::Row, None));
    let down = find("model.layers.0.mlp.down_proj.weight");
    assert_eq!(down.local_shape, vec![16, 12]);
    assert_eq!(find("model.embed_tokens.weight").split.dim, Some(0));
    assert_eq!(find("lm_head.weight").local_shape, vec![16, 16]);
    assert_eq!(find("model.norm.weight").split.style, TpStyle::Replicate);
    // A norm in a struct with column and row layers may act on split features: the first
    // step's gradients decide (the trainer's TpGrads).
    let norm = find("model.layers.0.input_layernorm.weight").split;
    assert_eq!((norm.style, norm.dim), (TpStyle::Auto, None));
    // 2 layers x (2 norms + 4 attention weights + 3 biases + 3 MLP) + embedding, norm, head.
    assert_eq!(plan.len(), 2 * 12 + 3);
    let mut units = Vec::new();
    model.visit_units("", &mut |u| units.push(u.to_string()));
    assert_eq!(units, ["model.layers.0", "model.layers.1"]);
}

#[test]
fn indivisible_shapes_name_the_tensor() {
    let values = reference_values();
    let errs = InProcessWorld::run(3, |_, comm| {
        let mut model = build(&values);
        tp::parallelize(&mut model, &TpContext::new(comm))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    });
    // The embedding comes first: 32 rows cannot be split 3 ways.
    assert!(
        errs[0].contains("model.embed_tokens.weight")
            && errs[0].contains("not divisible by tp = 3"),
        "{}",
        errs[0]
    );
}

mod qwen2 {
    //! Our own Qwen2 decoder is annotated the same way: tp = 2 and 4 give the logits, loss and
    //! gradients of tp = 1, with tied embeddings and GQA (the bundled tiny model) and untied,
    //! with q/k/v biases.
    use super::*;
    use trl_runtime::models::{ModelConfig, Params};
    use trl_runtime::parallel::CausalLm;

    fn config(edit: &[(&str, serde_json::Value)]) -> ModelConfig {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../assets/tiny/model/config.json"
        );
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        for (k, v) in edit {
            json[*k] = v.clone();
        }
        ModelConfig::from_json(&json.to_string(), "test config").unwrap()
    }

    struct Pass {
        logits: Tensor,
        loss: f64,
        grads: BTreeMap<String, Tensor>,
        splits: BTreeMap<String, Split>,
    }

    fn pass(cfg: &ModelConfig, params: &Params, comm: Arc<dyn Communicator>) -> Pass {
        let copies = params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
            .collect();
        let mut model = CausalLm::new(cfg.clone(), Params::from_tensors(copies).unwrap()).unwrap();
        model.parallelize(comm).unwrap();
        let ids = Tensor::new(
            &[[5u32, 9, 14, 3, 7, 21, 100, 283], [1, 2, 3, 4, 5, 6, 7, 8]],
            &Device::Cpu,
        )
        .unwrap();
        // Two packed documents in the second row.
        let pos = Tensor::new(
            &[[0i64, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 0, 1, 2, 3]],
            &Device::Cpu,
        )
        .unwrap();
        let labels = ids.to_dtype(DType::I64).unwrap();
        let logits = model.forward(&ids, &pos).unwrap();
        let ls = model.loss(&logits, &labels).unwrap();
        let mean = (ls.sum / ls.count as f64).unwrap();
        let store = mean.backward().unwrap();
        let mut splits = BTreeMap::new();
        model.net().visit_params("", &mut |n, _, s| {
            splits.entry(n.to_string()).or_insert(s);
        });
        Pass {
            logits: model.forward_full(&ids, &pos).unwrap(),
            loss: mean.to_scalar::<f32>().unwrap() as f64,
            grads: model
                .params
                .iter()
                .map(|(n, v)| (n.clone(), store.get(v.as_tensor()).unwrap().clone()))
                .collect(),
            splits,
        }
    }

    fn check(cfg: &ModelConfig, sizes: &[usize]) {
        let params = Params::init(cfg, 11, DType::F32, &Device::Cpu).unwrap();
        let reference = InProcessWorld::run(1, |_, c| pass(cfg, &params, c)).remove(0);
        // A key bias has a zero gradient up to rounding (softmax ignores a shift shared by a
        // row's scores): gradients are compared against the largest gradient of the model.
        let scale = reference.grads.values().map(max_abs).fold(0f64, f64::max);
        for &tp in sizes {
            for (rank, run) in InProcessWorld::run(tp, |_, c| pass(cfg, &params, c))
                .iter()
                .enumerate()
            {
                let d = rel_diff(&run.logits, &reference.logits);
                assert!(d < TOL, "tp={tp} rank {rank}: logits differ by {d:e}");
                assert!((run.loss - reference.loss).abs() / reference.loss < TOL);
                assert_eq!(run.grads.len(), reference.grads.len());
                for (name, g) in &run.grads {
                    let want = slice(&reference.grads[name], run.splits[name], rank, tp);
                    let d = max_abs_diff(g, &want) / scale;
                    assert!(
                        d < TOL,
                        "tp={tp} rank {rank}: gradient of {name} differs by {d:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn tied_gqa_model_at_tp_2() {
        check(&config(&[]), &[2]);
    }

    #[test]
    fn untied_model_with_biases_at_tp_2_and_4() {
        let cfg = config(&[
            ("tie_word_embeddings", false.into()),
            ("attention_bias", true.into()),
            ("num_key_value_heads", 4.into()),
        ]);
        assert!(cfg.qkv_bias() && !cfg.tie_word_embeddings);
        check(&cfg, &[2, 4]);
    }

    #[test]
    fn sliced_loading_holds_exactly_each_ranks_slices() {
        // Untied, with biases, saved as a sharded index of several files.
        let cfg = config(&[
            ("tie_word_embeddings", false.into()),
            ("attention_bias", true.into()),
            ("num_key_value_heads", 4.into()),
        ]);
        let tmp = tempfile::tempdir().unwrap();
        let params = Params::init(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
        params
            .save(tmp.path(), &cfg.to_json_pretty(), Some(60_000), None)
            .unwrap();
        assert!(tmp.path().join("model.safetensors.index.json").exists());
        let whole = CausalLm::from_pretrained(tmp.path(), DType::F32, &Device::Cpu).unwrap();
        for tp in [2, 4] {
            let loaded = InProcessWorld::run(tp, |rank, comm| {
                let model =
                    CausalLm::from_pretrained_split(tmp.path(), DType::F32, &Device::Cpu, comm)
                        .unwrap();
                let mut held = trl_runtime::alloc::StorageBytes::default();
                for (name, var) in model.params.iter() {
                    let split = model
                        .tp_plan()
                        .iter()
                        .find(|e| &e.name == name)
                        .unwrap()
                        .split;
                    let want = slice(&whole.params.tensor(name).unwrap(), split, rank, tp);
                    assert_eq!(
                        max_abs_diff(var.as_tensor(), &want),
                        0.0,
                        "tp={tp} rank {rank}: {name} is not its slice"
                    );
                    held.add(var);
                }
                (held.total, model.params.num_elements() * 4)
            });
            for (held, slices) in loaded {
                assert_eq!(held, slices, "tp={tp}: storage beyond the slices");
                assert!(slices < whole.params.num_elements() * 4);
            }
        }
        // Reading a part the size does not divide names the tensor and its file.
        let files = trl_runtime::models::params::WeightFiles::open_for(tmp.path(), &cfg).unwrap();
        let e = files
            .load_part(
                "model.embed_tokens.weight",
                trl_runtime::tp::Split::on(trl_runtime::tp::TpStyle::Vocab, Some(0)),
                0,
                3,
                DType::F32,
                &Device::Cpu,
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.embed_tokens.weight in ") && e.contains(".safetensors"),
            "{e}"
        );
        // A size that does not divide a tensor names it.
        let errs = InProcessWorld::run(3, |_, comm| {
            CausalLm::from_pretrained_split(tmp.path(), DType::F32, &Device::Cpu, comm)
                .err()
                .expect("tp = 3 accepted")
                .to_string()
        });
        assert!(
            errs[0].contains("not divisible by tp = 3") && errs[0].contains(".weight"),
            "{}",
            errs[0]
        );
    }

    #[test]
    fn heads_that_do_not_divide_are_a_clear_error() {
        // The tiny model has 2 key/value heads: tp = 4 cannot split them.
        let cfg = config(&[]);
        let params = Params::init(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let errs = InProcessWorld::run(4, |_, comm| {
            let mut model = CausalLm::new(cfg.clone(), params.clone()).unwrap();
            model.parallelize(comm).unwrap_err().to_string()
        });
        assert!(
            errs[0].contains("num_kv_heads") && errs[0].contains("2 is not divisible by tp = 4"),
            "{}",
            errs[0]
        );
    }
}

#[test]
fn slices_hold_only_their_elements() {
    // A slice that kept the full tensor's storage alive would save no memory.
    let values = reference_values();
    let full: usize = values.values().map(|t| t.elem_count() * 4).sum();
    let held = InProcessWorld::run(2, |_, comm| {
        let mut model = build(&values);
        tp::parallelize(&mut model, &TpContext::new(comm)).unwrap();
        let mut held = trl_runtime::alloc::StorageBytes::default();
        let mut elems = 0;
        model.visit_params("", &mut |_, t, _| {
            held.add(t);
            elems += t.elem_count();
        });
        (held.total, elems * 4)
    });
    for (bytes, shown) in held {
        assert_eq!(bytes, shown, "storage beyond the slices");
        assert!(bytes < full, "{bytes} of {full}: nothing was split");
    }
}

mod phi3 {
    use super::*;
    use trl_runtime::parallel::CausalLm;

    /// Phi-3's fused projections split by sections (assets/tiny-phi3: 4 query and 2 key/value
    /// heads of 16, intermediate 128): at tp = 2 each rank's qkv_proj holds its two query
    /// heads, its key head and its value head, in that order (its gate_up_proj its halves of
    /// gate and up), read from the file sliced; the logits, loss and every gradient are tp =
    /// 1's, and gathering the ranks' slices gives the whole weights back.
    #[test]
    fn phi3_fused_projections_split_by_sections() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/tiny-phi3/model");
        let ids = Tensor::new(
            &[[5u32, 9, 14, 3, 7, 21, 100, 283, 4, 8, 15, 16]],
            &Device::Cpu,
        )
        .unwrap();
        let pos = Tensor::arange(0i64, 12, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let labels = ids.to_dtype(DType::I64).unwrap();
        let run = |comm: Arc<dyn Communicator>| {
            let model =
                CausalLm::from_pretrained_split(dir, DType::F32, &Device::Cpu, comm.clone())
                    .unwrap();
            let logits = model.forward(&ids, &pos).unwrap();
            let ls = model.loss(&logits, &labels).unwrap();
            let mean = (ls.sum / ls.count as f64).unwrap();
            let store = mean.backward().unwrap();
            let grads: BTreeMap<String, Tensor> = model
                .params
                .iter()
                .map(|(n, v)| (n.clone(), store.get(v.as_tensor()).unwrap().clone()))
                .collect();
            let held: BTreeMap<String, Tensor> = model
                .params
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                .collect();
            let gathered =
                tp::state::gather_full(held.clone(), model.tp_plan(), comm.as_ref()).unwrap();
            let splits: BTreeMap<String, Split> = model
                .tp_plan()
                .iter()
                .map(|e| (e.name.clone(), e.split))
                .collect();
            let logits = model.forward_full(&ids, &pos).unwrap();
            let loss = mean.to_scalar::<f32>().unwrap() as f64;
            (logits, loss, grads, held, gathered, splits)
        };
        let (logits, loss, grads, whole, ..) = InProcessWorld::run(1, |_, c| run(c)).remove(0);
        let qkv = "model.layers.1.self_attn.qkv_proj.weight";
        let gate_up = "model.layers.0.mlp.gate_up_proj.weight";
        for (rank, (l, ls, g, held, gathered, splits)) in InProcessWorld::run(2, |_, c| run(c))
            .into_iter()
            .enumerate()
        {
            // Written out by hand: rows of q (64), k (32), v (32); gate (128), up (128).
            let rows = |t: &Tensor, sections: &[(usize, usize)]| {
                let parts: Vec<Tensor> = sections
                    .iter()
                    .map(|&(start, len)| t.narrow(0, start + rank * len, len).unwrap())
                    .collect();
                Tensor::cat(&parts, 0).unwrap()
            };
            let want_qkv = rows(&whole[qkv], &[(0, 32), (64, 16), (96, 16)]);
            assert_eq!(
                max_abs_diff(&held[qkv], &want_qkv),
                0.0,
                "rank {rank}: {qkv}"
            );
            let want_gate_up = rows(&whole[gate_up], &[(0, 64), (128, 64)]);
            assert_eq!(
                max_abs_diff(&held[gate_up], &want_gate_up),
                0.0,
                "rank {rank}: {gate_up}"
            );
            assert_eq!(splits[qkv].dim, Some(0));
            assert_eq!(
                splits["model.layers.0.self_attn.o_proj.weight"].dim,
                Some(1)
            );
            let d = rel_diff(&l, &logits);
            assert!(d < 1e-5, "rank {rank}: logits differ by {d:e}");
            assert!(
                (ls - loss).abs() / loss < 1e-5,
                "rank {rank}: loss {ls} vs {loss}"
            );
            let scale = grads.values().map(max_abs).fold(0f64, f64::max);
            for (name, g) in &g {
                let want = slice(&grads[name], splits[name], rank, 2);
                let d = max_abs_diff(g, &want) / scale;
                assert!(d < 1e-5, "rank {rank}: gradient of {name} differs by {d:e}");
            }
            for (name, t) in &gathered {
                assert_eq!(
                    max_abs_diff(t, &whole[name]),
                    0.0,
                    "rank {rank}: {name} gathered"
                );
            }
        }
    }
}

/// TRL's entropy and mean_token_accuracy follow the first argmax, as torch's argmax: a target
/// tied with an earlier id (on another rank) is not a hit, one tied with a later id is. The
/// whole logits, the fused loss's one-pass kernel (CPU f32: logits = I . W^T with W the rows'
/// transpose) and the vocabulary split 2 and 4 ways give the same figures.
#[test]
fn token_figures_follow_the_first_argmax() {
    let (logits, targets) = common::tied_logits();
    let whole = trl_runtime::nn::loss::cross_entropy_sum(&logits, &targets).unwrap();
    let want = whole.stats.to_vec1::<f32>().unwrap();
    assert_eq!(want[1], 2.0, "hits: row 1 (a tie after it) and row 2");
    let check = |what: &str, got: Vec<f32>| {
        assert_eq!(got[1], want[1], "{what}: hits");
        let d = (got[0] - want[0]).abs() / want[0];
        assert!(d < 1e-6, "{what}: {got:?} vs {want:?}");
    };
    let eye = Tensor::eye(5, DType::F32, &Device::Cpu).unwrap();
    let head = logits.t().unwrap().contiguous().unwrap();
    let fused = trl_runtime::nn::tiled_linear_cross_entropy(&eye, &head, &targets).unwrap();
    check("fused", fused.stats.to_vec1::<f32>().unwrap());
    for tp in [2, 4] {
        let got = InProcessWorld::run(tp, |rank, comm| {
            let part = logits.narrow(1, rank * 4 / tp, 4 / tp).unwrap();
            let ls = vocab_parallel_cross_entropy(&part, &targets, &comm).unwrap();
            ls.stats.to_vec1::<f32>().unwrap()
        });
        for (rank, g) in got.into_iter().enumerate() {
            check(&format!("tp={tp} rank {rank}"), g);
        }
    }
}
