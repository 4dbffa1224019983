//! The launcher's Accelerate variables select the trainer's strategy and checkpoint format as
//! the profiles intend (its own test binary: it changes the process environment).

use trl_runtime::parallel::{Prefetch, WrapPolicy, ZeroStage};
use trl_runtime::train::{CheckpointFormat, Strategy};

const VARS: &[&str] = &[
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_USE_FSDP",
    "FSDP_SHARDING_STRATEGY",
    "FSDP_AUTO_WRAP_POLICY",
    "FSDP_MIN_NUM_PARAMS",
    "FSDP_STATE_DICT_TYPE",
    "FSDP_VERSION",
    "FSDP_FORWARD_PREFETCH",
    "FSDP_BACKWARD_PREFETCH",
];

fn with_env(vars: &[(&str, &str)]) -> (Result<Strategy, String>, CheckpointFormat) {
    for v in VARS {
        std::env::remove_var(v);
    }
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    (
        Strategy::from_env().map_err(|e| e.to_string()),
        CheckpointFormat::from_env(),
    )
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
        fsdp(&[("FSDP_SHARDING_STRATEGY", "FullShard")]),
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
        fsdp(&[("FSDP_SHARDING_STRATEGY", "ShardGradOp")]),
        (Ok(Strategy::Zero(ZeroStage::Two)), Full)
    );
    assert_eq!(
        fsdp(&[
            ("FSDP_SHARDING_STRATEGY", "HybridShard"),
            ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"),
            ("FSDP_MIN_NUM_PARAMS", "1000000"),
            ("FSDP_STATE_DICT_TYPE", "ShardedStateDict"),
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
        msg.contains("fsdp_auto_wrap_policy") && msg.contains("TRANSFORMER_BASED_WRAP"),
        "{msg}"
    );
}
