//! The process environment: torchrun variables, SLURM fallback with host-list expansion, the
//! single-process default, and clear errors for missing or contradictory values.

use std::collections::HashMap;
use trl_runtime::dist::hostlist::expand;
use trl_runtime::dist::{EnvSource, ProcessEnv};

fn env(vars: &[(&str, &str)]) -> trl_runtime::Result<ProcessEnv> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    ProcessEnv::from_vars(|k| map.get(k).cloned())
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "5"),
    ("LOCAL_RANK", "1"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("GROUP_RANK", "1"),
    ("MASTER_ADDR", "10.0.0.1"),
    ("MASTER_PORT", "29501"),
];

#[test]
fn torchrun_contract() {
    let e = env(TORCHRUN).unwrap();
    assert_eq!(e.source, EnvSource::Torchrun);
    assert_eq!(
        (e.rank, e.local_rank, e.world_size, e.local_world_size),
        (5, 1, 8, 4)
    );
    assert_eq!((e.node_rank, e.num_nodes), (1, 2));
    assert_eq!(e.master(), "10.0.0.1:29501");
}

#[test]
fn torchrun_takes_precedence_over_slurm() {
    let mut vars = TORCHRUN.to_vec();
    vars.extend([("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]);
    assert_eq!(env(&vars).unwrap().source, EnvSource::Torchrun);
}

#[test]
fn single_process_default() {
    let e = env(&[]).unwrap();
    assert_eq!((e.rank, e.world_size, e.source), (0, 1, EnvSource::Single));
    assert_eq!(e.master_port, 29500);
}

#[test]
fn missing_and_contradictory_values_are_clear_errors() {
    let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("LOCAL_RANK, LOCAL_WORLD_SIZE") && e.contains("missing"),
        "{e}"
    );

    let mut vars = TORCHRUN.to_vec();
    vars[0] = ("RANK", "8");
    let e = env(&vars).unwrap_err().to_string();
    assert!(
        e.contains("RANK") && e.contains("must be below WORLD_SIZE (8)"),
        "{e}"
    );

    let mut vars = TORCHRUN.to_vec();
    vars[1] = ("LOCAL_RANK", "x1");
    let e = env(&vars).unwrap_err().to_string();
    assert!(e.contains("LOCAL_RANK") && e.contains("'x1'"), "{e}");

    let mut vars = TORCHRUN.to_vec();
    vars[1] = ("LOCAL_RANK", "4");
    assert!(env(&vars)
        .unwrap_err()
        .to_string()
        .contains("below LOCAL_WORLD_SIZE"));

    let vars: Vec<_> = TORCHRUN
        .iter()
        .copied()
        .filter(|(k, _)| *k != "MASTER_ADDR")
        .collect();
    assert!(env(&vars).unwrap_err().to_string().contains("MASTER_ADDR"));

    let mut vars = TORCHRUN.to_vec();
    vars[6] = ("MASTER_PORT", "70000");
    assert!(env(&vars).unwrap_err().to_string().contains("MASTER_PORT"));
}

#[test]
fn slurm_fallback() {
    let e = env(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_NNODES", "2"),
        ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ("SLURM_JOB_ID", "123456"),
    ])
    .unwrap();
    assert_eq!(e.source, EnvSource::Slurm);
    assert_eq!(
        (
            e.rank,
            e.local_rank,
            e.world_size,
            e.local_world_size,
            e.node_rank,
            e.num_nodes
        ),
        (3, 1, 4, 2, 1, 2)
    );
    assert_eq!(e.master_addr, "gpu07");
    assert_eq!(e.master_port, 15000 + 3456);

    // Every node believing it is node 0 shows up as a contradiction.
    let e = env(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "2"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_NNODES", "2"),
        ("SLURM_JOB_NODELIST", "n[1-2]"),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("SLURM_NODEID"), "{e}");
}

#[test]
fn hostlists_expand_like_slurm() {
    assert_eq!(
        expand("gpu[01-04,07],cpu3").unwrap(),
        ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]
    );
    assert_eq!(expand("n[1-2]").unwrap(), ["n1", "n2"]);
    assert_eq!(expand("node001").unwrap(), ["node001"]);
    assert_eq!(
        expand("r[1-2]n[08-09]").unwrap(),
        ["r1n08", "r1n09", "r2n08", "r2n09"]
    );
    assert_eq!(expand("a[9-11]").unwrap(), ["a9", "a10", "a11"]);
    assert!(expand("gpu[01-").unwrap_err().contains("unclosed"));
    assert!(expand("gpu[04-01]").unwrap_err().contains("backwards"));
    assert!(expand("gpu[a-b]").unwrap_err().contains("not a number"));
}
