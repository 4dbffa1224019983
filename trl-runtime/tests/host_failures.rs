//! Host backend failure modes: a peer that leaves mid-job, a peer that never comes, and a
//! connection from another job.

mod common;

use candle_core::{DType, Device, Tensor};
use std::time::{Duration, Instant};
use trl_runtime::comm::ReduceOp;

#[test]
fn a_departed_peer_is_an_error_not_a_hang() {
    for shm in [true, false] {
        departed_peer(shm);
    }
}

fn departed_peer(shm: bool) {
    let start = Instant::now();
    let results = common::run_host(2, Duration::from_secs(20), |rank, host| {
        let comm = host
            .clone_with_shared_memory(shm)
            .group("world", &[0, 1])
            .unwrap();
        let x = Tensor::ones(1 << 16, DType::F32, &Device::Cpu).unwrap();
        comm.all_reduce(&x, ReduceOp::Sum).unwrap();
        if rank == 1 {
            drop(comm); // closes the sockets, as a crashed process would
            return Ok(());
        }
        comm.all_reduce(&x, ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    let err = results[0].as_ref().unwrap_err();
    assert!(err.contains("rank 1 closed its connection"), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn a_silent_peer_times_out() {
    let results = common::run_host(2, Duration::from_millis(500), |rank, host| {
        let comm = host.group("world", &[0, 1]).unwrap();
        let x = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        comm.all_reduce(&x, ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    let err = results[0].as_ref().unwrap_err();
    assert!(err.contains("no data from rank 1"), "{err}");
}

#[test]
fn a_missing_member_is_named() {
    let results = common::run_host(3, Duration::from_millis(500), |rank, host| {
        if rank == 2 {
            return Ok(());
        }
        host.group("world", &[0, 1, 2])
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    let err = results[0].as_ref().unwrap_err();
    assert!(
        err.contains("[2]") && err.contains("did not connect"),
        "{err}"
    );
}

#[test]
fn subgroups_have_their_own_connections() {
    common::run_host(4, Duration::from_secs(20), |rank, host| {
        let pair = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
        let sub = host.group("tp", &pair).unwrap();
        let world = host.group("world", &[0, 1, 2, 3]).unwrap();
        let x = Tensor::new(&[rank as f32], &Device::Cpu).unwrap();
        let s: Vec<f32> = sub
            .all_reduce(&x, ReduceOp::Sum)
            .unwrap()
            .to_vec1()
            .unwrap();
        let w: Vec<f32> = world
            .all_reduce(&x, ReduceOp::Sum)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(s[0], if rank < 2 { 1.0 } else { 5.0 });
        assert_eq!(w[0], 6.0);
        assert_eq!((sub.rank(), sub.size()), (rank % 2, 2));
    });
}
