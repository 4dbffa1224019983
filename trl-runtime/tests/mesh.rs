//! Device mesh: coordinates and groups for every valid shape up to 16 ranks, flattened axes,
//! validation messages, and PARALLELISM_CONFIG_* variables.

use std::collections::HashMap;
use trl_runtime::config::launch::DistributedType;
use trl_runtime::config::parallelism::{ParallelDims, ParallelismConfig};
use trl_runtime::dist::mesh::{Axis, DeviceMesh, DP, DP_CP, DP_SHARD_CP};

fn all_shapes(world: usize) -> Vec<ParallelDims> {
    let divs = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    for a in divs(world) {
        for b in divs(world / a) {
            for c in divs(world / a / b) {
                for d in divs(world / a / b / c) {
                    let e = world / a / b / c / d;
                    out.push(ParallelDims {
                        dp_replicate: a,
                        dp_shard: b,
                        cp: c,
                        sp: d,
                        tp: e,
                    });
                }
            }
        }
    }
    out
}

#[test]
fn groups_for_every_valid_shape_up_to_16_ranks() {
    let mut checked = 0;
    for world in 1..=16 {
        for dims in all_shapes(world) {
            let Ok(mesh) = DeviceMesh::new(dims, world) else {
                continue;
            };
            checked += 1;
            let sizes = [dims.dp_replicate, dims.dp_shard, dims.cp, dims.sp, dims.tp];
            for rank in 0..world {
                let coord = mesh.coordinate(rank);
                assert_eq!(mesh.rank_of(coord), rank);
                for (i, axis) in Axis::ALL.iter().enumerate() {
                    assert!(coord[i] < sizes[i]);
                    let g = mesh.group(rank, &[*axis]);
                    assert_eq!(g.len(), sizes[i]);
                    assert!(g.contains(&rank));
                    assert_eq!(g[coord[i]], rank, "group is ordered by the axis coordinate");
                    // Members differ from rank only along this axis.
                    for &m in &g {
                        let mc = mesh.coordinate(m);
                        for j in 0..5 {
                            if j != i {
                                assert_eq!(mc[j], coord[j]);
                            }
                        }
                    }
                }
                // tp groups are consecutive ranks.
                let tp = mesh.group(rank, &[Axis::Tp]);
                assert!(tp.windows(2).all(|w| w[1] == w[0] + 1));
                // Flattened axes.
                assert_eq!(
                    mesh.group(rank, DP).len(),
                    dims.dp_replicate * dims.dp_shard
                );
                assert_eq!(mesh.group(rank, DP_SHARD_CP).len(), dims.dp_shard * dims.cp);
                assert_eq!(
                    mesh.group(rank, DP_CP).len(),
                    dims.dp_replicate * dims.dp_shard * dims.cp
                );
                let dp = mesh.group(rank, DP);
                assert_eq!(dp[mesh.local_rank(rank, DP)], rank);
            }
            // Groups of an axis partition the world.
            for axes in [&[Axis::Tp][..], &[Axis::Cp], DP, DP_SHARD_CP, DP_CP] {
                let groups = mesh.all_groups(axes);
                let mut seen: Vec<usize> = groups.concat();
                seen.sort();
                assert_eq!(seen, (0..world).collect::<Vec<_>>());
            }
        }
    }
    assert!(checked > 100, "only {checked} shapes checked");
}

#[test]
fn axis_order_puts_tp_innermost_and_dp_replicate_outermost() {
    let dims = ParallelDims {
        dp_replicate: 2,
        dp_shard: 2,
        cp: 1,
        sp: 1,
        tp: 2,
    };
    let mesh = DeviceMesh::new(dims, 8).unwrap();
    assert_eq!(mesh.group(0, &[Axis::Tp]), vec![0, 1]);
    assert_eq!(mesh.group(0, &[Axis::DpShard]), vec![0, 2]);
    assert_eq!(mesh.group(0, &[Axis::DpReplicate]), vec![0, 4]);
    assert_eq!(mesh.group(3, DP), vec![1, 3, 5, 7]);
    assert_eq!(mesh.coordinate(7), [1, 1, 0, 0, 1]);
    assert_eq!(mesh.group_name(3, DP), "dp_replicate+dp_shard:1,3,5,7");

    // alst_ulysses_4gpu: dp_shard 2 x sp 2
    let mesh = DeviceMesh::new(
        ParallelDims {
            dp_replicate: 1,
            dp_shard: 2,
            cp: 1,
            sp: 2,
            tp: 1,
        },
        4,
    )
    .unwrap();
    assert_eq!(mesh.all_groups(&[Axis::Sp]), vec![vec![0, 1], vec![2, 3]]);
    assert_eq!(
        mesh.all_groups(&[Axis::DpShard]),
        vec![vec![0, 2], vec![1, 3]]
    );
}

#[test]
fn invalid_shapes_name_every_factor_and_the_world() {
    let cases = [
        (
            ParallelDims {
                dp_replicate: 1,
                dp_shard: 2,
                cp: 1,
                sp: 2,
                tp: 1,
            },
            8,
            "must equal the world size",
        ),
        (
            ParallelDims {
                dp_replicate: 1,
                dp_shard: 1,
                cp: 2,
                sp: 2,
                tp: 1,
            },
            4,
            "cannot be combined",
        ),
        (
            ParallelDims {
                dp_replicate: 2,
                dp_shard: 1,
                cp: 1,
                sp: 1,
                tp: 2,
            },
            4,
            "not pure DDP",
        ),
        (
            ParallelDims {
                dp_replicate: 2,
                dp_shard: 1,
                cp: 2,
                sp: 1,
                tp: 1,
            },
            4,
            "not pure DDP",
        ),
        (
            ParallelDims {
                dp_replicate: 0,
                dp_shard: 1,
                cp: 1,
                sp: 1,
                tp: 1,
            },
            1,
            "at least 1",
        ),
    ];
    for (dims, world, why) in cases {
        let e = DeviceMesh::new(dims, world).unwrap_err().to_string();
        for factor in [
            format!("dp_replicate={}", dims.dp_replicate),
            format!("dp_shard={}", dims.dp_shard),
            format!("cp={}", dims.cp),
            format!("sp={}", dims.sp),
            format!("tp={}", dims.tp),
            format!("world size {world}"),
        ] {
            assert!(e.contains(&factor), "{e} lacks {factor}");
        }
        assert!(e.contains(why), "{e} lacks {why}");
    }
    // Valid HSDP with tp is fine.
    DeviceMesh::new(
        ParallelDims {
            dp_replicate: 2,
            dp_shard: 2,
            cp: 1,
            sp: 1,
            tp: 2,
        },
        8,
    )
    .unwrap();
}

#[test]
fn data_parallel_fills_from_world_size() {
    let cfg = ParallelismConfig::default();
    assert_eq!(
        cfg.resolve(4, DistributedType::MultiGpu)
            .unwrap()
            .dp_replicate,
        4
    );
    assert_eq!(cfg.resolve(4, DistributedType::Fsdp).unwrap().dp_shard, 4);
    let cp = ParallelismConfig {
        cp: 2,
        ..Default::default()
    };
    let d = cp.resolve(8, DistributedType::Fsdp).unwrap();
    assert_eq!(
        (d.dp_shard, d.cp, d.dp_world(), d.token_sharing()),
        (4, 2, 4, 2)
    );
    let bad = ParallelismConfig {
        tp: 3,
        ..Default::default()
    };
    assert!(bad.resolve(4, DistributedType::Fsdp).is_err());
}

#[test]
fn env_variables_override_sizes() {
    let vars: HashMap<&str, &str> = [
        ("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2"),
        ("PARALLELISM_CONFIG_SP_SIZE", "2"),
        ("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", "false"),
    ]
    .into_iter()
    .collect();
    let cfg = ParallelismConfig::default()
        .with_env(|k| vars.get(k).map(|v| v.to_string()))
        .unwrap();
    assert_eq!(
        (cfg.dp_shard, cfg.sp, cfg.sp_seq_length_is_variable),
        (Some(2), 2, false)
    );
    let d = cfg.resolve(4, DistributedType::DeepSpeed).unwrap();
    assert_eq!((d.dp_replicate, d.dp_shard, d.sp), (1, 2, 2));
    // Round trip through the launcher's export.
    let exported: HashMap<String, String> = cfg.to_env().into_iter().collect();
    let again = ParallelismConfig::default()
        .with_env(|k| exported.get(k).cloned())
        .unwrap();
    assert_eq!((again.dp_shard, again.sp), (Some(2), 2));

    let e = ParallelismConfig::default()
        .with_env(|k| (k == "PARALLELISM_CONFIG_TP_SIZE").then(|| "zero".to_string()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("PARALLELISM_CONFIG_TP_SIZE") && e.contains("'zero'"),
        "{e}"
    );
}

#[test]
fn every_group_counts_the_time_spent_in_its_collectives() {
    use trl_runtime::comm::{InProcessWorld, ReduceOp};
    use trl_runtime::dist::DistContext;
    let dims = ParallelDims {
        dp_replicate: 1,
        dp_shard: 2,
        cp: 1,
        sp: 1,
        tp: 1,
    };
    let w = InProcessWorld::new(2);
    let seconds = InProcessWorld::run(2, |rank, _| {
        let ctx = DistContext::in_process(&w, rank, DeviceMesh::new(dims, 2).unwrap()).unwrap();
        let before = (ctx.comm_seconds(DP), ctx.comm_seconds(&[Axis::Tp]));
        // Rank 1 arrives late: rank 0's all-reduce waits for it, inside the collective.
        if rank == 1 {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let x = candle_core::Tensor::new(&[1f32, 2.0], &candle_core::Device::Cpu).unwrap();
        ctx.group(DP).all_reduce(&x, ReduceOp::Sum).unwrap();
        let after = (ctx.comm_seconds(DP), ctx.comm_seconds(&[Axis::Tp]));
        (after.0 - before.0, after.1 - before.1)
    });
    assert!(seconds[0].0 >= 0.04, "rank 0 waited {} s", seconds[0].0);
    assert_eq!(seconds[0].1, 0.0, "no tp collective ran");
}
