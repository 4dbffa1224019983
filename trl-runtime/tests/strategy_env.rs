//! Accelerate's variables (as `cargo trl launch` and `accelerate launch` export them) select
//! the trainer's strategy and checkpoint format as the profiles intend.

use std::collections::HashMap;
use trl_runtime::config::LaunchPlan;
use trl_runtime::parallel::{Prefetch, WrapPolicy, ZeroStage};
use trl_runtime::train::{CheckpointFormat, Strategy};

fn with_env(vars: &[(&str, &str)]) -> (Result<Strategy, String>, CheckpointFormat) {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    match LaunchPlan::from_env(|k| map.get(k).cloned(), 2) {
        Ok(plan) => (
            Ok(Strategy::from_plan(&plan)),
            CheckpointFormat::from_plan(&plan),
        ),
        Err(e) => (Err(e.to_string()), CheckpointFormat::Full),
    }
}

#[test]
fn profiles_map_to_strategies() {
    use CheckpointFormat::{Full, Sharded};
    let ds = |stage| {
        with_env(&[
            ("ACCELERATE_USE_DEEPSPEED", "true"),
            ("ACCELERATE_DEEPSPEED_ZERO_STAGE", stage),
        ])
    };
    assert_eq!(with_env(&[]), (Ok(Strategy::Ddp), Full));
    assert_eq!(ds("1"), (Ok(Strategy::Zero(ZeroStage::One)), Full));
    assert_eq!(ds("2"), (Ok(Strategy::Zero(ZeroStage::Two)), Full));
    // DeepSpeed saves ZeRO-3 checkpoints sharded.
    assert_eq!(ds("3"), (Ok(Strategy::fsdp(WrapPolicy::PerLayer)), Sharded));
    let fsdp = |extra: &[(&'static str, &'static str)]| {
        let mut v = vec![("ACCELERATE_USE_FSDP", "true")];
        v.extend_from_slice(extra);
        with_env(&v)
    };
    // FSDP1 prefetches forward only when asked (fsdp_forward_prefetch), backward unless
    // NO_PREFETCH; FSDP2 always overlaps the next forward gather.
    let backward_only = Prefetch {
        forward: false,
        backward: true,
    };
    assert_eq!(
        fsdp(&[("FSDP_SHARDING_STRATEGY", "FULL_SHARD")]),
        (
            Ok(Strategy::Fsdp(WrapPolicy::PerLayer, backward_only)),
            Full
        )
    );
    assert_eq!(
        fsdp(&[
            ("FSDP_VERSION", "1"),
            ("FSDP_FORWARD_PREFETCH", "true"),
            ("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE"),
        ])
        .0,
        Ok(Strategy::fsdp(WrapPolicy::PerLayer))
    );
    assert_eq!(
        fsdp(&[
            ("FSDP_VERSION", "2"),
            ("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH")
        ])
        .0,
        Ok(Strategy::Fsdp(
            WrapPolicy::PerLayer,
            Prefetch {
                forward: true,
                backward: false
            }
        ))
    );
    assert_eq!(
        fsdp(&[("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")]),
        (Ok(Strategy::Zero(ZeroStage::Two)), Full)
    );
    assert_eq!(
        fsdp(&[
            ("FSDP_SHARDING_STRATEGY", "HYBRID_SHARD"),
            ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"),
            ("FSDP_MIN_NUM_PARAMS", "1000000"),
            ("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"),
        ]),
        (
            Ok(Strategy::Fsdp(
                WrapPolicy::MinParams(1_000_000),
                backward_only
            )),
            Sharded
        )
    );
    assert_eq!(
        fsdp(&[("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")]).0,
        Ok(Strategy::Fsdp(WrapPolicy::Whole, backward_only))
    );
    let (bad, _) = fsdp(&[("FSDP_AUTO_WRAP_POLICY", "LAMBDA_WRAP")]);
    let msg = bad.unwrap_err();
    assert!(
        msg.contains("FSDP_AUTO_WRAP_POLICY") && msg.contains("TRANSFORMER_BASED_WRAP"),
        "{msg}"
    );
}
