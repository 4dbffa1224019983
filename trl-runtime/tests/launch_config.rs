//! Accelerate launch YAML: every shipped profile parses to what it promises; bad files give
//! errors naming the file, the key and the accepted values; unknown keys are reported.

use std::path::PathBuf;
use trl_runtime::config::launch::*;
use trl_runtime::config::parallelism::ParallelDims;
use trl_runtime::Error;

fn profiles_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../templates/profiles")
}

fn profile(name: &str) -> LaunchConfig {
    LaunchConfig::from_file(profiles_dir().join(format!("{name}.yaml"))).unwrap()
}

#[test]
fn every_shipped_profile_parses_without_unknown_keys() {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(profiles_dir()).unwrap() {
        let path = entry.unwrap().path();
        let cfg =
            LaunchConfig::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            cfg.unknown_keys.is_empty(),
            "{}: {:?}",
            path.display(),
            cfg.unknown_keys
        );
        let world = cfg.num_processes.unwrap_or(1) as usize;
        cfg.parallelism
            .resolve(world, cfg.distributed_type)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        names.push(path.file_stem().unwrap().to_string_lossy().into_owned());
    }
    for required in [
        "single_gpu",
        "multi_gpu",
        "zero1",
        "zero2",
        "zero3",
        "fsdp1",
        "fsdp2",
        "context_parallel_2gpu",
        "alst_ulysses_4gpu",
        "multi_node",
        "multi_cpu",
    ] {
        assert!(
            names.iter().any(|n| n == required),
            "missing profile {required}"
        );
    }
}

#[test]
fn profiles_mean_what_trl_means() {
    let c = profile("multi_gpu");
    assert_eq!(
        (c.distributed_type, c.num_processes, c.mixed_precision),
        (DistributedType::MultiGpu, Some(8), MixedPrecision::Bf16)
    );
    assert_eq!(c.gpu_ids, GpuIds::All);

    for (name, stage) in [("zero1", 1), ("zero2", 2), ("zero3", 3)] {
        let c = profile(name);
        assert_eq!(c.distributed_type, DistributedType::DeepSpeed);
        let ds = c.deepspeed.as_ref().unwrap();
        assert_eq!(ds.zero_stage, stage);
        assert_eq!(ds.offload_optimizer_device, OffloadDevice::None);
        assert_eq!(c.zero_stage(), stage);
    }
    assert!(profile("zero3").deepspeed.unwrap().zero3_save_16bit_model);

    let f1 = profile("fsdp1").fsdp.unwrap();
    assert_eq!(f1.version, 1);
    assert_eq!(f1.sharding_strategy, FsdpShardingStrategy::FullShard);
    assert_eq!(
        f1.auto_wrap_policy,
        FsdpAutoWrapPolicy::TransformerBasedWrap
    );
    assert_eq!(f1.backward_prefetch, FsdpBackwardPrefetch::BackwardPre);
    assert_eq!(f1.state_dict_type, FsdpStateDictType::FullStateDict);

    let f2 = profile("fsdp2").fsdp.unwrap();
    assert_eq!((f2.version, f2.reshard_after_forward), (2, true));

    let cp = profile("context_parallel_2gpu");
    assert_eq!(cp.parallelism.cp, 2);
    assert!(cp.fsdp.unwrap().activation_checkpointing);
    assert_eq!(
        cp.parallelism.resolve(2, DistributedType::Fsdp).unwrap(),
        ParallelDims {
            dp_replicate: 1,
            dp_shard: 1,
            cp: 2,
            sp: 1,
            tp: 1
        }
    );

    let alst = profile("alst_ulysses_4gpu");
    assert_eq!(alst.deepspeed.as_ref().unwrap().zero_stage, 3);
    assert_eq!(
        alst.parallelism.resolve(4, alst.distributed_type).unwrap(),
        ParallelDims {
            dp_replicate: 1,
            dp_shard: 2,
            cp: 1,
            sp: 2,
            tp: 1
        }
    );

    let mn = profile("multi_node");
    assert_eq!(
        (mn.num_machines, mn.num_processes, mn.main_process_port),
        (2, Some(16), Some(29500))
    );

    let cpu = profile("multi_cpu");
    assert!(cpu.use_cpu);
    assert_eq!(
        (cpu.distributed_type, cpu.num_processes, cpu.mixed_precision),
        (DistributedType::MultiCpu, Some(2), MixedPrecision::No)
    );
}

fn parse_err(yaml: &str) -> String {
    match LaunchConfig::from_yaml_str(yaml, "my.yaml") {
        Ok(c) => panic!("expected an error for {yaml:?}, got {c:?}"),
        Err(e) => {
            assert!(matches!(e, Error::Config { .. }), "{e:?}");
            e.to_string()
        }
    }
}

#[test]
fn bad_values_name_file_key_and_accepted_values() {
    let e = parse_err("distributed_type: MULTI_GPUS\n");
    assert!(e.starts_with("my.yaml: key `distributed_type`"), "{e}");
    assert!(e.contains("MULTI_GPU, MULTI_CPU, DEEPSPEED, FSDP"), "{e}");

    let e = parse_err("num_processes: two\n");
    assert!(
        e.contains("`num_processes`") && e.contains("non-negative integer") && e.contains("'two'"),
        "{e}"
    );

    let e = parse_err("mixed_precision: fp64\n");
    assert!(
        e.contains("`mixed_precision`") && e.contains("no, fp16, bf16, fp8"),
        "{e}"
    );

    let e = parse_err("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n");
    assert!(
        e.contains("`deepspeed_config.zero_stage`") && e.contains("0 to 3"),
        "{e}"
    );

    let e = parse_err("distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: FULL\n");
    assert!(
        e.contains("`fsdp_config.fsdp_state_dict_type`")
            && e.contains("FULL_STATE_DICT, SHARDED_STATE_DICT"),
        "{e}"
    );

    let e = parse_err("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: FULL_SHARD\n");
    assert!(
        e.contains("fsdp_reshard_after_forward") && e.contains("true or false"),
        "{e}"
    );

    let e = parse_err("use_cpu: maybe\n");
    assert!(
        e.contains("`use_cpu`") && e.contains("true or false"),
        "{e}"
    );

    let e = parse_err("parallelism_config:\n  parallelism_config_tp_size: 0\n");
    assert!(
        e.contains("parallelism_config.parallelism_config_tp_size") && e.contains("out of range"),
        "{e}"
    );

    let e = parse_err("distributed_type: XLA\n");
    assert!(e.contains("does not run"), "{e}");

    let e = parse_err("num_machines: 2\nmachine_rank: 2\n");
    assert!(
        e.contains("`machine_rank`") && e.contains("below num_machines"),
        "{e}"
    );

    let e = parse_err("distributed_type: \"NO\"\nnum_processes: 4\n");
    assert!(e.contains("`num_processes`"), "{e}");

    let e = parse_err("gpu_ids: 0,x\n");
    assert!(e.contains("`gpu_ids`"), "{e}");

    let e = parse_err("- a\n- list\n");
    assert!(e.contains("mapping"), "{e}");

    let e = parse_err("num_processes: [1\n");
    assert!(e.contains("not valid YAML"), "{e}");
}

#[test]
fn unknown_keys_are_reported_not_dropped() {
    let c = LaunchConfig::from_yaml_str(
        "distributed_type: FSDP\nnum_procesess: 4\nfsdp_config:\n  fsdp_versoin: 2\n",
        "typo.yaml",
    )
    .unwrap();
    assert_eq!(
        c.unknown_keys,
        vec![
            "num_procesess".to_string(),
            "fsdp_config.fsdp_versoin".to_string()
        ]
    );
}

#[test]
fn accelerate_variants_are_accepted() {
    // Strings for booleans and numbers, fsdp1 strategies by number, null values.
    let c = LaunchConfig::from_yaml_str(
        "distributed_type: FSDP\nnum_processes: '4'\nuse_cpu: 'true'\nmain_process_ip: null\nfsdp_config:\n  fsdp_version: '1'\n  fsdp_sharding_strategy: 2\n",
        "v.yaml",
    )
    .unwrap();
    assert_eq!(c.num_processes, Some(4));
    assert!(c.use_cpu);
    assert_eq!(c.main_process_ip, None);
    assert_eq!(
        c.fsdp.unwrap().sharding_strategy,
        FsdpShardingStrategy::ShardGradOp
    );
    assert_eq!(
        GpuIds::parse("0, 2,3").unwrap(),
        GpuIds::List(vec![0, 2, 3])
    );
}

#[test]
fn missing_file_names_the_path() {
    let e = LaunchConfig::from_file("/nonexistent/profile.yaml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/profile.yaml"), "{e}");
}

/// accelerate 1.15's fsdp_activation_checkpointing_offload (TRL's context_parallel_8gpu.yaml):
/// read, carried to the workers in FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD, read back there.
#[test]
fn activation_checkpointing_offload_reaches_the_workers() {
    use trl_runtime::config::LaunchPlan;
    let yaml = "distributed_type: FSDP\nnum_processes: 8\nmixed_precision: bf16\n\
                fsdp_config:\n  fsdp_activation_checkpointing: true\n  \
                fsdp_activation_checkpointing_offload: true\n  fsdp_version: 2\n\
                parallelism_config:\n  parallelism_config_cp_size: 8\n";
    let cfg = LaunchConfig::from_yaml_str(yaml, "context_parallel_8gpu.yaml").unwrap();
    assert!(cfg.unknown_keys.is_empty(), "{:?}", cfg.unknown_keys);
    let plan = LaunchPlan::from_config(&cfg);
    assert!(plan.activation_checkpointing() && plan.activation_checkpointing_offload());
    let dims = cfg.parallelism.resolve(8, cfg.distributed_type).unwrap();
    let env: std::collections::HashMap<String, String> = plan.to_env(&dims).into_iter().collect();
    assert_eq!(env["FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"], "true");
    let back = LaunchPlan::from_env(|k| env.get(k).cloned(), 8).unwrap();
    assert!(back.activation_checkpointing_offload());
}
