//! `cargo bench -p trl-runtime --bench long_context`: the longest sequence one training step
//! (forward, backward, AdamW update; batch 1, fp32) of the reference model fits in a fixed
//! per-rank memory budget, with the whole-matrix attention (`plain`), the blockwise one
//! (`flash`), the blockwise one with the LM head and loss fused in tiles (`flash_tiled`,
//! `use_liger_kernel`), with the MLPs in tiles too (`flash_tiled_mlp`, `tiled_mlp`), and with
//! activation checkpointing on top (`flash_tiled_mlp_ckpt`, `gradient_checkpointing`: each
//! decoder layer recomputed in backward) on the reference model and on an 8-layer one, at 1
//! rank and at 4 ranks of Ulysses, with the loss of both at one length (`-- --only=checkpointing`
//! runs just that; TRL_BENCH_BUDGET_MIB changes the budget, TRL_BENCH_RANKS the rank counts).
//! Each probe runs in a fresh process (1 compute thread) whose peak resident memory
//! over the step is compared with the budget; lengths are searched by doubling, then bisection
//! to 256 tokens. One JSON object per line on stdout; prose on stderr.
//!
//! Then Ulysses sequence parallelism (`sp`, blockwise attention and tiled loss) at 1, 2 and 4
//! ranks, each rank holding its chunk of the sequence: the longest sequence whose step fits the
//! same budget on every rank (rank 0's peak is measured; the ranks hold the same amounts).
//! And ring-attention context parallelism (`cp`) the same way, each rank holding two chunks of
//! 2 x ranks (head-tail balanced).

use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::time::Instant;

mod support;
use trl_runtime::config::launch::DistributedType;
use trl_runtime::config::parallelism::ParallelismConfig;
use trl_runtime::config::LaunchPlan;
use trl_runtime::context_parallel::SeqSplit;
use trl_runtime::data::Batch;
use trl_runtime::dist::DistContext;
use trl_runtime::nn::AttentionImpl;
use trl_runtime::parallel::CausalLm;
use trl_runtime::parallel::Checkpointing;
use trl_runtime::train::optim::{AdamW, AdamWConfig};
use trl_runtime::train::{peak_rss_bytes, reset_peak_rss};

/// Peak resident memory one rank may use during a step.
const DEFAULT_BUDGET_MIB: usize = 1024;

/// The budget: 1 GiB, or TRL_BENCH_BUDGET_MIB (a smaller one makes the 4-rank searches,
/// whose steps grow with the square of the length, finish sooner).
fn budget_mib() -> usize {
    std::env::var("TRL_BENCH_BUDGET_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_BUDGET_MIB)
}
const GRANULARITY: usize = 256;

/// Layers of the deeper model the checkpointing comparison also runs on: checkpointing keeps
/// one layer's activations instead of all of them, so what it gains grows with depth (4 layers
/// bound it below 2x; Qwen2-0.5B has 24).
const DEEP_LAYERS: usize = 8;

fn prepare(dir: &Path) {
    let config = support::reference_config(1048576);
    support::write_model_and_rows(dir, config.clone(), 1, 8);
    let mut deep = config;
    deep["num_hidden_layers"] = DEEP_LAYERS.into();
    support::write_model_and_rows(&dir.join("deep"), deep, 1, 8);
}

/// Rank counts of the checkpointing comparison: 1 and 4, or TRL_BENCH_RANKS (e.g. `1`: the
/// 4-rank searches take about an hour on 2 cores).
fn checkpointing_ranks() -> Vec<usize> {
    std::env::var("TRL_BENCH_RANKS")
        .ok()
        .map(|v| v.split(',').filter_map(|r| r.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4])
}

/// The checkpointing comparison on the model of `prefix` ("" or "deep/") with `layers`
/// layers, at 1 and 4 ranks (Ulysses), with the loss of both at one length.
fn checkpointing(prefix: &str, layers: usize, dir: &Path) {
    let mode = format!("{prefix}flash_attention_2+tiled+mlp");
    let ckpt = format!("{mode}+ckpt");
    for ranks in checkpointing_ranks() {
        let (plain, plain_s) = max_seq(&mode, ranks, dir);
        let (with, with_s) = max_seq(&ckpt, ranks, dir);
        for (what, seq, step_s) in [
            ("flash_tiled_mlp", plain, plain_s),
            ("flash_tiled_mlp_ckpt", with, with_s),
        ] {
            println!(
                "{{\"bench\":\"long_context\",\"mode\":\"{what}\",\"layers\":{layers},\"ranks\":{ranks},\"max_seq\":{seq},\"step_s\":{step_s:.3},\"budget_mib\":{}}}",
            budget_mib()
            );
        }
        println!(
            "{{\"bench\":\"long_context\",\"what\":\"checkpointing_over_none\",\"layers\":{layers},\"ranks\":{ranks},\"max_seq_ratio\":{:.3}}}",
            with as f64 / plain.max(1) as f64
        );
        if ranks == 1 {
            let at = plain.max(GRANULARITY);
            let (_, _, plain_loss) = probe_loss(&mode, 1, at, dir);
            let (_, _, ckpt_loss) = probe_loss(&ckpt, 1, at, dir);
            println!(
                "{{\"bench\":\"long_context\",\"what\":\"checkpointing_loss\",\"layers\":{layers},\"seq\":{at},\"loss\":{plain_loss},\"loss_checkpointed\":{ckpt_loss},\"rel_diff\":{:.2e}}}",
                (ckpt_loss - plain_loss).abs() / plain_loss.abs()
            );
        }
    }
}

/// One training step at `seq` tokens; prints the step's peak memory and time (rank 0).
fn worker(mode: &str, seq: usize, dir: &Path) {
    let (mode, dir) = match mode.strip_prefix("deep/") {
        Some(rest) => (rest, dir.join("deep")),
        None => (mode, dir.to_path_buf()),
    };
    let mut model = CausalLm::from_pretrained(dir.join("model"), DType::F32, &Device::Cpu).unwrap();
    // Launched as several ranks: split the sequence over all of them (Ulysses, or a ring).
    let (mode, ring) = match mode.strip_prefix("ring/") {
        Some(rest) => (rest, true),
        None => (mode, false),
    };
    let world = std::env::var("WORLD_SIZE").map_or(1, |w| w.parse().unwrap());
    let parallelism = match ring {
        true => ParallelismConfig {
            cp: world,
            ..ParallelismConfig::default()
        },
        false => ParallelismConfig {
            sp: world,
            ..ParallelismConfig::default()
        },
    };
    let ctx = DistContext::with_plan(LaunchPlan {
        distributed_type: DistributedType::MultiCpu,
        parallelism,
        ..LaunchPlan::default()
    })
    .unwrap();
    let split = SeqSplit::from_context(&ctx).unwrap();
    if let Some(split) = &split {
        model.split_sequences(split.clone()).unwrap();
    }
    let (mode, checkpointing) = match mode.strip_suffix("+ckpt") {
        Some(rest) => (rest, true),
        None => (mode, false),
    };
    let (mode, tiled_mlp) = match mode.strip_suffix("+mlp") {
        Some(rest) => (rest, true),
        None => (mode, false),
    };
    let (attn, tiled) = match mode.strip_suffix("+tiled") {
        Some(attn) => (attn, true),
        None => (mode, false),
    };
    model.attention = AttentionImpl::parse(attn).unwrap();
    model.tiled_loss = tiled;
    model.tiled_mlp = tiled_mlp;
    if checkpointing {
        model.checkpointing = Some(Checkpointing::new(false));
    }
    let mut opt = AdamW::for_params(&model.params, AdamWConfig::default()).unwrap();
    let vocab = model.config.vocab_size() as u32;
    let ids: Vec<u32> = (0..seq as u32).map(|i| (i * 7919 + 3) % vocab).collect();
    let ids = Tensor::from_vec(ids, (1, seq), &Device::Cpu).unwrap();
    let pos = Tensor::arange(0i64, seq as i64, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let batch = Batch {
        labels: ids.to_dtype(DType::I64).unwrap(),
        input_ids: ids,
        position_ids: pos,
        num_target_tokens: seq - 1,
        shifted_targets: None,
        attention_mask: None,
    };
    let part = batch.part(split.as_ref()).unwrap();
    let targets = part.targets().unwrap();
    let (ids, pos) = (part.input_ids, part.position_ids);
    trl_runtime::alloc::release_freed_memory();
    reset_peak_rss();
    let start = Instant::now();
    let loss = model.forward_targets(&ids, &pos, &targets).unwrap();
    let mean = (loss.sum / loss.count as f64).unwrap();
    let value = mean.to_scalar::<f32>().unwrap();
    let store = model.backward(&mean).unwrap();
    let grads = model
        .params
        .iter()
        .map(|(n, v)| (n.clone(), store.get(v.as_tensor()).unwrap().clone()))
        .collect();
    drop(store);
    opt.step(&model.params, &grads, 1e-4).unwrap();
    let secs = start.elapsed().as_secs_f64();
    if ctx.is_main_process() {
        println!(
            "probe {} {secs} {value}",
            peak_rss_bytes().unwrap_or(usize::MAX)
        );
    }
}

/// (peak bytes, step seconds) of one probe on `ranks` processes.
fn probe(mode: &str, ranks: usize, seq: usize, dir: &Path) -> (usize, f64) {
    let (peak, secs, _) = probe_loss(mode, ranks, seq, dir);
    (peak, secs)
}

/// (peak bytes, step seconds, loss) of one probe on `ranks` processes.
fn probe_loss(mode: &str, ranks: usize, seq: usize, dir: &Path) -> (usize, f64, f64) {
    let mut out = None;
    support::run_ranks(&format!("{mode}:{seq}"), ranks, dir, |line, _| {
        if let Some(rest) = line.strip_prefix("probe ") {
            let v: Vec<&str> = rest.split(' ').collect();
            out = Some((
                v[0].parse().unwrap(),
                v[1].parse().unwrap(),
                v[2].parse().unwrap(),
            ));
        }
    });
    let (peak, secs, loss) = out.expect("the probe reported nothing");
    eprintln!(
        "  {mode} on {ranks} rank(s), seq {seq}: peak {} MiB per rank, step {secs:.2} s",
        peak >> 20
    );
    (peak, secs, loss)
}

/// The longest multiple of GRANULARITY (which every rank count here divides) whose step fits
/// the budget on `ranks` processes, and its step time.
fn max_seq(mode: &str, ranks: usize, dir: &Path) -> (usize, f64) {
    let budget = budget_mib() << 20;
    let step = GRANULARITY;
    let (mut ok, mut ok_secs) = (0usize, f64::NAN);
    let mut seq = 2 * step;
    // Double until a length does not fit ...
    let mut bad = loop {
        let (peak, secs) = probe(mode, ranks, seq, dir);
        if peak > budget {
            break seq;
        }
        (ok, ok_secs) = (seq, secs);
        seq *= 2;
    };
    // ... then halve the gap.
    while bad - ok > step {
        let mid = (ok + bad) / 2 / step * step;
        let (peak, secs) = probe(mode, ranks, mid, dir);
        if peak > budget {
            bad = mid;
        } else {
            (ok, ok_secs) = (mid, secs);
        }
    }
    (ok, ok_secs)
}

fn main() {
    if let Ok(kind) = std::env::var("TRL_BENCH_WORKER") {
        let (mode, seq) = kind.split_once(':').unwrap();
        let dir = std::env::var("TRL_BENCH_DIR").unwrap();
        worker(mode, seq.parse().unwrap(), Path::new(&dir));
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    prepare(tmp.path());
    if let Some((mode, ranks, seq)) = std::env::args().find_map(|a| {
        let v: Vec<String> = a
            .strip_prefix("--probe=")?
            .split(':')
            .map(String::from)
            .collect();
        Some((
            v[0].clone(),
            v[1].parse::<usize>().ok()?,
            v[2].parse::<usize>().ok()?,
        ))
    }) {
        // One probe by hand: `cargo bench ... -- --probe=flash_attention_2+tiled:4:8192`.
        probe(&mode, ranks, seq, tmp.path());
        return;
    }
    eprintln!(
        "long_context bench: reference model, batch 1, fp32, one step incl. AdamW, budget {} MiB peak RSS per rank",
        budget_mib()
    );
    // `-- --only=checkpointing`: just the checkpointing comparison.
    if std::env::args().any(|a| a == "--only=checkpointing") {
        checkpointing("", 4, tmp.path());
        checkpointing("deep/", DEEP_LAYERS, tmp.path());
        return;
    }
    let mut found = Vec::new();
    let modes = [
        ("plain", "sdpa"),
        ("flash", "flash_attention_2"),
        ("flash_tiled", "flash_attention_2+tiled"),
        ("flash_tiled_mlp", "flash_attention_2+tiled+mlp"),
    ];
    for (mode, attn) in modes {
        let (seq, step_s) = max_seq(attn, 1, tmp.path());
        println!(
            "{{\"bench\":\"long_context\",\"mode\":\"{mode}\",\"ranks\":1,\"max_seq\":{seq},\"step_s\":{step_s:.3},\"budget_mib\":{}}}",
            budget_mib()
        );
        found.push(seq);
    }
    for (i, what) in [
        (1, "flash_over_plain"),
        (2, "flash_tiled_over_plain"),
        (3, "flash_tiled_mlp_over_plain"),
    ] {
        println!(
            "{{\"bench\":\"long_context\",\"what\":\"{what}\",\"ranks\":1,\"max_seq_ratio\":{:.3}}}",
            found[i] as f64 / found[0].max(1) as f64
        );
    }
    // Activation checkpointing (gradient_checkpointing): the same step keeping only each
    // layer's input, against the same kernels without it, on the reference model and on a
    // deeper one.
    checkpointing("", 4, tmp.path());
    checkpointing("deep/", DEEP_LAYERS, tmp.path());
    // Ulysses (sp) and ring attention (cp): the flash + tiled step with the sequence split
    // over the ranks. At 1 rank both are that step itself, measured once.
    let one = max_seq("flash_attention_2+tiled", 1, tmp.path());
    for (mode, worker) in [
        ("sp", "flash_attention_2+tiled"),
        ("cp", "ring/flash_attention_2+tiled"),
    ] {
        let mut found = Vec::new();
        for ranks in [1, 2, 4] {
            let (seq, step_s) = match ranks {
                1 => one,
                _ => max_seq(worker, ranks, tmp.path()),
            };
            println!(
                "{{\"bench\":\"long_context\",\"mode\":\"{mode}\",\"ranks\":{ranks},\"max_seq\":{seq},\"step_s\":{step_s:.3},\"budget_mib\":{}}}",
            budget_mib()
            );
            found.push(seq);
        }
        for (i, ranks) in [(1, 2), (2, 4)] {
            println!(
                "{{\"bench\":\"long_context\",\"mode\":\"{mode}\",\"what\":\"scaling\",\"ranks\":{ranks},\"max_seq_ratio_over_1_rank\":{:.3}}}",
                found[i] as f64 / found[0].max(1) as f64
            );
        }
    }
}
