//! The launch profiles of templates/profiles, embedded so the binary works from anywhere.

use trl_runtime::config::LaunchConfig;

/// The profiles of templates/profiles, embedded so the binary works from anywhere.
pub const PROFILES: &[(&str, &str)] = &[
    (
        "single_gpu",
        include_str!("../../templates/profiles/single_gpu.yaml"),
    ),
    (
        "multi_gpu",
        include_str!("../../templates/profiles/multi_gpu.yaml"),
    ),
    ("zero1", include_str!("../../templates/profiles/zero1.yaml")),
    ("zero2", include_str!("../../templates/profiles/zero2.yaml")),
    ("zero3", include_str!("../../templates/profiles/zero3.yaml")),
    ("fsdp1", include_str!("../../templates/profiles/fsdp1.yaml")),
    ("fsdp2", include_str!("../../templates/profiles/fsdp2.yaml")),
    (
        "context_parallel_2gpu",
        include_str!("../../templates/profiles/context_parallel_2gpu.yaml"),
    ),
    (
        "alst_ulysses_4gpu",
        include_str!("../../templates/profiles/alst_ulysses_4gpu.yaml"),
    ),
    (
        "moe_ep_8gpu",
        include_str!("../../templates/profiles/moe_ep_8gpu.yaml"),
    ),
    (
        "multi_node",
        include_str!("../../templates/profiles/multi_node.yaml"),
    ),
    (
        "multi_cpu",
        include_str!("../../templates/profiles/multi_cpu.yaml"),
    ),
    (
        "zero2_cpu",
        include_str!("../../templates/profiles/zero2_cpu.yaml"),
    ),
    (
        "zero3_cpu",
        include_str!("../../templates/profiles/zero3_cpu.yaml"),
    ),
    (
        "fsdp2_cpu",
        include_str!("../../templates/profiles/fsdp2_cpu.yaml"),
    ),
    (
        "fsdp2_tp_cpu",
        include_str!("../../templates/profiles/fsdp2_tp_cpu.yaml"),
    ),
    (
        "context_parallel_cpu",
        include_str!("../../templates/profiles/context_parallel_cpu.yaml"),
    ),
    (
        "alst_ulysses_cpu",
        include_str!("../../templates/profiles/alst_ulysses_cpu.yaml"),
    ),
    (
        "moe_ep_cpu",
        include_str!("../../templates/profiles/moe_ep_cpu.yaml"),
    ),
];

/// The YAML of a profile by name.
pub fn yaml(name: &str) -> Option<&'static str> {
    PROFILES.iter().find(|(n, _)| *n == name).map(|(_, y)| *y)
}

/// A parsed profile, or an error listing the names.
pub fn load(name: &str) -> Result<LaunchConfig, String> {
    let text = yaml(name).ok_or_else(|| {
        let names: Vec<_> = PROFILES.iter().map(|(n, _)| *n).collect();
        format!("no profile named '{name}': use one of {}", names.join(", "))
    })?;
    LaunchConfig::from_yaml_str(text, &format!("profile {name}")).map_err(|e| e.to_string())
}
