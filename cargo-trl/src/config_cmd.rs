//! `cargo trl config`: writes an Accelerate-format launch config, by questions (like
//! `accelerate config`) or from flags (`--profile X --num_processes N ...`), to the default
//! location that `cargo trl launch` reads when given no profile or file.

use crate::launch::default_config_path;
use crate::topology::TopologyArgs;
use std::io::BufRead;
use std::path::PathBuf;
use trl_runtime::config::LaunchConfig;

#[derive(Debug, clap::Args)]
#[command(rename_all = "snake_case")]
pub struct ConfigArgs {
    /// Start from a shipped profile instead of the defaults.
    #[arg(long)]
    pub profile: Option<String>,
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// NO, MULTI_GPU, MULTI_CPU, DEEPSPEED or FSDP.
    #[arg(long)]
    pub distributed_type: Option<String>,
    /// DeepSpeed ZeRO stage (0-3).
    #[arg(long)]
    pub zero_stage: Option<u8>,
    /// FSDP version (1 or 2).
    #[arg(long)]
    pub fsdp_version: Option<u8>,
    /// Where to write (default: the file `cargo trl launch` reads).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Do not ask; take the profile or defaults plus the flags.
    #[arg(long)]
    pub non_interactive: bool,
}

/// The choices a config is made of.
#[derive(Debug, Clone)]
struct Settings {
    distributed_type: String,
    num_processes: u32,
    num_machines: u32,
    machine_rank: u32,
    main_process_ip: Option<String>,
    main_process_port: u16,
    mixed_precision: String,
    use_cpu: bool,
    zero_stage: u8,
    fsdp_version: u8,
    dp_shard: Option<usize>,
    tp: usize,
    cp: usize,
    sp: usize,
}

impl Settings {
    fn from_config(c: &LaunchConfig) -> Self {
        Settings {
            distributed_type: c.distributed_type.as_str().into(),
            num_processes: c.num_processes.unwrap_or(1),
            num_machines: c.num_machines,
            machine_rank: c.machine_rank,
            main_process_ip: c.main_process_ip.clone(),
            main_process_port: c.main_process_port.unwrap_or(29500),
            mixed_precision: c.mixed_precision.as_str().into(),
            use_cpu: c.use_cpu,
            zero_stage: c.deepspeed.as_ref().map_or(2, |d| d.zero_stage),
            fsdp_version: c.fsdp.as_ref().map_or(2, |f| f.version),
            dp_shard: c.parallelism.dp_shard,
            tp: c.parallelism.tp,
            cp: c.parallelism.cp,
            sp: c.parallelism.sp,
        }
    }

    fn yaml(&self) -> String {
        let mut y = String::from("compute_environment: LOCAL_MACHINE\ndebug: false\n");
        y += &format!(
            "distributed_type: {}\n",
            if self.distributed_type == "NO" {
                "\"NO\"".into()
            } else {
                self.distributed_type.clone()
            }
        );
        match self.distributed_type.as_str() {
            "DEEPSPEED" => {
                y += "deepspeed_config:\n  offload_optimizer_device: none\n  offload_param_device: none\n";
                y += &format!("  zero_stage: {}\n", self.zero_stage);
            }
            "FSDP" => {
                y += "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_state_dict_type: FULL_STATE_DICT\n";
                y += if self.fsdp_version == 1 {
                    "  fsdp_reshard_after_forward: FULL_SHARD\n"
                } else {
                    "  fsdp_reshard_after_forward: true\n"
                };
                y += &format!("  fsdp_version: {}\n", self.fsdp_version);
            }
            _ => {}
        }
        y += &format!("machine_rank: {}\n", self.machine_rank);
        if let Some(ip) = &self.main_process_ip {
            y += &format!("main_process_ip: {ip}\n");
        }
        if self.num_machines > 1 || self.main_process_ip.is_some() {
            y += &format!("main_process_port: {}\n", self.main_process_port);
        }
        y += &format!(
            "main_training_function: main\nmixed_precision: '{}'\n",
            self.mixed_precision
        );
        y += &format!(
            "num_machines: {}\nnum_processes: {}\n",
            self.num_machines, self.num_processes
        );
        if self.dp_shard.is_some() || self.tp > 1 || self.cp > 1 || self.sp > 1 {
            y += "parallelism_config:\n";
            if let Some(s) = self.dp_shard {
                y += &format!("  parallelism_config_dp_shard_size: {s}\n");
            }
            y += &format!("  parallelism_config_tp_size: {}\n  parallelism_config_cp_size: {}\n  parallelism_config_sp_size: {}\n", self.tp, self.cp, self.sp);
        }
        y += &format!(
            "rdzv_backend: static\nsame_network: true\nuse_cpu: {}\n",
            self.use_cpu
        );
        y
    }
}

/// Asks one question until the answer parses; the default (in brackets) on an empty line.
fn ask<T: std::str::FromStr + std::fmt::Display + Clone>(
    input: &mut dyn BufRead,
    question: &str,
    default: T,
    check: impl Fn(&T) -> Result<(), String>,
) -> Result<T, String> {
    loop {
        eprint!("{question} [{default}]: ");
        let mut line = String::new();
        if input.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Err(format!("input ended at: {question}"));
        }
        let line = line.trim();
        let value = if line.is_empty() {
            Ok(default.clone())
        } else {
            line.parse::<T>()
                .map_err(|_| format!("'{line}' is not a valid answer"))
        };
        match value.and_then(|v| check(&v).map(|_| v)) {
            Ok(v) => return Ok(v),
            Err(e) => eprintln!("  {e}"),
        }
    }
}

fn one_of(options: &'static [&'static str]) -> impl Fn(&String) -> Result<(), String> {
    move |v: &String| {
        if options.contains(&v.as_str()) {
            Ok(())
        } else {
            Err(format!("use one of {}", options.join(", ")))
        }
    }
}

fn yes_no(v: &String) -> Result<(), String> {
    one_of(&["yes", "no"])(v)
}

fn at_least_one(v: &u32) -> Result<(), String> {
    if *v >= 1 {
        Ok(())
    } else {
        Err("at least 1".into())
    }
}

fn wizard(s: &mut Settings, input: &mut dyn BufRead) -> Result<(), String> {
    s.num_machines = ask(input, "How many machines?", s.num_machines, at_least_one)?;
    if s.num_machines > 1 {
        s.machine_rank = ask(input, "Rank of this machine?", s.machine_rank, |_| Ok(()))?;
        let ip = ask(
            input,
            "IP address of machine 0?",
            s.main_process_ip
                .clone()
                .unwrap_or_else(|| "127.0.0.1".into()),
            |_| Ok(()),
        )?;
        s.main_process_ip = Some(ip);
        s.main_process_port = ask(
            input,
            "Port on machine 0 for the rendezvous?",
            s.main_process_port,
            |_| Ok(()),
        )?;
    }
    s.use_cpu = ask(
        input,
        "Run on CPU only (yes/no)?",
        if s.use_cpu {
            "yes".to_string()
        } else {
            "no".into()
        },
        yes_no,
    )? == "yes";
    let types: &'static [&'static str] = &["NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP"];
    let default_type = if s.use_cpu && s.distributed_type == "MULTI_GPU" {
        "MULTI_CPU".to_string()
    } else {
        s.distributed_type.clone()
    };
    s.distributed_type = ask(
        input,
        "Distributed type (NO, MULTI_GPU, MULTI_CPU, DEEPSPEED, FSDP)?",
        default_type,
        one_of(types),
    )?;
    if s.distributed_type == "DEEPSPEED" {
        s.zero_stage = ask(input, "ZeRO stage (0-3)?", s.zero_stage, |v| {
            if *v <= 3 {
                Ok(())
            } else {
                Err("use 0, 1, 2 or 3".into())
            }
        })?;
    }
    if s.distributed_type == "FSDP" {
        s.fsdp_version = ask(input, "FSDP version (1/2)?", s.fsdp_version, |v| {
            if *v == 1 || *v == 2 {
                Ok(())
            } else {
                Err("use 1 or 2".into())
            }
        })?;
    }
    s.tp = ask(input, "Tensor parallel size?", s.tp, |v| {
        if *v >= 1 {
            Ok(())
        } else {
            Err("at least 1".into())
        }
    })?;
    s.cp = ask(
        input,
        "Context parallel size (ring attention)?",
        s.cp,
        |v| {
            if *v >= 1 {
                Ok(())
            } else {
                Err("at least 1".into())
            }
        },
    )?;
    s.sp = ask(input, "Sequence parallel size (Ulysses)?", s.sp, |v| {
        if *v >= 1 {
            Ok(())
        } else {
            Err("at least 1".into())
        }
    })?;
    s.num_processes = ask(
        input,
        "How many processes in total, over all machines?",
        s.num_processes,
        at_least_one,
    )?;
    let default_mp = if s.use_cpu {
        "no".to_string()
    } else {
        s.mixed_precision.clone()
    };
    s.mixed_precision = ask(
        input,
        "Mixed precision (no, fp16, bf16)?",
        default_mp,
        one_of(&["no", "fp16", "bf16"]),
    )?;
    Ok(())
}

pub fn run(args: &ConfigArgs) -> Result<String, String> {
    let base = match &args.profile {
        Some(p) => crate::profiles::load(p)?,
        None => LaunchConfig::from_yaml_str(
            "distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n",
            "defaults",
        )
        .map_err(|e| e.to_string())?,
    };
    let mut base = base;
    args.topology.apply(&mut base)?;
    let mut s = Settings::from_config(&base);
    let given = args.topology.any()
        || args.distributed_type.is_some()
        || args.zero_stage.is_some()
        || args.fsdp_version.is_some();
    if !args.non_interactive && !given && args.profile.is_none() {
        let stdin = std::io::stdin();
        wizard(&mut s, &mut stdin.lock())?;
    }
    if let Some(v) = &args.distributed_type {
        s.distributed_type = v.to_ascii_uppercase();
    }
    if let Some(v) = args.zero_stage {
        s.zero_stage = v;
    }
    if let Some(v) = args.fsdp_version {
        s.fsdp_version = v;
    }
    let yaml = s.yaml();
    let out = args.output.clone().unwrap_or_else(default_config_path);
    // Written only if launch will accept it.
    let cfg = LaunchConfig::from_yaml_str(&yaml, &out.display().to_string())
        .map_err(|e| e.to_string())?;
    cfg.parallelism
        .resolve(
            cfg.num_processes.unwrap_or(1) as usize,
            cfg.distributed_type,
        )
        .map_err(|e| e.to_string())?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let tmp = out.with_extension("yaml.tmp");
    std::fs::write(&tmp, &yaml).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &out).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    Ok(format!("wrote {}", out.display()))
}
