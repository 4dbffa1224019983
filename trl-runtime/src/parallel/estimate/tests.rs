use super::*;

/// 1 GFLOP/s, three quarters of a step in matmuls, no LoRA overhead.
fn test_rates() -> CpuStepRates {
    CpuStepRates {
        rank_flops: 1e9,
        matmul_share: 0.75,
        adapter_element_seconds: 0.0,
    }
}

/// Two CPU ranks at [`test_rates`] on a machine whose collectives cost nothing, a loss over
/// whole logits costing `logit_seconds` per logit: compute alone.
fn compute_only_cpu(logit_seconds: f64) -> Hardware {
    let free = LinkSpeed {
        latency: 0.0,
        bandwidth: f64::INFINITY,
    };
    Hardware::cpu(test_rates(), 2, free, logit_seconds)
}

/// An fp32 CPU setup of `strategy` over `(dp_shard, tp)`: one 64-token row, one
/// micro-batch, no checkpointing; tests change what they look at.
fn cpu_setup(strategy: Strategy, (dp_shard, tp): (usize, usize)) -> Setup {
    let dims = ParallelDims {
        dp_replicate: 1,
        dp_shard,
        cp: 1,
        sp: 1,
        tp,
    };
    Setup::new(strategy, dims, 1, 64)
}

fn assets(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../assets")
        .join(path)
}

/// DDP's gradients: fp32 sums, but in the compute dtype on one GPU replica with one
/// micro-batch per step (what `Core::accumulate` keeps), bf16 here.
#[test]
fn ddp_gradients_stay_in_the_compute_dtype_on_one_gpu_with_one_micro_batch() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    let p = m.num_parameters();
    let gradients = |dp: usize, micro_batches: usize, gpu: bool| {
        let setup = Setup {
            dtype: DType::BF16,
            micro_batches,
            gpu,
            ..cpu_setup(Strategy::Ddp, (dp, 1))
        };
        estimate(&m, &setup).gradients
    };
    assert_eq!(gradients(1, 1, true), 2 * p);
    assert_eq!(
        gradients(1, 2, true),
        4 * p,
        "micro-batches are summed in fp32"
    );
    assert_eq!(gradients(2, 1, true), 4 * p, "an all-reduce sums in fp32");
    assert_eq!(gradients(1, 1, false), 4 * p, "the CPU sums in fp32");
}

/// The shapes come from the model's own skeleton, which allocates nothing: Llama 3.1 70B's
/// 70,553,706,496 parameters (transformers' count) are read in a test process.
/// Llama-3.1-8B in bf16 on 8 GPUs against DeepSpeed 0.19.6's estimators, with P =
/// 8,030,261,248 parameters and L = 525,336,576 in DeepSpeed's largest layer (the
/// embedding): `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/
/// stage_1_and_2.py) 2P + 18P/N, or 2P with cpu_offload; `estimate_zero3_model_states_
/// mem_needs` (stage3.py) 4L + 18P/N, 4L + 2P/N with cpu_offload, 4L with cpu_offload_params
/// too (FSDP's offload_params moves both). DeepSpeed counts the layer in use (its 16-bit
/// weights and gradients, 4L) as model state, where the plan counts gathered units among
/// the step's buffers: the comparison adds the same 4L to ours.
#[test]
fn model_state_is_what_deepspeeds_estimators_say() {
    let m = ModelShapes::from_file(assets("configs/llama-3.1-8b.json")).unwrap();
    let p = m.num_parameters() as f64;
    assert_eq!(p, 8_030_261_248.0);
    let (l, n) = (525_336_576.0, 8.0);
    let dims = ParallelDims {
        dp_shard: 8,
        ..ParallelDims::single()
    };
    let zero3 = Strategy::fsdp(WrapPolicy::PerLayer);
    let zero2 = Strategy::Zero(ZeroStage::Two);
    for (name, strategy, offload, offload_params, deepspeed) in [
        ("zero2", zero2, false, false, 2.0 * p + 18.0 * p / n),
        ("zero2+off", zero2, true, false, 2.0 * p),
        ("zero3", zero3, false, false, 4.0 * l + 18.0 * p / n),
        ("zero3+off", zero3, true, false, 4.0 * l + 2.0 * p / n),
        ("zero3+offp", zero3, true, true, 4.0 * l),
    ] {
        let setup = Setup {
            dtype: DType::BF16,
            gpu: true,
            checkpointing: true,
            offload_optimizer: offload,
            offload_params,
            ..Setup::new(strategy, dims, 1, 4096)
        };
        let e = estimate(&m, &setup);
        let layer = if name.starts_with("zero3") {
            4.0 * l
        } else {
            0.0
        };
        let ours = e.model_state() as f64 + layer;
        let ratio = ours / deepspeed;
        assert!(
            (ratio - 1.0).abs() < 0.10,
            "{name}: {ours:.3e} bytes per rank, DeepSpeed {deepspeed:.3e} ({ratio:.3})"
        );
        // What leaves the device is in host memory.
        if offload {
            assert!(e.host_optimizer > 0 && e.host_gradients > 0, "{name}");
        }
        assert_eq!(e.host_parameters > 0, offload_params, "{name}");
    }
}

#[test]
fn a_70b_skeleton_is_counted_without_its_weights() {
    let m = ModelShapes::from_file(assets("configs/llama-3.1-70b.json")).unwrap();
    assert_eq!(m.num_parameters(), 70_553_706_496);
    assert!(!m.tied && m.moe.is_none());
    assert!(m.splits_over(8, 1) && !m.splits_over(3, 1));
}

/// The host backend's collectives are measured, not assumed: a latency and a bandwidth
/// that a 2-rank all-reduce between threads of this process gives.
#[test]
fn the_host_link_is_measured() {
    let link = host_all_reduce_speed(2).unwrap();
    assert!(
        link.bandwidth.is_finite() && link.bandwidth > 1e6,
        "{link:?}"
    );
    assert!(link.latency >= 0.0 && link.latency < 1.0, "{link:?}");
}

/// Under tensor parallelism a rank halves its matmuls and its passes over heads and MLP
/// features but makes those over the whole hidden state in full; LoRA adds its measured
/// cost per token and adapted feature (this rank's part of each layer under tp).
#[test]
fn tp_splits_what_follows_the_heads_and_lora_adds_its_measured_cost() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    let mut hw = compute_only_cpu(0.0);
    let one = step_time(&m, &cpu_setup(Strategy::Ddp, (1, 1)), &hw).compute;
    let two = step_time(&m, &cpu_setup(Strategy::Ddp, (1, 2)), &hw).compute;
    let r = m.dims.replicated_elementwise_share();
    assert!(r > 0.1 && r < 0.9, "{r}");
    // Matmuls are 3/4 of the unsplit step (`test_rates`).
    let want = one * (0.75 / 2.0 + 0.25 * (r + (1.0 - r) / 2.0));
    assert!((two - want).abs() < 1e-9 * want, "{two} vs {want}");

    let lora = LoraConfig::new(8, 16.0, 0.05, crate::nn::lora::Targets::AllLinear);
    for tp in [1, 2] {
        let setup = Setup {
            lora: Some(lora.clone()),
            ..cpu_setup(Strategy::Ddp, (1, tp))
        };
        hw.adapter_element_seconds = 0.0;
        let without = step_time(&m, &setup, &hw).compute;
        hw.adapter_element_seconds = 1e-9;
        let with = step_time(&m, &setup, &hw).compute;
        // q, k, v, o, gate, up and down of every layer, in and out: the column-split
        // ones' outputs and the row-split ones' inputs a 1/tp each.
        let c = &m.dims;
        let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
        let q = (c.num_attention_heads * c.head_dim()) as f64;
        let kv = (c.num_kv_heads() * c.head_dim()) as f64;
        let features =
            c.num_hidden_layers as f64 * (7.0 * h + (2.0 * q + 2.0 * kv + 3.0 * i) / tp as f64);
        let added = 64.0 * features * 1e-9;
        assert!(((with - without) - added).abs() < 1e-9 * added, "tp {tp}");
    }
}

/// On CPU the host backend's collectives take their time from compute (the ranks'
/// threads fill the cores); on GPUs NCCL's run beside it and only what exceeds it counts.
#[test]
fn cpu_collectives_add_to_the_step_and_gpu_ones_overlap() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    let setup = cpu_setup(Strategy::fsdp(WrapPolicy::PerLayer), (2, 1));
    let link = LinkSpeed {
        latency: 1e-3,
        bandwidth: 1e8,
    };
    let mut hw = Hardware::cpu(test_rates(), 2, link, 0.0);
    let cpu = step_time(&m, &setup, &hw);
    assert!(cpu.data_parallel > 0.0 && cpu.model_parallel == 0.0);
    let tokens = 2.0 * 64.0;
    let added = tokens / (cpu.compute + cpu.data_parallel);
    assert!(
        (cpu.tokens_per_second - added).abs() < 1e-9 * added,
        "{cpu:?}"
    );
    hw.comm_overlaps = true;
    let gpu = step_time(&m, &setup, &hw);
    let hidden = tokens / gpu.compute.max(gpu.data_parallel);
    assert!(
        (gpu.tokens_per_second - hidden).abs() < 1e-9 * hidden,
        "{gpu:?}"
    );
}

/// The rings a CPU rank touches, as the profiles' workers measured them (RssShmem of
/// /proc/PID/status after `cargo trl launch --profile P sft` on the tiny model): 16.5 MiB
/// on multi_cpu's 2 ranks, 33 MiB on fsdp2_tp_cpu's 4 (dp_shard 2 x tp 2), and
/// context_parallel_cpu (cp 2) and alst_ulysses_cpu (dp_shard 2 x sp 2) as much as
/// fsdp2_tp_cpu; nothing on one process or with ranks on other machines only.
#[test]
fn rings_of_the_groups_a_rank_talks_over() {
    let mib = |dims: ParallelDims, per_machine| cpu_ring_bytes(dims, per_machine) >> 20;
    let dims = |dp_replicate, dp_shard, cp, sp, tp| ParallelDims {
        dp_replicate,
        dp_shard,
        cp,
        sp,
        tp,
    };
    assert_eq!(mib(dims(1, 1, 1, 1, 1), 1), 0);
    assert_eq!(mib(dims(2, 1, 1, 1, 1), 2), 16);
    assert_eq!(mib(dims(1, 2, 1, 1, 1), 2), 16);
    assert_eq!(mib(dims(1, 2, 1, 1, 2), 4), 32);
    assert_eq!(mib(dims(1, 1, 2, 1, 1), 2), 32);
    assert_eq!(mib(dims(1, 2, 1, 2, 1), 4), 32);
    // HSDP: the shard group and the replica group.
    assert_eq!(mib(dims(2, 2, 1, 1, 1), 4), 32);
    // One process per machine: every peer is over TCP.
    assert_eq!(mib(dims(4, 1, 1, 1, 1), 1), 0);
}

/// A loss over whole logits (tp) costs its per-logit time beside the matmuls, each rank
/// over its tokens and its share of the vocabulary; the fused loss (a whole head under
/// DDP, or gathered under ZeRO-3 / FSDP) costs none.
#[test]
fn whole_logits_add_their_passes_to_the_step() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    let compute = |strategy, split, logit_seconds| {
        let setup = cpu_setup(strategy, split);
        step_time(&m, &setup, &compute_only_cpu(logit_seconds)).compute
    };
    let vocab = m.dims.vocab_size as f64;
    let zero3 = Strategy::fsdp(WrapPolicy::PerLayer);
    assert_eq!(compute(zero3, (2, 1), 1e-9), compute(zero3, (2, 1), 0.0));
    let added = compute(Strategy::Ddp, (1, 2), 1e-9) - compute(Strategy::Ddp, (1, 2), 0.0);
    assert!((added - 64.0 * vocab / 2.0 * 1e-9).abs() < 1e-12, "{added}");
    assert_eq!(
        compute(Strategy::Ddp, (2, 1), 1e-9),
        compute(Strategy::Ddp, (2, 1), 0.0)
    );
}

/// ZeRO-3's gradient slices are taken by each update: in a step's first micro-batch none
/// exists while a whole-logits loss (the head split by tp) runs its backward, in later
/// ones all do.
#[test]
fn accumulating_gradients_keeps_the_slices_through_the_loss() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    let mut setup = cpu_setup(Strategy::fsdp(WrapPolicy::PerLayer), (2, 2));
    setup.batch = 4;
    setup.seq = 256;
    let one = estimate(&m, &setup);
    setup.micro_batches = 4;
    let four = estimate(&m, &setup);
    assert_eq!(one.model_state(), four.model_state());
    let more = four.peak() - one.peak();
    assert!(
        more > 0 && more <= one.gradients,
        "{more} vs {}",
        one.gradients
    );
}

/// TR-DPO's reference is a copy of the weights each rank holds: whole under DDP, its
/// slices under ZeRO-3, in the peak but not the model state.
#[test]
fn a_reference_copy_adds_the_held_weights() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    for (strategy, shard) in [
        (Strategy::Ddp, 1),
        (Strategy::fsdp(WrapPolicy::PerLayer), 2),
    ] {
        let mut setup = cpu_setup(strategy, (shard, 1));
        setup.batch = 2;
        let without = estimate(&m, &setup);
        setup.reference_copy = true;
        let with = estimate(&m, &setup);
        assert_eq!(with.reference, without.parameters);
        assert_eq!(with.peak() - without.peak(), without.parameters);
        assert_eq!(with.model_state(), without.model_state());
    }
}

/// Distillation's teacher is held as the trained model is: whole under DDP, its slices
/// under ZeRO-3, in the compute dtype, in the peak but not the model state.
#[test]
fn a_held_frozen_model_is_sharded_as_the_trained_one() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    let teacher = 359_904;
    for (strategy, shard) in [
        (Strategy::Ddp, 1),
        (Strategy::fsdp(WrapPolicy::PerLayer), 2),
    ] {
        let mut setup = cpu_setup(strategy, (shard, 1));
        let without = estimate(&m, &setup);
        setup.held_parameters = teacher;
        let with = estimate(&m, &setup);
        let held = 4 * teacher.div_ceil(shard);
        assert_eq!(with.reference - without.reference, held);
        assert_eq!(with.peak() - without.peak(), held);
        assert_eq!(with.model_state(), without.model_state());
    }
}

/// Every tensor-parallel collective of a step pays the link's latency: 4 per layer
/// (2 forward, 2 backward), 6 with checkpointing's recompute.
#[test]
fn each_tp_collective_pays_the_latency() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    let layers = m.dims.num_hidden_layers as f64;
    for (checkpointing, per_layer) in [(false, 4.0), (true, 6.0)] {
        let setup = Setup {
            checkpointing,
            ..cpu_setup(Strategy::Ddp, (1, 2))
        };
        let at = |latency: f64| {
            let link = LinkSpeed {
                latency,
                bandwidth: 1e9,
            };
            step_time(&m, &setup, &Hardware::cpu(test_rates(), 2, link, 0.0)).model_parallel
        };
        let extra = at(1e-3) - at(0.0);
        assert!(
            (extra - layers * per_layer * 1e-3).abs() < 1e-12,
            "checkpointing {checkpointing}: {extra} s"
        );
    }
}

/// Causal attention's FLOPs per token and layer: a query scores s / 2 keys on average,
/// 2 FLOPs per key and feature in Q K^T and in P V, times 3 for forward and backward (4
/// with checkpointing's second forward): 6 s q (8 s q), what `bench train`'s MFU and so
/// the GPU table's rate count.
#[test]
fn attention_flops_are_the_causal_count() {
    let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
    let q = (m.dims.num_attention_heads * m.dims.head_dim()) as f64;
    let layers = m.dims.num_hidden_layers as f64;
    for (checkpointing, passes) in [(false, 6.0), (true, 8.0)] {
        let seq = 1000;
        let attention = m.matmul_flops_per_token(seq, checkpointing, 0)
            - m.matmul_flops_per_token(0, checkpointing, 0);
        let causal = passes * layers * seq as f64 * q;
        assert!(
            (attention - causal).abs() < 1e-6 * causal,
            "{attention} vs {causal}"
        );
    }
}

/// Windows and chunks shorten attention's count per layer to the keys its queries score:
/// Llama 4's chunked layers (chunk 8), Mistral's window on every layer (6, no `layer_types`),
/// Gemma 3's sliding layers; a Gated DeltaNet layer counts its rule instead (Qwen3.5).
#[test]
fn attention_flops_follow_each_layers_windows() {
    let seq = 100;
    let attention = |m: &ModelShapes| {
        m.matmul_flops_per_token(seq, false, 0) - m.matmul_flops_per_token(0, false, 0)
    };
    let q = |m: &ModelShapes| (m.dims.num_attention_heads * m.dims.head_dim()) as f64;
    let kinds = |m: &ModelShapes, kind: &str| {
        m.dims
            .layer_types
            .as_ref()
            .unwrap()
            .iter()
            .filter(|t| *t == kind)
            .count() as f64
    };
    let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
    // Chunks of 8: 12 whole chunks and 4 tokens, (12 x 64 + 16) / 100.
    let m = ModelShapes::from_file(assets("tiny-llama4/model/config.json")).unwrap();
    let chunked = kinds(&m, "chunked_attention");
    assert!(chunked > 0.0);
    let full = m.dims.num_hidden_layers as f64 - chunked;
    close(attention(&m), 6.0 * q(&m) * (chunked * 7.84 + full * 100.0));
    // A window of 6 on every layer: 2 x 6 - 36 / 100.
    let m = ModelShapes::from_file(assets("tiny-mistral/model/config.json")).unwrap();
    assert!(m.dims.layer_types.is_none());
    close(
        attention(&m),
        6.0 * q(&m) * m.dims.num_hidden_layers as f64 * 11.64,
    );
    let m = ModelShapes::from_file(assets("tiny-gemma3/model/config.json")).unwrap();
    let sliding = kinds(&m, "sliding_attention");
    let full = m.dims.num_hidden_layers as f64 - sliding;
    close(
        attention(&m),
        6.0 * q(&m) * (sliding * 11.64 + full * 100.0),
    );
    // Qwen3.5: the full layers' causal count, and 3 x (forward: 2 FLOPs x 3 products x the
    // value heads' states) per Gated DeltaNet layer.
    let m = ModelShapes::from_file(assets("tiny-qwen3.5/model/config.json")).unwrap();
    let linear = kinds(&m, "linear_attention");
    let d = &m.dims;
    let state = d.linear_num_value_heads.unwrap()
        * d.linear_key_head_dim.unwrap()
        * d.linear_value_head_dim.unwrap();
    let full = d.num_hidden_layers as f64 - linear;
    let rule = 3.0 * linear * 6.0 * state as f64;
    let base = m.matmul_flops_per_token(0, false, 0);
    assert!(linear > 0.0);
    close(
        m.matmul_flops_per_token(seq, false, 0) - base,
        6.0 * q(&m) * full * seq as f64,
    );
    let embed = match m.tied {
        true => 0.0,
        false => (d.vocab_size * d.hidden_size) as f64,
    };
    close(base - 6.0 * (m.active_parameters - embed), rule);
    // Without `layer_types`, Qwen3-Next's every `full_attention_interval`-th layer is full,
    // as its model reads the config.
    let text = std::fs::read_to_string(assets("tiny-qwen3.5/model/config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json.as_object_mut().unwrap().remove("layer_types");
    json["full_attention_interval"] = 2.into();
    let m = ModelShapes::of_json(&json.to_string(), "no layer_types").unwrap();
    let d = &m.dims;
    assert_eq!(d.linear_attention_layers(), d.num_hidden_layers / 2);
    close(
        d.attended_length(seq),
        (d.num_hidden_layers / 2) as f64 * seq as f64,
    );
}

/// A mixture of experts: every expert counted in the model state, only `top_k` of them in
/// a token's compute; each expert's MLP split over tp like a dense one, the router whole.
#[test]
fn experts_are_parameters_and_top_k_of_them_compute() {
    let m = ModelShapes::from_file(assets("tiny-qwen3-moe/model/config.json")).unwrap();
    let (experts, top_k, inter, sparse) = m.moe.unwrap();
    let expert_params = sparse * experts * 3 * inter * m.dims.hidden_size;
    let total = m.num_parameters() as f64;
    let expected = total - expert_params as f64 * (1.0 - top_k as f64 / experts as f64);
    assert!((m.active_parameters - expected).abs() < 1e-6);
    let local: usize = m.local(2).iter().map(|(_, n)| n).sum();
    let router = m
        .local(2)
        .into_iter()
        .find(|(n, _)| n.ends_with("mlp.gate.weight"))
        .unwrap();
    assert_eq!(
        router.1,
        experts * m.dims.hidden_size,
        "the router stays whole"
    );
    assert!(local < m.num_parameters());
}

/// DeepSeek's mixture (DeepSeek-V3, GLM-4 MoE): the routed experts count top-k of n in a
/// token's compute, the shared expert and the dense first layer wholly; latent attention's
/// generation cache holds kv_lora_rank + qk_rope_head_dim features per token and layer.
#[test]
fn deepseek_experts_and_the_latent_cache_are_counted() {
    let m = ModelShapes::from_file(assets("tiny-deepseek-v3/model/config.json")).unwrap();
    let (experts, per_token, inter, sparse) = m.moe.unwrap();
    // 8 experts, top 2 and one shared; layer 0 dense.
    assert_eq!((experts, per_token, inter, sparse), (8, 3, 32, 1));
    let h = m.dims.hidden_size;
    let routed = (experts * 3 * inter * h) as f64;
    let expected = m.num_parameters() as f64 - routed * (1.0 - 2.0 / 8.0);
    assert!((m.active_parameters - expected).abs() < 1e-6);
    // The kernels' head width: the query's 16 + 8 features (values, 12, padded to it).
    assert_eq!(m.dims.head_dim(), 24);
    let setup = cpu_setup(Strategy::Ddp, (1, 1));
    let round = generation_round(&m, &setup, 4, (10, 30));
    assert_eq!(round.kv_cache, 4 * 30 * 2 * (16 + 8) * 4);
}

/// Llama 4's mixture on its `moe_layers`: top-1 of the routed experts and the shared expert
/// in a token's compute, the dense layers' MLPs `intermediate_size_mlp` wide; the hub's
/// composite reads as its language model.
#[test]
fn llama4_experts_and_dense_widths_are_counted() {
    for dir in ["tiny-llama4", "tiny-llama4-vision"] {
        let m = ModelShapes::from_file(assets(&format!("{dir}/model/config.json"))).unwrap();
        // 4 experts, top 1 and the shared one, 32 wide; layers 1 and 2 sparse.
        assert_eq!(m.moe, Some((4, 2, 32, 2)), "{dir}");
        assert_eq!(m.dims.intermediate_size, 96, "{dir}");
        let h = m.dims.hidden_size;
        let routed = (4 * 3 * 32 * h * 2) as f64;
        let expected = m.num_parameters() as f64 - routed * (1.0 - 1.0 / 4.0);
        assert!((m.active_parameters - expected).abs() < 1e-6, "{dir}");
    }
}

/// Mistral 4's mixture reads as DeepSeek's (top 2 of 8 and the shared expert, layer 0
/// dense), its fused [experts, out, in] tensors counted top-k of n in a token's compute.
#[test]
fn mistral4_experts_are_counted() {
    let m = ModelShapes::from_file(assets("tiny-mistral4/model/config.json")).unwrap();
    assert_eq!(m.moe, Some((8, 3, 32, 1)));
    let routed = (8 * 3 * 32 * m.dims.hidden_size) as f64;
    let expected = m.num_parameters() as f64 - routed * (1.0 - 2.0 / 8.0);
    assert!((m.active_parameters - expected).abs() < 1e-6);
    // The kernels' head width: the query's 24 + 8 features (values, 12, padded to it).
    assert_eq!(m.dims.head_dim(), 32);
}

/// Gemma 4's mixture (`enable_moe_block`: routed experts beside every layer's dense MLP,
/// `top_k_experts` of `num_experts`, `moe_intermediate_size` wide), read through the
/// vision-language composite as its language model: top-k of n in a token's compute.
#[test]
fn gemma4_experts_are_counted() {
    let m = ModelShapes::from_file(assets("tiny-gemma4-moe-vision/model/config.json")).unwrap();
    // 4 experts, top 2, 32 wide, on all 4 layers.
    assert_eq!(m.moe, Some((4, 2, 32, 4)));
    let routed = (4 * 3 * 32 * m.dims.hidden_size * 4) as f64;
    let expected = m.num_parameters() as f64 - routed * (1.0 - 2.0 / 4.0);
    assert!(
        (m.active_parameters - expected).abs() < 1e-6,
        "{} active, {expected} expected",
        m.active_parameters
    );
    assert_eq!(m.experts(), Some(4));
}
