//! `cargo trl plan`: every layout the hardware allows (a shipped profile with its mesh
//! sizes), its per-rank peak memory and step speed from `trl_runtime::parallel::estimate`,
//! which fit, and the fastest that does. `launch --profile auto` launches that pick.

use crate::profiles;
use std::path::PathBuf;
use trl_runtime::candle_core::DType;
use trl_runtime::config::{LaunchConfig, LaunchPlan, OffloadDevice};
use trl_runtime::nn::lora::{LoraConfig, Targets};
use trl_runtime::parallel::estimate::{
    self, estimate, generation_round, step_time, Estimate, Hardware, LinkSpeed, ModelShapes, Setup,
    StepTime, Workload,
};
use trl_runtime::parallel::Strategy;
use trl_runtime::train::registry;

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

#[derive(Debug, Clone, clap::Args)]
#[command(rename_all = "snake_case")]
pub struct PlanArgs {
    /// The model: its directory or its config.json (no weights are read).
    #[arg(long)]
    pub model: PathBuf,
    /// Tokens per row (TRL's max_length).
    #[arg(long, default_value_t = 1024)]
    pub seq: usize,
    /// Rows per device per micro-batch (per_device_train_batch_size).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Micro-batches per optimizer step (gradient_accumulation_steps): ZeRO-3 / FSDP hold
    /// gradient slices through the loss's backward only after the first.
    #[arg(long, default_value_t = 1)]
    pub gradient_accumulation_steps: usize,
    /// GPUs per machine; without it, CPU processes on this machine.
    #[arg(long)]
    pub gpus: Option<usize>,
    /// Memory of one GPU, like 80GiB or 141GB (default: by --gpu_kind).
    #[arg(long)]
    pub gpu_memory: Option<String>,
    /// h100, h200, a100 or l40s: the matmul rate and links assumed.
    #[arg(long, default_value = "h100")]
    pub gpu_kind: String,
    /// Host memory of one machine, like 2TiB: offloaded optimizer state must fit in it
    /// (default: this machine's).
    #[arg(long)]
    pub host_memory: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub num_machines: usize,
    /// CPU processes (without --gpus).
    #[arg(long, default_value_t = 2)]
    pub num_processes: usize,
    /// Train LoRA adapters on a frozen base (`--use_peft`, or with a value as TRL's flags
    /// take one: `--use_peft true`).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set, default_value = "false")]
    pub use_peft: bool,
    #[arg(long, default_value_t = 16)]
    pub lora_r: usize,
    /// The adapters' input dropout (TRL's default): each adapted layer keeps a copy of its
    /// input for backward.
    #[arg(long, default_value_t = 0.05)]
    pub lora_dropout: f64,
    /// peft's target_modules (default all-linear).
    #[arg(long, num_args = 1.., default_value = "all-linear")]
    pub lora_target_modules: Vec<String>,
    /// peft's target_parameters: parameters adapted directly (gpt-oss's
    /// `mlp.experts.gate_up_proj`).
    #[arg(long, num_args = 1..)]
    pub lora_target_parameters: Vec<String>,
    /// What trains (a registered trainer: `sft`; `dpo`, whose micro-batch of --batch pairs
    /// is twice as many sequences).
    #[arg(long, default_value = "sft", value_parser = clap::builder::PossibleValuesParser::new(trl_runtime::train::registry::names()))]
    pub trainer: String,
    /// TRL's sync_ref_model, for a trainer that takes it (dpo: TR-DPO's synced reference, a
    /// copy of the weights on every rank).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set, default_value = "false")]
    pub sync_ref_model: bool,
    /// The trainer's beta, for a trainer that takes it (grpo: above 0 its KL term holds a
    /// reference, a copy of the weights on every rank; TRL's default 0 holds none).
    #[arg(long)]
    pub beta: Option<f64>,
    /// The trainer's reward_funcs, for a trainer that takes them (grpo: each reward model
    /// named by its directory is held whole on every rank).
    #[arg(long = "reward_funcs", num_args = 1..)]
    pub reward_funcs: Vec<String>,
    /// The teacher, for a trainer that takes one (distillation: a frozen model held as the
    /// trained one is, counted by its checkpoint's parameters).
    #[arg(long = "teacher_model_name_or_path")]
    pub teacher_model_name_or_path: Option<String>,
    /// Only layouts with (true) or without (false) activation checkpointing; both by default.
    #[arg(long)]
    pub gradient_checkpointing: Option<bool>,
    /// A generation round (an online trainer's sampling, `cargo trl generate`): completions
    /// of this many tokens after prompts of --seq tokens; the pick's KV cache and gathered
    /// weights are shown.
    #[arg(long = "max_completion_length", alias = "max-completion-length")]
    pub max_completion_length: Option<usize>,
    /// Rows generated together in a round (TRL's generation_batch_size; default --batch).
    #[arg(long = "generation_batch_size", alias = "generation-batch-size")]
    pub generation_batch_size: Option<usize>,
    /// Show every layout, those that do not fit too.
    #[arg(long)]
    pub all: bool,
    /// Show the formulas with their numbers for the pick.
    #[arg(long)]
    pub explain: bool,
}

/// One layout: a profile and its mesh, what a rank holds, how fast it runs.
pub struct Row {
    pub profile: &'static str,
    pub config: LaunchConfig,
    pub setup: Setup,
    pub estimate: Estimate,
    pub time: StepTime,
    /// Per-rank peak including the process's base.
    pub peak: usize,
    pub fits: bool,
}

impl Row {
    /// The launch flags that run this layout.
    pub fn flags(&self) -> String {
        let d = self.setup.dims;
        let mut f = format!(
            "--profile {} --num_processes {}",
            self.profile,
            d.dp_replicate * d.dp_shard * d.tp * d.cp * d.sp
        );
        if self.setup.offload_optimizer {
            f += match (&self.config.deepspeed, self.setup.offload_params) {
                (Some(_), false) => " --offload_optimizer_device cpu",
                (Some(_), true) => " --offload_optimizer_device cpu --offload_param_device cpu",
                (None, _) => " --fsdp_offload_params true",
            };
        }
        for (name, v) in [
            ("dp_replicate", d.dp_replicate),
            ("dp_shard", d.dp_shard),
            ("tp", d.tp),
            ("cp", d.cp),
            ("sp", d.sp),
        ] {
            f += &format!(" --parallelism_config_{name}_size {v}");
        }
        if self.setup.ep > 1 {
            f += &format!(" --parallelism_config_ep_size {}", self.setup.ep);
        }
        f
    }
}

/// The machine: memory per rank, rate, links, and which profiles are its.
pub struct Machine {
    pub gpu: bool,
    pub per_machine: usize,
    pub machines: usize,
    pub memory: usize,
    /// Host memory of one machine (where offloaded optimizer state lives).
    pub host_memory: usize,
    /// What a process holds before the model (runtime; on a GPU the CUDA context and NCCL's
    /// buffers).
    pub base: usize,
    /// Compute threads of a CPU rank, as `cargo trl launch` gives them (unused on GPUs).
    pub threads: usize,
    pub hardware: Hardware,
}

/// Dense bf16 peak (FLOP/s), memory, NVLink and inter-node bus bandwidth of a GPU kind. The
/// rate used is [`GPU_MFU`] of peak.
/// The share of a GPU's datasheet bf16 peak our step sustains: 28.8% measured at batch 8 x
/// 2048 tokens of the Qwen2-0.5B shape on an H200 (docs/gpu.md; TRL reaches ~42% there). Small
/// batches run below it (21% at batch 2), so the plan over-predicts them.
const GPU_MFU: f64 = 0.29;

fn gpu_kind(kind: &str) -> Result<(f64, f64, LinkSpeed, LinkSpeed), String> {
    // NCCL all-reduce: ~10 us per collective over NVLink / PCIe, ~30 us across machines.
    let link = |latency: f64, bandwidth: f64| LinkSpeed { latency, bandwidth };
    let (nvlink, ib) = (1e-5, 3e-5);
    match kind.to_ascii_lowercase().as_str() {
        "h100" => Ok((989e12, 80.0 * GIB, link(nvlink, 360e9), link(ib, 40e9))),
        "h200" => Ok((989e12, 141.0 * GIB, link(nvlink, 360e9), link(ib, 40e9))),
        "a100" => Ok((312e12, 80.0 * GIB, link(nvlink, 230e9), link(ib, 20e9))),
        "l40s" => Ok((362e12, 48.0 * GIB, link(2e-5, 25e9), link(ib, 10e9))),
        other => Err(format!(
            "--gpu_kind '{other}': use h100, h200, a100 or l40s"
        )),
    }
}

/// The host backend's collectives between `processes` ranks here, measured.
fn cpu_link(processes: usize) -> Result<LinkSpeed, String> {
    estimate::host_all_reduce_speed(processes.max(2))
        .map_err(|e| format!("cannot measure the host backend's all-reduce: {e}"))
}

/// This machine's memory (MemTotal).
fn host_memory() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<usize>().ok()
        })
        .map_or(8 << 30, |kib| kib * 1024)
}

impl Machine {
    pub fn from_args(args: &PlanArgs) -> Result<Self, String> {
        match args.gpus {
            Some(gpus) => {
                let (peak, memory, intra, inter) = gpu_kind(&args.gpu_kind)?;
                let memory = match &args.gpu_memory {
                    Some(m) => crate::merge::parse_size("--gpu_memory", m)?,
                    None => memory as usize,
                };
                let host = match &args.host_memory {
                    Some(m) => crate::merge::parse_size("--host_memory", m)?,
                    None => host_memory(),
                };
                Ok(Machine {
                    gpu: true,
                    per_machine: gpus.max(1),
                    machines: args.num_machines.max(1),
                    memory,
                    host_memory: host,
                    base: (1.5 * GIB) as usize,
                    threads: 1,
                    hardware: Hardware {
                        flops: GPU_MFU * peak,
                        matmul_share: 1.0,
                        intra,
                        inter,
                        per_machine: gpus.max(1),
                        // ZeRO-Offload's update: fp32 gradients down and bf16 weights up
                        // over PCIe (~25 GB/s), AdamW on the host's share of its cores
                        // (~1 G parameters/s): a table figure, not measured.
                        offload_params_per_s: 1.0 / (1.0 / 1e9 + 6.0 / 25e9),
                        comm_overlaps: true,
                        logit_seconds: 0.0,
                        adapter_element_seconds: 0.0,
                    },
                })
            }
            None => Self::cpu(args.num_processes.max(1), args.num_machines.max(1)),
        }
    }

    /// `processes` CPU ranks on each machine like this one, sharing its memory and cores.
    pub fn cpu(processes: usize, machines: usize) -> Result<Self, String> {
        // A rank's matmul rate with every rank's threads busy, the share of its step the
        // matmuls take and what LoRA adds, with the threads `cargo trl launch` gives a rank.
        let threads = crate::machine::cpu_threads_per_process(processes);
        let host = host_memory();
        Ok(Machine {
            gpu: false,
            per_machine: processes,
            machines,
            memory: host / processes,
            host_memory: host,
            base: estimate::CPU_PROCESS_RSS,
            threads,
            hardware: Hardware::cpu(
                estimate::cpu_step_rates(processes, threads),
                processes,
                cpu_link(processes)?,
                estimate::cpu_whole_logits_seconds() * processes as f64,
            ),
        })
    }

    /// What a rank holds besides the estimate under `dims`: the process, and on a CPU the
    /// host backend's shared-memory rings of the groups it talks over.
    fn base_for(&self, dims: trl_runtime::config::parallelism::ParallelDims) -> usize {
        match self.gpu {
            true => self.base,
            false => self.base + estimate::cpu_ring_bytes(dims, self.per_machine),
        }
    }

    /// The shipped profiles of this kind of machine, one per data-parallel strategy.
    fn profiles(&self) -> &'static [&'static str] {
        match self.gpu {
            true => &["multi_gpu", "zero1", "zero2", "zero3", "fsdp2"],
            false => &["multi_cpu", "zero2_cpu", "zero3_cpu", "fsdp2_cpu"],
        }
    }
}

/// What is being trained, from the plan's flags or a program's training arguments.
pub struct Work {
    /// The model's parameters as its own skeleton and tp plan give them.
    pub model: ModelShapes,
    pub seq: usize,
    pub batch: usize,
    pub micro_batches: usize,
    pub lora: Option<LoraConfig>,
    pub checkpointing: Vec<bool>,
    /// What the trainer's rows cost a rank (sequences per row, weight copies).
    pub workload: Workload,
    /// bf16 on GPUs unless the run says otherwise.
    pub dtype: Option<DType>,
}

/// The model a directory's (or a file's) config.json describes, built as a skeleton.
pub fn read_model(path: &std::path::Path) -> Result<ModelShapes, String> {
    // A hub name reads its snapshot in the Hugging Face cache.
    let path = &trl_runtime::hub::resolve(trl_runtime::hub::RepoKind::Model, path)
        .map_err(|m| format!("--model {}: {m}", path.display()))?;
    let file = match path.is_dir() {
        true => path.join("config.json"),
        false => path.to_path_buf(),
    };
    ModelShapes::from_file(&file).map_err(|e| format!("--model {}: {e}", path.display()))
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every layout of `work` on `machine`, fastest first among those that fit.
pub fn rows(work: &Work, machine: &Machine) -> Vec<Row> {
    let world = machine.per_machine * machine.machines;
    let model = &work.model;
    let mut out = Vec::new();
    for &profile in machine.profiles() {
        let Ok(base) = profiles::load(profile) else {
            continue;
        };
        // Tensor and sequence splits stay within a machine; the rest is data-parallel.
        for tp in divisors(machine.per_machine) {
            for split in divisors(machine.per_machine / tp) {
                // Ring attention under FSDP (Accelerate's cp), Ulysses under DeepSpeed (ALST).
                let deepspeed = profile.starts_with("zero");
                let (cp, sp) = match (split, deepspeed) {
                    (1, _) => (1, 1),
                    (s, false) => (s, 1),
                    (s, true) => (1, s),
                };
                if tp > 1 && (cp > 1 || sp > 1) && machine.gpu && deepspeed {
                    continue;
                }
                let mut config = base.clone();
                config.num_processes = Some(world as u32);
                config.num_machines = machine.machines as u32;
                config.use_cpu = !machine.gpu;
                let dp = world / (tp * cp * sp);
                let p = &mut config.parallelism;
                (p.tp, p.cp, p.sp) = (tp, cp, sp);
                let strategy = Strategy::from_plan(&LaunchPlan::from_config(&config));
                // Over several machines FSDP may also shard within a machine and replicate
                // across them (HSDP: dp_replicate = machines).
                let hybrid = matches!(strategy, Strategy::Fsdp(..))
                    && machine.machines > 1
                    && dp.is_multiple_of(machine.machines)
                    && dp > machine.machines;
                let replicas: &[usize] = match hybrid {
                    true => &[1, machine.machines],
                    false => &[1],
                };
                for &replicate in replicas {
                    let mut config = config.clone();
                    let p = &mut config.parallelism;
                    (p.dp_replicate, p.dp_shard) = match strategy {
                        Strategy::Ddp => (Some(dp), Some(1)),
                        _ => (Some(replicate), Some(dp / replicate)),
                    };
                    let plan = LaunchPlan::from_config(&config);
                    let Ok(dims) = plan.resolve(world) else {
                        continue;
                    };
                    // The splits the model allows: heads over tp (and sp), rows over 2 cp chunks.
                    if !model.splits_over(tp, sp) || !work.seq.is_multiple_of(2 * cp * sp) {
                        continue;
                    }
                    let dtype = work.dtype.unwrap_or(match machine.gpu {
                        true => DType::BF16,
                        false => DType::F32,
                    });
                    // On GPUs the sharded strategies may keep state in host memory: (optimizer,
                    // parameters). DeepSpeed offloads the optimizer (offload_optimizer_device)
                    // and under ZeRO-3 the parameters too (offload_param_device); FSDP's
                    // offload_params moves both.
                    let offloads: &[(bool, bool)] = match (machine.gpu, strategy, deepspeed) {
                        (true, Strategy::Zero(_), _) => &[(false, false), (true, false)],
                        (true, Strategy::Fsdp(..), true) => {
                            &[(false, false), (true, false), (true, true)]
                        }
                        (true, Strategy::Fsdp(..), false) => &[(false, false), (true, true)],
                        _ => &[(false, false)],
                    };
                    // A mixture of experts may also split its experts over ep data-parallel
                    // ranks (out of dp_shard under ZeRO / FSDP), where the experts divide.
                    let ep_ranks = match strategy {
                        Strategy::Ddp => dims.dp_replicate * dims.dp_shard,
                        _ => dims.dp_shard,
                    };
                    let eps: Vec<usize> = match model.experts() {
                        Some(e) => divisors(ep_ranks)
                            .into_iter()
                            .filter(|ep| e.is_multiple_of(*ep))
                            .collect(),
                        None => vec![1],
                    };
                    for (&checkpointing, &(offload, offload_params), &ep) in work
                        .checkpointing
                        .iter()
                        .flat_map(|c| offloads.iter().map(move |o| (c, o)))
                        .flat_map(|(c, o)| eps.iter().map(move |ep| (c, o, ep)))
                    {
                        let mut config = config.clone();
                        config.parallelism.ep = ep;
                        if let Some(ds) = config.deepspeed.as_mut().filter(|_| offload) {
                            ds.offload_optimizer_device = OffloadDevice::Cpu;
                            if offload_params {
                                ds.offload_param_device = OffloadDevice::Cpu;
                            }
                        }
                        if let Some(fsdp) = config.fsdp.as_mut().filter(|_| offload) {
                            fsdp.offload_params = true;
                        }
                        let launch_plan = LaunchPlan::from_config(&config);
                        let mut setup = Setup {
                            strategy,
                            dims,
                            ep: config.parallelism.ep,
                            dtype,
                            lora: work.lora.clone(),
                            batch: work.batch,
                            micro_batches: work.micro_batches,
                            seq: work.seq,
                            checkpointing,
                            offload_optimizer: offload,
                            offload_params,
                            reduce_units: trl_runtime::parallel::zero2_units(
                                &launch_plan,
                                model.dims.hidden_size,
                            ),
                            reference_copy: false,
                            side_parameters: 0,
                            held_parameters: 0,
                            gpu: machine.gpu,
                            // As trained by default: a mixture of experts' config has a
                            // non-zero router_aux_loss_coef (0.001 when it names none).
                            router_loss: true,
                            threads: machine.threads,
                        };
                        setup.apply(&work.workload);
                        let estimate = estimate(model, &setup);
                        let time = step_time(model, &setup, &machine.hardware);
                        let peak = estimate.peak() + machine.base_for(dims);
                        out.push(Row {
                            profile,
                            config: config.clone(),
                            // Offloaded state shares the machine's host memory.
                            fits: peak <= machine.memory
                                && estimate.host() * machine.per_machine <= machine.host_memory,
                            setup,
                            estimate,
                            time,
                            peak,
                        });
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| {
        b.fits.cmp(&a.fits).then(
            b.time
                .tokens_per_second
                .total_cmp(&a.time.tokens_per_second),
        )
    });
    out
}

fn gib(b: usize) -> String {
    let g = b as f64 / GIB;
    match g < 1.0 {
        true => format!("{:.0}M", b as f64 / MIB),
        false => format!("{g:.1}G"),
    }
}

/// One table line.
fn line(r: &Row) -> String {
    let d = r.setup.dims;
    let e = &r.estimate;
    format!(
        "{:<4} {:<10} {:>3} {:>3} {:>3} {:>3} {:>3} {:>3} {:<4} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>10.0}",
        if r.fits { "fits" } else { "OOM" },
        match (r.setup.offload_optimizer, r.setup.offload_params) {
            (true, false) => format!("{}+off", r.profile),
            (true, true) => format!("{}+offp", r.profile),
            _ => r.profile.to_string(),
        },
        d.dp_replicate,
        d.dp_shard,
        d.tp,
        d.cp,
        d.sp,
        r.setup.ep,
        if r.setup.checkpointing { "on" } else { "off" },
        gib(e.parameters),
        gib(e.gradients),
        gib(e.optimizer),
        gib(e.activations + e.logits),
        gib(e.step_buffers.max(e.update_buffers)),
        gib(r.peak),
        r.time.tokens_per_second
    )
}

pub fn run(args: &PlanArgs) -> Result<String, String> {
    let model = read_model(&args.model)?;
    if !(0.0..1.0).contains(&args.lora_dropout) {
        return Err(format!(
            "--lora_dropout {} must be in [0, 1)",
            args.lora_dropout
        ));
    }
    let lora = args.use_peft.then(|| {
        let targets = match args.lora_target_modules.as_slice() {
            [one] if one.eq_ignore_ascii_case("all-linear") => Targets::AllLinear,
            names => Targets::Names(names.to_vec()),
        };
        LoraConfig {
            target_parameters: args.lora_target_parameters.clone(),
            ..LoraConfig::new(
                args.lora_r,
                2.0 * args.lora_r as f64,
                args.lora_dropout,
                targets,
            )
        }
    });
    // A target the model does not have would plan no adapters.
    if let Some(lora) = &lora {
        model.check_lora(lora).map_err(|e| e.to_string())?;
    }
    let work = Work {
        model,
        seq: args.seq,
        batch: args.batch,
        micro_batches: args.gradient_accumulation_steps,
        lora,
        checkpointing: match args.gradient_checkpointing {
            Some(c) => vec![c],
            None => vec![true, false],
        },
        workload: workload(
            &args.trainer,
            args.sync_ref_model,
            args.beta,
            (
                &args.reward_funcs,
                args.teacher_model_name_or_path.as_deref(),
            ),
        )?,
        dtype: None,
    };
    let machine = Machine::from_args(args)?;
    let rows = rows(&work, &machine);
    let mut out = vec![format!(
        "{} ({} parameters{}), {} rows x {} tokens per device, {} x {} {} of {} each",
        args.model.display(),
        work.model.num_parameters(),
        if args.use_peft {
            format!(", LoRA r {}", args.lora_r)
        } else {
            String::new()
        },
        args.batch,
        args.seq,
        machine.machines,
        machine.per_machine,
        if machine.gpu {
            format!("{} GPU(s)", args.gpu_kind)
        } else {
            "CPU process(es)".into()
        },
        gib(machine.memory)
    )];
    out.push(format!(
        "{:<4} {:<10} {:>3} {:>3} {:>3} {:>3} {:>3} {:>3} {:<4} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>10}",
        "", "profile", "rep", "shd", "tp", "cp", "sp", "ep", "ckpt", "params", "grads", "optim", "activ", "buffers", "peak", "tokens/s"
    ));
    let shown: Vec<&Row> = rows.iter().filter(|r| r.fits || args.all).collect();
    out.extend(shown.iter().map(|r| line(r)));
    if shown.len() < rows.len() {
        out.push(format!(
            "({} layouts that do not fit left out: --all shows them)",
            rows.len() - shown.len()
        ));
    }
    out.push(format!(
        "peak: per rank, with {} for the process itself{}; buffers: the larger of backward's and the update's",
        gib(machine.base),
        match machine.gpu {
            true => "",
            false => " and 16M of shared-memory rings per group a rank talks over",
        }
    ));
    match rows.first().filter(|r| r.fits) {
        Some(best) => {
            out.push(format!(
                "pick: cargo trl launch {} (gradient_checkpointing={})",
                best.flags(),
                best.setup.checkpointing
            ));
            if let Some(completion) = args.max_completion_length {
                out.push(generation_line(&work.model, best, args, completion, &machine));
            }
            if best.estimate.host() > 0 {
                let what = match best.estimate.host_parameters > 0 {
                    true => "its parameter slices, gradient slices and optimizer state live",
                    false => "its optimizer state (and gradient slices) live",
                };
                out.push(format!(
                    "  {what} in host memory: {} per rank, {} of the machine's {}",
                    gib(best.estimate.host()),
                    gib(best.estimate.host() * machine.per_machine),
                    gib(machine.host_memory)
                ));
            }
            if args.explain {
                out.extend(best.estimate.explain.iter().map(|l| format!("  {l}")));
                let t = best.time;
                out.push(format!(
                    "  time per step: compute {:.3}s, data-parallel comm {:.3}s ({}), model-parallel comm {:.3}s",
                    t.compute,
                    t.data_parallel,
                    match machine.hardware.comm_overlaps {
                        true => "overlapped",
                        false => "added: the host backend runs on the compute's cores",
                    },
                    t.model_parallel
                ));
                if let Some(x) = estimate::ep_exchange(&work.model, &best.setup) {
                    out.push(format!(
                        "  ep {}: {} of {} experts per sparse layer per rank; {:.0} all-to-alls a step send {} per rank (the model-parallel comm above)",
                        best.setup.ep,
                        x.experts_per_rank,
                        work.model.experts().unwrap_or(0),
                        x.count,
                        gib(x.bytes as usize)
                    ));
                }
                out.push(format!(
                    "  rate: {:.1} GFLOP/s of matmuls per rank, matmuls {:.0}% of the compute{}",
                    machine.hardware.flops / 1e9,
                    100.0 * machine.hardware.matmul_share,
                    match machine.gpu {
                        true => " (the GPU table's MFU)",
                        false => " (both measured on this machine when planning)",
                    }
                ));
                if best.setup.lora.is_some() && machine.hardware.adapter_element_seconds > 0.0 {
                    out.push(format!(
                        "  LoRA: {:.1} ns per token and adapted layer's input and output feature beyond its FLOPs (measured)",
                        machine.hardware.adapter_element_seconds * 1e9
                    ));
                }
            }
        }
        None => out.push(match machine.gpu {
            true => format!(
                "nothing fits: lower --seq or --batch, use --use_peft, add GPUs or machines, or offload the optimizer state to more host memory than this machine's {} (--host_memory)",
                gib(machine.host_memory)
            ),
            false => "nothing fits: lower --seq or --batch, use --use_peft, or add machines".into(),
        }),
    }
    Ok(out.join("\n"))
}

/// What a generation round adds to the pick: its KV cache and, under ZeRO-3 / FSDP, the
/// whole model gathered once when that fits beside the training peak (else per unit).
fn generation_line(
    model: &ModelShapes,
    best: &Row,
    args: &PlanArgs,
    completion: usize,
    machine: &Machine,
) -> String {
    let rows = args.generation_batch_size.unwrap_or(args.batch);
    let tokens = args.seq + completion;
    let g = generation_round(model, &best.setup, rows, (args.seq, tokens));
    let gather = match g.gathered_weights {
        0 => String::new(),
        w if best.peak + g.kv_cache + g.prefill + w <= machine.memory => {
            format!(
                "; the sharded model gathered whole once per round: {} more",
                gib(w)
            )
        }
        w => format!(
            "; gathering the whole model ({}) would not fit: each unit is gathered per forward",
            gib(w)
        ),
    };
    format!(
        "  generation round: {rows} rows x {tokens} tokens, KV cache {} per rank, prefill transient {}{gather}",
        gib(g.kv_cache),
        gib(g.prefill)
    )
}

/// What trainer `name` costs a rank per row, with TRL's sync_ref_model, beta, reward_funcs
/// and teacher_model_name_or_path when given (refused for a trainer that takes no such
/// argument, naming those that do).
fn workload(
    name: &str,
    sync_ref_model: bool,
    beta: Option<f64>,
    (reward_funcs, teacher): (&[String], Option<&str>),
) -> Result<Workload, String> {
    let kind = registry::find(name).ok_or_else(|| format!("--trainer {name}: no such trainer"))?;
    let mut flags: Vec<String> = Vec::new();
    if sync_ref_model {
        flags.extend(["--sync_ref_model".into(), "true".into()]);
    }
    if let Some(beta) = beta {
        flags.extend(["--beta".into(), beta.to_string()]);
    }
    if !reward_funcs.is_empty() {
        flags.push("--reward_funcs".into());
        flags.extend(reward_funcs.iter().cloned());
    }
    if let Some(t) = teacher {
        flags.extend(["--teacher_model_name_or_path".into(), t.to_string()]);
    }
    if let Some(read) = (kind.read)(&flags) {
        return Ok(read.workload);
    }
    // Each flag alone names the trainers that take it.
    let mut why = Vec::new();
    for (flag, given) in [
        ("--sync_ref_model", sync_ref_model),
        ("--beta", beta.is_some()),
        ("--reward_funcs", !reward_funcs.is_empty()),
        ("--teacher_model_name_or_path", teacher.is_some()),
    ] {
        let alone: Vec<String> = match flag {
            "--beta" => vec![flag.into(), beta.unwrap_or(0.0).to_string()],
            "--reward_funcs" => [vec![flag.to_string()], reward_funcs.to_vec()].concat(),
            "--teacher_model_name_or_path" => vec![flag.into(), teacher.unwrap_or("").into()],
            _ => vec![flag.into(), "true".into()],
        };
        if !given || (kind.read)(&alone).is_some() {
            continue;
        }
        let takers: Vec<String> = registry::all()
            .iter()
            .filter(|k| (k.read)(&alone).is_some())
            .map(|k| format!("--trainer {}", k.name))
            .collect();
        why.push(format!(
            "{flag}: the {name} trainer takes no such argument; {} does",
            takers.join(" or ")
        ));
    }
    Err(why.join("; "))
}

/// `launch --profile auto`: the fastest layout that fits for the program's training arguments
/// `t` (model, max_length, per_device_train_batch_size, LoRA, checkpointing, precision) on
/// this machine's GPUs, or its CPU with `--num_processes` (2 unless given) processes. Prints
/// why.
pub fn auto(
    t: &trl_runtime::train::TrainingArguments,
    workload: Workload,
    use_cpu: bool,
    processes: Option<u32>,
) -> Result<LaunchConfig, String> {
    eprintln!(
        "auto: planning {} at max_length {}, per_device_train_batch_size {}, gradient_accumulation_steps {}, gradient_checkpointing {}{}",
        t.model_name_or_path.display(),
        t.max_length,
        t.per_device_train_batch_size,
        t.gradient_accumulation_steps,
        t.gradient_checkpointing,
        if t.use_peft { ", LoRA" } else { "" }
    );
    // A trainer whose rows are several sequences (DPO's pairs) or which keeps a copy of the
    // weights (TR-DPO) is planned as `cargo trl plan --trainer NAME` plans it.
    if let Some(what) = workload.describe(t.per_device_train_batch_size) {
        eprintln!("auto: planning for {what}");
    }
    let model = read_model(&t.model_name_or_path)?;
    let gpus = if use_cpu {
        0
    } else {
        crate::machine::gpus_present()
    };
    let machine = match gpus {
        0 => Machine::cpu(processes.unwrap_or(2) as usize, 1)?,
        n => {
            // The first GPU's kind and memory, as nvidia-smi reports them.
            let smi = std::process::Command::new("nvidia-smi")
                .args([
                    "--query-gpu=name,memory.total",
                    "--format=csv,noheader,nounits",
                ])
                .output()
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                .unwrap_or_default();
            let first = smi.lines().next().unwrap_or("");
            let kind = ["H200", "H100", "A100", "L40S"]
                .into_iter()
                .find(|k| first.to_ascii_uppercase().contains(k))
                .unwrap_or("H100")
                .to_ascii_lowercase();
            let memory = first
                .split(',')
                .nth(1)
                .and_then(|m| m.trim().parse::<f64>().ok())
                .map(|mib| format!("{mib}MiB"));
            Machine::from_args(&PlanArgs {
                model: t.model_name_or_path.clone(),
                seq: t.max_length,
                batch: t.per_device_train_batch_size,
                gradient_accumulation_steps: t.gradient_accumulation_steps,
                gpus: Some(processes.map_or(n, |p| p as usize)),
                gpu_memory: memory,
                gpu_kind: kind,
                host_memory: None,
                num_machines: 1,
                num_processes: n,
                use_peft: t.use_peft,
                lora_r: t.lora_r,
                lora_dropout: t.lora_dropout,
                lora_target_modules: vec![],
                lora_target_parameters: vec![],
                // The machine does not depend on the trainer (`work.workload` does).
                trainer: registry::names()[0].into(),
                sync_ref_model: false,
                beta: None,
                reward_funcs: vec![],
                teacher_model_name_or_path: None,
                gradient_checkpointing: None,
                max_completion_length: None,
                generation_batch_size: None,
                all: false,
                explain: false,
            })?
        }
    };
    let work = Work {
        seq: t.max_length,
        batch: t.per_device_train_batch_size,
        micro_batches: t.gradient_accumulation_steps,
        lora: t.lora(&model.dims.model_type),
        checkpointing: vec![t.gradient_checkpointing],
        workload,
        dtype: t
            .compute_dtype()
            .ok()
            .filter(|d| *d != DType::F32 || !machine.gpu),
        model,
    };
    let rows = rows(&work, &machine);
    let Some(best) = rows.first().filter(|r| r.fits) else {
        return Err(format!(
            "--profile auto: no layout fits {} at max_length {} and per_device_train_batch_size {} in {} per rank (cargo trl plan --model {} --all shows each one's peak)",
            t.model_name_or_path.display(),
            t.max_length,
            t.per_device_train_batch_size,
            gib(machine.memory),
            t.model_name_or_path.display()
        ));
    };
    let runner_up = rows
        .iter()
        .skip(1)
        .find(|r| r.fits && r.profile != best.profile);
    eprintln!(
        "auto: {} over {} rank(s) (mesh dp_replicate={} dp_shard={} tp={} cp={} sp={}): predicted peak {} per rank of {}, {:.0} tokens/s{}",
        best.profile,
        best.setup.dims.dp_replicate * best.setup.dims.dp_shard * best.setup.dims.tp * best.setup.dims.cp * best.setup.dims.sp,
        best.setup.dims.dp_replicate,
        best.setup.dims.dp_shard,
        best.setup.dims.tp,
        best.setup.dims.cp,
        best.setup.dims.sp,
        gib(best.peak),
        gib(machine.memory),
        best.time.tokens_per_second,
        match runner_up {
            Some(r) => format!("; next: {} at {:.0} tokens/s, peak {}", r.profile, r.time.tokens_per_second, gib(r.peak)),
            None => String::new(),
        }
    );
    let mut config = best.config.clone();
    config.source = format!("profile auto ({})", best.profile);
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use trl_runtime::train::kinds::{read_as, Scaffold, TrainerKind};
    use trl_runtime::train::SFTConfig;

    /// A third trainer registered from here, nothing in cargo-trl naming it: SFT's arguments,
    /// each row 4 sequences and a copy of the weights, scaffolded from SFT's files.
    static TEST_TRAINER: TrainerKind = TrainerKind {
        name: "test-four",
        about: "a test trainer",
        read: |args| {
            read_as::<SFTConfig>(args, |_| Workload {
                sequences_per_row: 4,
                weight_copies: 1,
                ..Workload::default()
            })
        },
        scaffold: Scaffold {
            config: "templates/sft/sft.yaml",
            data: &[("data/train.jsonl", "assets/tiny/data/train.jsonl")],
            config_type: "SFTConfig",
            cli_type: "SftCli",
            task_type: None,
            model_wrapper: None,
            summary: "A test trainer",
            example_flag: "--learning_rate 1e-3",
            data_note: "",
            formats: "prompt/completion",
            metric: "accuracy",
            items: "",
            setup: "",
        },
    };

    #[derive(clap::Parser)]
    struct Plan {
        #[command(flatten)]
        args: PlanArgs,
    }

    #[derive(clap::Parser)]
    struct New {
        #[command(flatten)]
        args: crate::new::NewArgs,
    }

    #[test]
    fn a_registered_trainer_is_planned_and_scaffolded() {
        use clap::Parser;
        registry::register(&TEST_TRAINER);
        let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny/model");
        let base = ["plan", "--model", model, "--seq", "512", "--batch", "4"];
        let more = ["--gradient_checkpointing", "false", "--explain"];
        let plan = |trainer: &str| {
            let argv = [&base[..], &more, &["--trainer", trainer]].concat();
            run(&Plan::try_parse_from(argv).unwrap().args).unwrap()
        };
        // 4 rows of 512 tokens: 2048 tokens for SFT, 4 sequences a row for the new one.
        assert!(plan("sft").contains("activations: 2048 tokens"));
        let four = plan("test-four");
        assert!(four.contains("activations: 8192 tokens"), "{four}");
        assert!(four.contains("reference: a copy of the weights"), "{four}");
        // `cargo trl new --trainer test-four` writes its scaffold.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("my-four");
        let argv = ["new", dir.to_str().unwrap(), "--trainer", "test-four"];
        crate::new::run(&New::try_parse_from(argv).unwrap().args).unwrap();
        let main = std::fs::read_to_string(dir.join("src/main.rs")).unwrap();
        assert!(
            main.starts_with("//! A test trainer with trl-runtime"),
            "{main}"
        );
        assert!(dir.join("sft.yaml").is_file() && dir.join("data/train.jsonl").is_file());
    }
}
