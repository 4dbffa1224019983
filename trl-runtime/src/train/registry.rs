//! The trainers there are, in one place: each trainer's own file under train/ declares its
//! [`TrainerKind`] and [`TRAINERS`] lists it. `cargo trl new --trainer`, `cargo trl plan
//! --trainer`, the launcher's reading of a program's flags and the planner take its name,
//! scaffold and workload from here ([`all`]), so nothing else knows a trainer by name. Adding
//! a trainer is its file(s) under train/ and one entry in [`TRAINERS`] (or [`register`], as
//! tests do).

use super::kinds::{ReadArgs, TrainerKind};

/// The built-in trainers, the first the default: flags every trainer takes read as its.
pub const TRAINERS: &[&TrainerKind] = &[
    &super::sft::KIND,
    &super::dpo::KIND,
    &super::grpo::KIND,
    &super::rloo::KIND,
    &super::kto::KIND,
    &super::reward::KIND,
    &super::distillation::KIND,
];

/// Trainers registered at run time, after the built-in ones.
static REGISTERED: std::sync::RwLock<Vec<&'static TrainerKind>> =
    std::sync::RwLock::new(Vec::new());

/// Adds a trainer after the built-in ones (one of the same name is replaced).
pub fn register(kind: &'static TrainerKind) {
    let mut extra = REGISTERED.write().unwrap_or_else(|e| e.into_inner());
    extra.retain(|k| k.name != kind.name);
    extra.push(kind);
}

/// Every trainer: the built-in ones, then those registered.
pub fn all() -> Vec<&'static TrainerKind> {
    let extra = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
    TRAINERS
        .iter()
        .copied()
        .chain(extra.iter().copied())
        .collect()
}

/// The trainer named `name`.
pub fn find(name: &str) -> Option<&'static TrainerKind> {
    all().into_iter().find(|k| k.name == name)
}

/// Every trainer's name, for a command line's choices.
pub fn names() -> Vec<&'static str> {
    all().iter().map(|k| k.name).collect()
}

/// A program's arguments read as the first trainer whose arguments they are.
pub fn read_program_args(args: &[String]) -> Option<(&'static TrainerKind, ReadArgs)> {
    all()
        .into_iter()
        .find_map(|k| (k.read)(args).map(|r| (k, r)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::estimate::Workload;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn flags_pick_the_trainer_and_its_workload() {
        let kind = |a: &[&str]| read_program_args(&args(a)).map(|(k, r)| (k.name, r.workload));
        // Flags every trainer takes read as the first's (SFT): one sequence a row.
        let common = ["--max_length", "64"];
        assert_eq!(kind(&common), Some(("sft", Workload::default())));
        // DPO, the first trainer that takes --beta: two sequences a row; TR-DPO keeps a copy
        // of the weights.
        let pairs = Workload {
            sequences_per_row: 2,
            ..Workload::default()
        };
        assert_eq!(kind(&["--beta", "0.2"]), Some(("dpo", pairs)));
        let synced = Workload {
            weight_copies: 1,
            ..pairs
        };
        assert_eq!(kind(&["--sync_ref_model", "true"]), Some(("dpo", synced)));
        assert_eq!(kind(&["--no_such_flag", "1"]), None);
        assert!(find("kto").is_some() && find("reward").is_some());
        assert_eq!(names()[0], "sft");
    }
}
