//! `#[context_parallel]` on a user's training step: a small model written the plain Candle
//! way, whose attention calls `trl_runtime::context_parallel::attention`, gives the loss and
//! gradients of one process when its step runs with cp = 2 and 4 (ring attention) or sp = 2
//! and 4 (Ulysses), on packed rows whose documents cross the chunks. Our own decoder follows
//! the step's routing too.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::max_abs_diff;
use std::collections::BTreeMap;
use trl_runtime::comm::{InProcessWorld, ReduceOp};
use trl_runtime::config::parallelism::ParallelDims;
use trl_runtime::context_parallel;
use trl_runtime::data::Batch;
use trl_runtime::dist::{DeviceMesh, DistContext};
use trl_runtime::nn::loss::cross_entropy_sum;
use trl_runtime::nn::LossSum;

const VOCAB: usize = 40;
const HIDDEN: usize = 16;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;

/// One attention block over an embedding, with an LM head: plain Candle.
struct TinyModel {
    embed: candle_nn::Embedding,
    q: candle_nn::Linear,
    k: candle_nn::Linear,
    v: candle_nn::Linear,
    o: candle_nn::Linear,
    head: candle_nn::Linear,
}

impl TinyModel {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let kv = KV_HEADS * HEAD_DIM;
        Ok(TinyModel {
            embed: candle_nn::embedding(VOCAB, HIDDEN, vb.pp("embed"))?,
            q: candle_nn::linear(HIDDEN, HIDDEN, vb.pp("q"))?,
            k: candle_nn::linear_no_bias(HIDDEN, kv, vb.pp("k"))?,
            v: candle_nn::linear(HIDDEN, kv, vb.pp("v"))?,
            o: candle_nn::linear(HIDDEN, HIDDEN, vb.pp("o"))?,
            head: candle_nn::linear_no_bias(HIDDEN, VOCAB, vb.pp("head"))?,
        })
    }

    fn forward(&self, ids: &Tensor, pos: &Tensor) -> trl_runtime::Result<Tensor> {
        let (b, n) = ids.dims2()?;
        let x = self.embed.forward(ids)?;
        let heads = |t: Tensor, h: usize| -> candle_core::Result<Tensor> {
            t.reshape((b, n, h, HEAD_DIM))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = heads(self.q.forward(&x)?, HEADS)?;
        let k = heads(self.k.forward(&x)?, KV_HEADS)?;
        let v = heads(self.v.forward(&x)?, KV_HEADS)?;
        // The one line that makes the model take part: attention through the step's routing.
        let a = context_parallel::attention(&q, &k, &v, pos)?;
        let a = a.transpose(1, 2)?.reshape((b, n, HIDDEN))?;
        let x = (x + self.o.forward(&a)?)?;
        Ok(self.head.forward(&x)?)
    }
}

#[trl_runtime::context_parallel]
fn step(model: &TinyModel, batch: &Batch, ctx: &DistContext) -> trl_runtime::Result<LossSum> {
    let logits = model.forward(&batch.input_ids, &batch.position_ids)?;
    Ok(cross_entropy_sum(&logits, &batch.targets()?)?)
}

/// Two rows of 16: documents of 6 and 10, then one of 16; a few ignored labels.
fn batch() -> Batch {
    let dev = Device::Cpu;
    let ids: Vec<u32> = (0..32u32).map(|i| (i * 17 + 5) % VOCAB as u32).collect();
    let mut labels: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    labels[3] = -100;
    labels[20] = -100;
    let pos: Vec<i64> = (0..6).chain(0..10).chain(0..16).collect();
    Batch {
        input_ids: Tensor::from_vec(ids, (2, 16), &dev).unwrap(),
        labels: Tensor::from_vec(labels, (2, 16), &dev).unwrap(),
        position_ids: Tensor::from_vec(pos, (2, 16), &dev).unwrap(),
        num_target_tokens: 28,
        shifted_targets: None,
        attention_mask: None,
    }
}

/// `f` on every rank of a mesh of `cp` x `sp` in-process ranks; rank 0's result.
fn on_ranks<R: Send>(cp: usize, sp: usize, f: impl Fn(&DistContext) -> R + Sync) -> R {
    let world = cp * sp;
    let dims = ParallelDims {
        dp_replicate: 1,
        dp_shard: 1,
        cp,
        sp,
        tp: 1,
    };
    let w = InProcessWorld::new(world);
    let results: Vec<R> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (w, f) = (&w, &f);
                s.spawn(move || {
                    let mesh = DeviceMesh::new(dims, world).unwrap();
                    f(&DistContext::in_process(w, rank, mesh).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    results.into_iter().next().unwrap()
}

/// The step's mean loss and the gradients summed over the ranks, on a mesh of `cp` x `sp`.
fn run(cp: usize, sp: usize) -> (f64, BTreeMap<String, Tensor>) {
    on_ranks(cp, sp, |ctx| {
        let vm = VarMap::new();
        let model = TinyModel::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
        // The same values everywhere, by name.
        for (name, var) in vm.data().lock().unwrap().iter() {
            let seed = name.bytes().map(|b| b as f32).sum::<f32>();
            let values: Vec<f32> = (0..var.elem_count())
                .map(|i| ((i as f32 + seed) * 0.7).sin() * 0.3)
                .collect();
            var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
        let mean = step(&model, &batch(), ctx).unwrap().mean().unwrap();
        let grads = mean.backward().unwrap();
        let world = ctx.world();
        let total = world
            .all_reduce(&mean.reshape(1).unwrap(), ReduceOp::Sum)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()[0] as f64;
        // In name order: every rank issues the same collectives in one order.
        let vars: BTreeMap<String, candle_core::Var> =
            vm.data().lock().unwrap().clone().into_iter().collect();
        let summed = vars
            .iter()
            .map(|(name, var)| {
                let g = grads.get(var.as_tensor()).unwrap();
                (name.clone(), world.all_reduce(g, ReduceOp::Sum).unwrap())
            })
            .collect();
        (total, summed)
    })
}

#[test]
fn steps_split_over_cp_or_sp_equal_one_process() {
    let (loss, grads) = run(1, 1);
    let scale = grads.values().map(common::max_abs).fold(0f64, f64::max);
    for (cp, sp) in [(2, 1), (4, 1), (1, 2), (1, 4)] {
        let (got, got_grads) = run(cp, sp);
        let what = format!("cp {cp} sp {sp}");
        assert!(
            (got - loss).abs() / loss < 1e-5,
            "{what}: mean loss {got} vs {loss}"
        );
        for (name, g) in &got_grads {
            let d = max_abs_diff(g, &grads[name]) / scale;
            assert!(d < 1e-5, "{what}: gradient of {name} differs by {d:e}");
        }
    }
}

#[trl_runtime::context_parallel]
fn decoder_step(
    model: &trl_runtime::parallel::CausalLm,
    batch: &Batch,
    ctx: &DistContext,
) -> trl_runtime::Result<LossSum> {
    model.forward_targets(&batch.input_ids, &batch.position_ids, &batch.targets()?)
}

#[test]
fn our_decoder_follows_the_step() {
    use trl_runtime::models::{ModelConfig, Params};
    use trl_runtime::parallel::CausalLm;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../assets/tiny/model/config.json"
    );
    let cfg = ModelConfig::from_file(path).unwrap();
    let params = Params::init(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
    let mean_loss = |cp: usize, sp: usize| -> f64 {
        on_ranks(cp, sp, |ctx| {
            let model = CausalLm::new(cfg.clone(), params.clone()).unwrap();
            let mean = decoder_step(&model, &batch(), ctx).unwrap().mean().unwrap();
            ctx.world()
                .all_reduce(&mean.reshape(1).unwrap(), ReduceOp::Sum)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()[0] as f64
        })
    };
    let whole = mean_loss(1, 1);
    for (cp, sp) in [(2, 1), (1, 2)] {
        let got = mean_loss(cp, sp);
        assert!(
            (got - whole).abs() / whole < 1e-5,
            "cp {cp} sp {sp}: {got} vs {whole}"
        );
    }
}

/// The step sees its own chunk: its length, and the whole rows' count once summed.
#[trl_runtime::context_parallel]
fn chunk_step(batch: &Batch, ctx: &DistContext) -> trl_runtime::Result<LossSum> {
    let _ = ctx;
    Ok(LossSum {
        sum: Tensor::new(batch.input_ids.dim(1)? as f32, &Device::Cpu)?,
        count: batch.num_target_tokens,
        stats: Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu)?,
    })
}

#[test]
fn the_step_gets_this_ranks_chunk() {
    for (cp, sp) in [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4)] {
        let (len, count) = on_ranks(cp, sp, |ctx| {
            let loss = chunk_step(&batch(), ctx).unwrap();
            (loss.sum.to_scalar::<f32>().unwrap() as usize, loss.count)
        });
        assert_eq!(len, 16 / (cp * sp), "cp {cp} sp {sp}: chunk length");
        assert_eq!(
            count,
            batch().num_target_tokens,
            "cp {cp} sp {sp}: rows' count"
        );
    }
}

/// Standard normal draws from `seed` (the same inputs each run: unseeded ones made the split's
/// rounding against one process land on either side of its bound from run to run).
fn seeded_normal(shape: &[usize], seed: u64) -> Tensor {
    use rand::SeedableRng;
    use rand_distr::Distribution;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rand_distr::StandardNormal.sample(&mut rng))
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// A Gated DeltaNet layer (Qwen3.5's projections) on random weights in `dtype`: `key_heads` key heads
/// of 4 features, each serving 2 value heads of 3, a convolution of 4, hidden 16.
fn random_layer(
    key_heads: usize,
    dtype: DType,
) -> trl_runtime::models::gated_deltanet::GatedDeltaNet {
    use trl_runtime::models::gated_deltanet::{DeltaNetShape, GatedDeltaNet, Projections};
    let dev = Device::Cpu;
    let (h, nk, nv, dk, dv) = (16, key_heads, 2 * key_heads, 4, 3);
    let channels = 2 * nk * dk + nv * dv;
    let mut seed = 100 * key_heads as u64;
    let mut random = |shape: &[usize], scale: f64| {
        seed += 1;
        (seeded_normal(shape, seed) * scale).unwrap()
    };
    let tensors: std::collections::HashMap<String, Tensor> = [
        ("in_proj_qkv.weight", random(&[channels, h], 0.3)),
        ("in_proj_z.weight", random(&[nv * dv, h], 0.3)),
        ("in_proj_b.weight", random(&[nv, h], 0.3)),
        ("in_proj_a.weight", random(&[nv, h], 0.3)),
        ("conv1d.weight", random(&[channels, 1, 4], 0.5)),
        ("dt_bias", random(&[nv], 0.3)),
        ("A_log", random(&[nv], 0.5)),
        ("norm.weight", (random(&[dv], 0.1) + 1.0).unwrap()),
        ("out_proj.weight", random(&[h, nv * dv], 0.3)),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t))
    .collect();
    let tensors = tensors
        .into_iter()
        .map(|(n, t)| (n, t.to_dtype(dtype).unwrap()))
        .collect();
    let vb = candle_nn::VarBuilder::from_tensors(tensors, dtype, &dev);
    let shape = DeltaNetShape {
        hidden: h,
        key_heads: nk,
        value_heads: nv,
        key_dim: dk,
        value_dim: dv,
        conv_kernel: 4,
        eps: 1e-6,
        chunk: 4,
        projections: Projections::Apart,
    };
    GatedDeltaNet::new(shape, vb).unwrap()
}

/// Gated DeltaNet (Qwen3-Next's and Qwen3.5's linear attention) where each rank holds a part
/// of every row: under ring attention (cp 2 and 4: each rank two head-tail chunks, the rule's
/// state scanned over the ranks, the convolution led by the tokens before each chunk; at cp 4
/// a chunk of 2 tokens is shorter than the convolution's 3 earlier taps) and Ulysses (sp 2:
/// split by key heads). Each rank's outputs for its tokens, and the gradients of a loss over
/// every rank's outputs with respect to its inputs, equal one process's, on packed rows whose
/// documents start inside another rank's part and on a chunk's first token: in f64 within
/// 1e-10 (the split is exact); in f32 the outputs within 1e-5 and the gradients within twice
/// the furthest one process's f32 gradients are from f64's (this random layer's gradients, up
/// to 65, lose 2.5e-3 to f32 rounding in one process already). Where the key heads divide by
/// cp the ring splits by heads (2 key heads at cp 2), elsewhere it scans the state (cp 4, and
/// 1 key head); Ulysses refuses key heads that do not divide by the group, naming both.
#[test]
fn the_layer_split_over_ranks_equals_one_process() {
    use trl_runtime::context_parallel::SeqSplit;
    use trl_runtime::data::sequence::split_columns;
    use trl_runtime::models::gated_deltanet::GatedDeltaNet;
    use trl_runtime::models::LayerInputs;
    use trl_runtime::nn::AttentionImpl;
    let dev = Device::Cpu;
    let len = 16;
    // Documents of 7 and 9 tokens in row 0, one of 16 in row 1, 4 and 12 in row 2.
    let pos: Vec<i64> = (0..7)
        .chain(0..9)
        .chain(0..16)
        .chain(0..4)
        .chain(0..12)
        .collect();
    let pos = Tensor::from_vec(pos, (3, len), &dev).unwrap();
    let hidden = seeded_normal(&[3, len, 16], 7);
    let weights = seeded_normal(&[3, len, 16], 8);
    // The layer's output, and the gradient of sum(output x weights) with respect to `hidden`,
    // in the layer's dtype.
    let run = |(layer, dtype): (&GatedDeltaNet, DType),
               hidden: &Tensor,
               weights: &Tensor,
               cx: &LayerInputs| {
        let hidden = candle_core::Var::from_tensor(&hidden.to_dtype(dtype).unwrap()).unwrap();
        let out = layer.forward(hidden.as_tensor(), cx)?;
        let loss = (&out * weights.to_dtype(dtype).unwrap()).unwrap();
        let grads = loss.sum_all().unwrap().backward().unwrap();
        let grad = grads.get(hidden.as_tensor()).unwrap().clone();
        let f64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        Ok::<_, trl_runtime::Error>((f64(&out), f64(&grad)))
    };
    let whole = |key_heads: usize, dtype: DType| {
        let cx = LayerInputs::new(&pos, None, AttentionImpl::Eager, dtype, &dev).unwrap();
        run(
            (&random_layer(key_heads, dtype), dtype),
            &hidden,
            &weights,
            &cx,
        )
        .unwrap()
    };
    for key_heads in [2, 1] {
        let (exact, exact_grad) = whole(key_heads, DType::F64);
        for dtype in [DType::F64, DType::F32] {
            let layer = random_layer(key_heads, dtype);
            let (_, one_grad) = whole(key_heads, dtype);
            for (cp, sp) in [(2, 1), (4, 1), (1, 2)] {
                on_ranks(cp, sp, |ctx| {
                    let rank = ctx.rank();
                    let split = SeqSplit::from_context(ctx).unwrap().unwrap();
                    let mine = split_columns(len, rank, cp * sp, split.ring).unwrap();
                    let mine: Vec<u32> = mine.iter().map(|&i| i as u32).collect();
                    let mine = Tensor::new(mine.as_slice(), &Device::Cpu).unwrap();
                    let part = |t: &Tensor| t.index_select(&mine, 1).unwrap();
                    let cx = LayerInputs::new(
                        &part(&pos),
                        Some(&split),
                        AttentionImpl::Eager,
                        dtype,
                        &Device::Cpu,
                    )
                    .unwrap();
                    // The ring splits by heads where they divide by cp, and scans elsewhere.
                    let scans = split.ring && !key_heads.is_multiple_of(cp * sp);
                    let taken = trl_runtime::context_parallel::linear::scans(key_heads, &split);
                    if std::env::var_os("TRL_LINEAR_CP").is_none() {
                        assert_eq!(taken, scans, "cp {cp} sp {sp}, {key_heads} key heads");
                    }
                    let got = run((&layer, dtype), &part(&hidden), &part(&weights), &cx);
                    let how = format!(
                        "{} x {} rank {rank}, {key_heads} key heads, {dtype:?}",
                        if split.ring { "ring" } else { "Ulysses" },
                        cp * sp
                    );
                    if key_heads == 1 && !split.ring {
                        let err = got.unwrap_err().to_string();
                        assert!(err.contains("1 linear_num_key_heads"), "{err}");
                        return;
                    }
                    let (out, grad) = got.unwrap();
                    let diff = max_abs_diff(&out, &part(&exact));
                    let grad_diff = max_abs_diff(&grad, &part(&exact_grad));
                    // f32 rounding: as far as one process's is anywhere in the rows.
                    let one_diff = max_abs_diff(&one_grad, &exact_grad);
                    eprintln!(
                        "{how}: outputs {diff:e} from f64's, input gradients {grad_diff:e} \
                         (one process {one_diff:e})"
                    );
                    let (values, grads) = match dtype {
                        DType::F64 => (1e-10, 1e-10),
                        _ => (1e-5, 2.0 * one_diff + 1e-5),
                    };
                    assert!(diff < values, "{how}: outputs {diff}");
                    assert!(grad_diff < grads, "{how}: gradients {grad_diff}");
                });
            }
        }
    }
}
