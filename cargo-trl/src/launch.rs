//! `cargo trl launch`: Accelerate's launch flags over a profile or config file, validated
//! before anything starts, then one worker per local rank with torchrun's environment,
//! supervised (first failure stops the rest with a root-cause report; `--max_restarts`).

use crate::accelerate_flags::AccelerateFlags;
use crate::profiles;
use crate::target::{self, Target};
use crate::topology::TopologyArgs;
use crate::tp_plan;
use std::path::{Path, PathBuf};
use std::time::Duration;
use trl_runtime::config::launch::{DistributedType, FsdpShardingStrategy, GpuIds};
use trl_runtime::config::parallelism::ParallelDims;
use trl_runtime::config::{effects, LaunchConfig, LaunchPlan};
use trl_runtime::dist::mesh::DeviceMesh;
use trl_runtime::dist::spawn::{self, Job, RankPlace, WorkerSpec};
use trl_runtime::parallel::estimate::Workload;
use trl_runtime::parallel::Strategy;
use trl_runtime::tp::PlanEntry;

/// Exit codes of `cargo trl launch`.
pub const EXIT_WORKER_FAILED: u8 = 1;
pub const EXIT_INVALID: u8 = 2;
pub const EXIT_TARGET: u8 = 3;
/// Stopped by Ctrl-C or SIGTERM (128 + SIGINT, as a shell reports it).
pub const EXIT_INTERRUPTED: u8 = 130;

#[derive(Debug, clap::Args)]
#[command(rename_all = "snake_case")]
pub struct LaunchArgs {
    /// A shipped profile (see `cargo trl profiles`).
    #[arg(long, conflicts_with = "config_file")]
    pub profile: Option<String>,
    /// An Accelerate config file.
    #[arg(long)]
    pub config_file: Option<PathBuf>,
    #[command(flatten)]
    pub topology: TopologyArgs,
    #[command(flatten)]
    pub accelerate: AccelerateFlags,
    /// Restart the whole group this many times after a failure.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Seconds between checks of the workers.
    #[arg(long, default_value_t = 0.1)]
    pub monitor_interval: f64,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value_t = 10.0)]
    pub stop_grace: f64,
    /// Write each rank's output to LOG_DIR/rank-N.log.
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// With --log_dir, also print the output here.
    #[arg(long)]
    pub tee: bool,
    /// Build cargo targets in debug mode instead of release.
    #[arg(long)]
    pub debug: bool,
    /// Print the plan (per rank: environment, mesh coordinate, command) and exit.
    #[arg(long, alias = "dry-run")]
    pub dry_run: bool,
    /// A bin or example of this workspace, or a path to an executable.
    pub target: Option<String>,
    /// Arguments for the program (after --).
    #[arg(last = true)]
    pub program_args: Vec<String>,
}

/// Everything decided before spawning.
#[derive(Debug)]
pub struct Plan {
    pub config: LaunchConfig,
    pub dims: ParallelDims,
    pub world: usize,
    pub nproc: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub target: Target,
    pub workers: Vec<WorkerSpec>,
    /// Under tp > 1, the model directory the program names and how it is split.
    /// The built-in decoder's tensor-parallel plan for the model directory the program's
    /// arguments name, or why it cannot split it (see `run` for the program's own).
    pub tp_plan: Option<(PathBuf, Result<Vec<PlanEntry>, String>)>,
    /// The automatic port's listening socket, held until the job ends: rank 0 inherits it
    /// and serves the store on it.
    _listener: Option<std::net::TcpListener>,
}

fn load_config(args: &LaunchArgs) -> Result<LaunchConfig, String> {
    if let Some(name) = &args.profile {
        if name == "auto" {
            let cpu = args.topology.use_cpu.unwrap_or(false);
            let (training, workload) = program_settings(args, cpu)?;
            return crate::plan::auto(&training, workload, cpu, args.topology.num_processes);
        }
        return profiles::load(name);
    }
    if let Some(path) = &args.config_file {
        let cfg = LaunchConfig::from_file(path).map_err(|e| e.to_string())?;
        for key in &cfg.unknown_keys {
            eprintln!(
                "warning: {}: unknown key `{key}` ignored (check its spelling)",
                path.display()
            );
        }
        return Ok(cfg);
    }
    // What `accelerate config` wrote comes first, then our own `cargo trl config`'s.
    for default in [accelerate_default_config_path(), default_config_path()] {
        if default.exists() {
            eprintln!("note: using {}", default.display());
            return LaunchConfig::from_file(&default).map_err(|e| e.to_string());
        }
    }
    let default = default_config_path();
    eprintln!(
        "note: no --profile or --config_file and no {}: running 1 process on CPU",
        default.display()
    );
    LaunchConfig::from_yaml_str(
        "distributed_type: \"NO\"\nnum_processes: 1\nuse_cpu: true\n",
        "built-in default",
    )
    .map_err(|e| e.to_string())
}

/// What the program will train, for `--profile auto`: the built program's own answer (its
/// flags over its own defaults and config file, as its workers will read them), else, for a
/// program that does not answer, its flags read as a registered trainer's over TRL's defaults.
fn program_settings(
    args: &LaunchArgs,
    cpu: bool,
) -> Result<(trl_runtime::train::TrainingArguments, Workload), String> {
    let gpu = !cpu && crate::machine::gpus_present() > 0;
    let target = target::resolve(args.target.as_deref())?.for_gpu(gpu);
    let program = target::build(&target, !args.debug)?;
    match tp_plan::ask(&program, &args.program_args, 1) {
        tp_plan::Answer::Plan(answer) => Ok((answer.training, answer.workload)),
        tp_plan::Answer::None(why) => {
            eprintln!("note: --profile auto: the program did not say what it trains ({why}); planning from its flags over TRL's defaults");
            let read = tp_plan::program_args(&args.program_args).ok_or(
                "--profile auto reads the program's training arguments (TRL's flags or --config FILE); these did not parse: pick a profile (cargo trl plan shows which fits)",
            )?;
            Ok((read.training, read.workload))
        }
    }
}

/// Where `accelerate config` writes its default: $HF_HOME/accelerate/default_config.yaml, HF_HOME
/// being $XDG_CACHE_HOME/huggingface (~/.cache/huggingface) unless set.
pub fn accelerate_default_config_path() -> PathBuf {
    trl_runtime::hub::hf_home(|k| std::env::var(k).ok()).join("accelerate/default_config.yaml")
}

/// Where `cargo trl config` writes and `launch` looks when nothing is given (after
/// Accelerate's own default).
pub fn default_config_path() -> PathBuf {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("cargo-trl/default_config.yaml")
}

/// Inside a SLURM allocation (one launcher per node under srun), machines, this machine's
/// rank and the master address come from SLURM unless given as flags.
fn slurm_defaults(cfg: &mut LaunchConfig, args: &LaunchArgs) -> Result<(), String> {
    let var = |k: &str| std::env::var(k).ok();
    let (Some(job), Some(node)) = (var("SLURM_JOB_ID"), var("SLURM_NODEID")) else {
        return Ok(());
    };
    let num = |k: &str, v: String| {
        v.trim()
            .parse::<u32>()
            .map_err(|_| format!("{k}='{v}' is not a number"))
    };
    let nodes = match var("SLURM_STEP_NUM_NODES")
        .or(var("SLURM_NNODES"))
        .or(var("SLURM_JOB_NUM_NODES"))
    {
        Some(v) => num("SLURM_NNODES", v)?,
        None => 1,
    };
    if nodes > 1 && var("SLURM_STEP_ID").is_none() {
        return Err(format!(
            "SLURM job {job} spans {nodes} nodes but this launcher runs in the batch script, so only node 0 would start: run `srun --ntasks-per-node=1 cargo trl launch ...` (one launcher per node)"
        ));
    }
    if var("SLURM_LOCALID").is_some_and(|v| v.trim() != "0") {
        return Err("more than one `cargo trl launch` was started on this node: use srun --ntasks-per-node=1 (the launcher starts the per-GPU processes itself)".into());
    }
    if args.topology.num_machines.is_none() {
        cfg.num_machines = nodes;
    }
    if args.topology.machine_rank.is_none() {
        cfg.machine_rank = num("SLURM_NODEID", node)?;
    }
    if args.topology.main_process_ip.is_none() {
        let list = var("SLURM_STEP_NODELIST")
            .or(var("SLURM_JOB_NODELIST"))
            .unwrap_or_default();
        let hosts = trl_runtime::dist::hostlist::expand(&list)
            .map_err(|e| format!("SLURM_JOB_NODELIST: {e}"))?;
        cfg.main_process_ip = Some(
            hosts
                .first()
                .cloned()
                .ok_or("SLURM_JOB_NODELIST is empty: cannot tell the master node")?,
        );
    }
    if args.topology.main_process_port.is_none() {
        let id: u64 = job
            .trim()
            .parse()
            .map_err(|_| format!("SLURM_JOB_ID='{job}' is not a number"))?;
        cfg.main_process_port = Some(15000 + (id % 10000) as u16);
    }
    eprintln!(
        "SLURM job {job}: machine {} of {}, master {}:{}",
        cfg.machine_rank,
        cfg.num_machines,
        cfg.main_process_ip.as_deref().unwrap_or("?"),
        cfg.main_process_port.unwrap_or(0)
    );
    Ok(())
}

/// Applies the flags, checks everything, and lays out the workers of this machine.
pub fn plan(args: &LaunchArgs) -> Result<Plan, String> {
    let mut cfg = load_config(args)?;
    let src = cfg.source.clone();
    args.topology.apply(&mut cfg)?;
    args.accelerate.apply(&mut cfg)?;
    // Every accepted key has its effect, is refused here, or is named with why it has none.
    effects::refused(&cfg).map_err(|e| e.to_string())?;
    for note in effects::ignored(&cfg) {
        eprintln!("warning: {src}: ignored: {note}");
    }
    slurm_defaults(&mut cfg, args)?;
    if cfg.distributed_type == DistributedType::No && cfg.num_processes.unwrap_or(1) > 1 {
        cfg.distributed_type = if cfg.use_cpu {
            DistributedType::MultiCpu
        } else {
            DistributedType::MultiGpu
        };
    }
    let world = cfg.num_processes.unwrap_or(1) as usize;
    let machines = cfg.num_machines as usize;
    if machines == 0 || !world.is_multiple_of(machines) {
        return Err(format!(
            "num_processes {world} is the total over all machines and must divide evenly by num_machines {machines} (it gives {:.2} per machine)",
            world as f64 / machines.max(1) as f64
        ));
    }
    let node_rank = cfg.machine_rank as usize;
    if node_rank >= machines {
        return Err(format!(
            "machine_rank {node_rank} must be below num_machines {machines}"
        ));
    }
    let nproc = world / machines;
    // FSDP's hybrid strategies shard within a machine and replicate across machines.
    let hybrid = cfg.fsdp.as_ref().is_some_and(|f| {
        matches!(
            f.sharding_strategy,
            FsdpShardingStrategy::HybridShard | FsdpShardingStrategy::HybridShardZero2
        )
    });
    let p = &mut cfg.parallelism;
    if hybrid && p.dp_replicate.is_none() && p.dp_shard.is_none() {
        p.dp_shard = Some(nproc / (p.tp * p.cp * p.sp).max(1));
    }
    let launch_plan = LaunchPlan::from_config(&cfg);
    let dims = launch_plan
        .resolve(world)
        .map_err(|e| format!("{src}: {e}"))?;
    // Under tensor parallelism the model must split over tp. Only the built program knows its
    // model type: `run` asks it before starting the workers. Here, with nothing built, the
    // built-in decoder's reading of the model directory the arguments name (if any) is what
    // the dry run shows and what `run` falls back to for a program that does not answer.
    let tp_plan = tp_plan::model_dir(&args.program_args)
        .filter(|_| dims.tp > 1)
        .map(|dir| {
            let entries = tp_plan::builtin(&dir, dims.tp).map_err(|e| e.to_string());
            (dir, entries)
        });
    if !cfg.use_cpu && cfg.distributed_type != DistributedType::MultiCpu {
        let present = crate::machine::gpus_present();
        let wanted: Vec<u32> = match &cfg.gpu_ids {
            GpuIds::All => (0..nproc as u32).collect(),
            GpuIds::List(l) => l.clone(),
        };
        if wanted.len() < nproc {
            return Err(format!("gpu_ids lists {} GPU(s) for {nproc} processes on this machine: list one per process", wanted.len()));
        }
        if let Some(&bad) = wanted.iter().take(nproc).find(|&&g| g as usize >= present) {
            let why = format!(
                "{src} runs {nproc} process(es) per machine on GPUs but {} GPU(s) are present here (GPU {bad} is missing)",
                present
            );
            // A dry run only shows the plan: a cluster config can be checked on a laptop.
            if !args.dry_run {
                return Err(format!(
                    "{why}: pass --use_cpu, pick a *_cpu profile, or lower --num_processes"
                ));
            }
            eprintln!("warning: {why}; the plan below cannot run on this machine");
        }
    }
    let master_addr = cfg
        .main_process_ip
        .clone()
        .unwrap_or_else(|| "127.0.0.1".into());
    let mut master_port = cfg
        .main_process_port
        .unwrap_or(trl_runtime::dist::env::DEFAULT_MASTER_PORT);
    // An automatic port is bound here and handed to rank 0, which serves the store on it.
    let mut listener = None;
    if master_port == 0 {
        let l = spawn::inheritable_listener(&master_addr)
            .map_err(|e| format!("cannot listen on a free port of {master_addr}: {e}"))?;
        master_port = l
            .local_addr()
            .map_err(|e| format!("cannot find a free port: {e}"))?
            .port();
        listener = Some(l);
    } else if node_rank == 0 && !args.dry_run {
        if let Err(e) = std::net::TcpListener::bind((master_addr.as_str(), master_port)) {
            return Err(format!(
                "main_process_port {master_port} on {master_addr} is not available ({e}): another job may use it; pass --main_process_port 0 for a free one"
            ));
        }
    }
    let on_gpu = !cfg.use_cpu && cfg.distributed_type != DistributedType::MultiCpu;
    let target = target::resolve(args.target.as_deref())?.for_gpu(on_gpu);
    let token = std::env::var(trl_runtime::comm::store::TOKEN_VAR).unwrap_or_else(|_| {
        if machines > 1 {
            eprintln!("warning: TRL_JOB_TOKEN is not set: machines derive a shared token from the master address; export the same secret on every machine");
            format!("trl-{master_addr}-{master_port}")
        } else {
            spawn::new_token()
        }
    });
    let threads = match args.accelerate.num_cpu_threads_per_process {
        Some(n) => n.max(1),
        None if cfg.use_cpu || cfg.distributed_type == DistributedType::MultiCpu => {
            crate::machine::cpu_threads_per_process(nproc)
        }
        None => 1,
    };
    // The launch contract: the resolved plan in Accelerate's variables, read back by
    // DistContext::from_env() in every worker.
    let common = launch_plan.to_env(&dims);
    let workers = (0..nproc)
        .map(|local| {
            let rank = node_rank * nproc + local;
            let place = RankPlace {
                rank,
                local_rank: local,
                world,
                local_world: nproc,
                node_rank,
                nodes: machines,
            };
            let mut env = spawn::torchrun_env(place, &master_addr, master_port, &token);
            if let (0, Some(l)) = (rank, &listener) {
                env.push(spawn::listener_env(l));
            }
            env.push(("OMP_NUM_THREADS".into(), threads.to_string()));
            env.push(("RAYON_NUM_THREADS".into(), threads.to_string()));
            if !cfg.use_cpu && cfg.distributed_type != DistributedType::MultiCpu {
                let gpu = match &cfg.gpu_ids {
                    GpuIds::All => local as u32,
                    GpuIds::List(l) => l[local],
                };
                env.push(("CUDA_VISIBLE_DEVICES".into(), gpu.to_string()));
            }
            env.extend(common.iter().cloned());
            WorkerSpec {
                rank,
                local_rank: local,
                env,
            }
        })
        .collect();
    Ok(Plan {
        config: cfg,
        dims,
        world,
        nproc,
        node_rank,
        master_addr,
        master_port,
        target,
        workers,
        tp_plan,
        _listener: listener,
    })
}

/// Prints the plan: per rank its mesh coordinate, environment and the command.
pub fn print_plan(plan: &Plan, args: &LaunchArgs) {
    println!(
        "plan: {} ({}) world {} = {} machine(s) x {} process(es); this is machine {}; master {}:{}",
        plan.config.source,
        plan.config.distributed_type.as_str(),
        plan.world,
        plan.config.num_machines,
        plan.nproc,
        plan.node_rank,
        plan.master_addr,
        plan.master_port
    );
    let d = plan.dims;
    println!(
        "mesh: dp_replicate={} dp_shard={} cp={} sp={} tp={}",
        d.dp_replicate, d.dp_shard, d.cp, d.sp, d.tp
    );
    let launch_plan = LaunchPlan::from_config(&plan.config);
    // The launch config's fsdp_activation_checkpointing, or the training arguments'
    // gradient_checkpointing (on by default in TRL's SFTConfig, and here).
    let from_args = tp_plan::gradient_checkpointing(&args.program_args);
    println!(
        "strategy: {} (activation_checkpointing={}, offload_optimizer={}){}",
        Strategy::from_plan(&launch_plan).name(),
        launch_plan.activation_checkpointing() || from_args,
        launch_plan.offload_optimizer(),
        match (launch_plan.activation_checkpointing(), from_args) {
            (true, _) => " [checkpointing: fsdp_activation_checkpointing]",
            (false, true) =>
                " [checkpointing: the program's gradient_checkpointing, on by default as in TRL]",
            (false, false) => "",
        }
    );
    match &plan.tp_plan {
        Some((dir, Ok(entries))) => println!(
            "{}\n  (as the built-in decoder splits it; a launch asks the built program for its own model's plan)",
            tp_plan::render(entries, d.tp, dir)
        ),
        Some((dir, Err(e))) => println!(
            "tensor-parallel plan: the built-in decoder cannot split {}: {e}\n  (a launch asks the built program, whose own model may differ)",
            dir.display()
        ),
        None if d.tp > 1 => println!(
            "tensor-parallel plan: a launch asks the built program for its model's plan (or pass --model_name_or_path DIR to the program to see the built-in decoder's here)"
        ),
        None => {}
    }
    if let Some(build) = plan.target.build_command(!args.debug) {
        println!("build: {}", build.join(" "));
    }
    let program = match &plan.target {
        Target::Path(p) => p.display().to_string(),
        Target::Cargo { name, .. } => name.clone(),
    };
    let mesh = DeviceMesh::new(plan.dims, plan.world).expect("validated");
    for w in &plan.workers {
        let c = mesh.coordinate(w.rank);
        println!(
            "rank {} (local {}): coordinate dp_replicate={} dp_shard={} cp={} sp={} tp={}",
            w.rank, w.local_rank, c[0], c[1], c[2], c[3], c[4]
        );
        let env: Vec<String> = w
            .env
            .iter()
            .map(|(k, v)| {
                if k == trl_runtime::comm::store::TOKEN_VAR {
                    format!("{k}=<secret>")
                } else {
                    format!("{k}={v}")
                }
            })
            .collect();
        println!("  env: {}", env.join(" "));
        println!("  command: {program} {}", args.program_args.join(" "));
    }
}

/// Runs the plan, restarting the whole group up to `max_restarts` times. Returns the exit code.
pub fn run(plan: Plan, args: &LaunchArgs) -> u8 {
    let program = match target::build(&plan.target, !args.debug) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_TARGET;
        }
    };
    if let Err(e) = check_tp_plan(&plan, &program, args) {
        eprintln!("error: {e}");
        return EXIT_INVALID;
    }
    let mut attempt = 0;
    loop {
        let mut workers = plan.workers.clone();
        for w in &mut workers {
            w.env
                .push(("TORCHELASTIC_RESTART_COUNT".into(), attempt.to_string()));
        }
        let job = Job {
            program: program.clone(),
            args: args.program_args.clone(),
            workers,
            grace: Duration::from_secs_f64(args.stop_grace),
            monitor_interval: Duration::from_secs_f64(args.monitor_interval.max(0.001)),
            log_dir: args.log_dir.clone(),
            tee: args.tee,
        };
        let outcome = match spawn::run_job(&job) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("error: {e}");
                return EXIT_TARGET;
            }
        };
        if outcome.interrupted {
            return interrupted(&outcome);
        }
        if outcome.success() {
            return 0;
        }
        if let Some(f) = &outcome.failure {
            eprintln!("{}", f.report());
            // A program refusing its arguments (exit 2, as clap and `cargo run` do): the
            // launch was invalid, not the job; a restart would refuse them again.
            if f.status.code() == Some(2) {
                eprintln!("error: the program refused its arguments (its message is above): nothing was trained");
                return EXIT_INVALID;
            }
        }
        if outcome.interrupted || attempt >= args.max_restarts {
            eprintln!(
                "error: the job failed{}",
                if attempt > 0 {
                    format!(" after {attempt} restart(s)")
                } else {
                    String::new()
                }
            );
            return EXIT_WORKER_FAILED;
        }
        attempt += 1;
        eprintln!(
            "restarting the group (restart {attempt} of {})",
            args.max_restarts
        );
    }
}

/// Under tensor parallelism, the program's own model must split over tp: the built program
/// is asked for its plan (as it reads its flags and YAML), before any worker starts. A program
/// that does not answer (it does not train through trl_runtime's Trainer) is checked with the
/// built-in decoder's reading of the model directory its arguments name, if any.
fn check_tp_plan(plan: &Plan, program: &Path, args: &LaunchArgs) -> Result<(), String> {
    let tp = plan.dims.tp;
    if tp == 1 {
        return Ok(());
    }
    let src = &plan.config.source;
    let refuse = |dir: &Path, e: &str| {
        format!(
            "{src}: parallelism_config_tp_size = {tp} cannot split the model in {}: {e}",
            dir.display()
        )
    };
    match tp_plan::ask(program, &args.program_args, tp) {
        tp_plan::Answer::Plan(answer) => match answer.plan {
            Err(e) => Err(refuse(&answer.model_dir, &e)),
            Ok(_) => Ok(()),
        },
        tp_plan::Answer::None(why) => match &plan.tp_plan {
            Some((dir, Err(e))) => Err(refuse(dir, e)),
            _ => {
                eprintln!(
                    "note: the program did not report its model's tensor-parallel plan ({why}); the workers check it as they load"
                );
                Ok(())
            }
        },
    }
}

/// What a stopped job left behind, and how to go on from it.
fn interrupted(outcome: &spawn::JobOutcome) -> u8 {
    eprintln!("{}", outcome.interrupted_note(true));
    EXIT_INTERRUPTED
}
