//! The tensor-parallel example runs as two real processes (host backend) and its split model
//! trains exactly like the unsplit one.

use std::process::Command;

#[test]
fn plain_candle_model_trains_at_tp_2_like_one_process() {
    let out = Command::new(env!("CARGO_BIN_EXE_tp_plain_candle"))
        .env_remove("WORLD_SIZE")
        .env("TRL_LOCAL_PROCESSES", "2")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("losses of tp and one process agree"),
        "{text}"
    );
    // The loss went down: the first printed loss is above the last.
    let losses: Vec<f64> = text
        .lines()
        .filter_map(|l| l.split("loss tp=2 ").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert!(
        losses.len() >= 2 && losses[losses.len() - 1] < 0.5 * losses[0],
        "{losses:?}"
    );
}
