//! Mixture-of-experts adapters in peft's transformers 5 layout. transformers 5 holds a
//! layer's experts as fused 3-D parameters (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
//! first; `mlp.experts.down_proj` [E, H, I]; the router `mlp.gate.weight`), and peft adapts
//! them with `target_parameters`: one `ParamWrapper` per parameter, `lora_A` [E x R, in]
//! (expert-major rows) and `lora_B` [out, R x E] (column `k x E + e` is expert `e`'s `k`-th),
//! the gate_up wrapper inside the down one (`experts.base_layer.lora_A`) when both are adapted.
//! Our models keep one layer per expert projection (transformers 4's names), each expert's gate
//! and up sharing one `A` of rank R = 2r ([`crate::nn::lora::adapter_plan`]): [`fuse`] writes
//! that as peft's tensors, [`unfuse`] reads them back, exactly.

use crate::error::{Error, Result};
use crate::nn::lora::{EXPERT_DOWN, EXPERT_GATE, EXPERT_UP};
use candle_core::Tensor;
use std::collections::{BTreeMap, HashMap, HashSet};

/// peft's `target_parameters` names.
pub const GATE_UP: &str = "gate_up_proj";
pub const DOWN: &str = "down_proj";
pub const ROUTER: &str = "gate.weight";

/// Which fused projection an expert layer of ours belongs to.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    Gate,
    Up,
    Down,
}

const ROLES: [(Role, [&str; 2]); 3] = [
    (Role::Gate, EXPERT_GATE),
    (Role::Up, EXPERT_UP),
    (Role::Down, EXPERT_DOWN),
];

fn role(leaf: &str) -> Option<Role> {
    ROLES
        .iter()
        .find(|(_, names)| names.contains(&leaf))
        .map(|(r, _)| *r)
}

/// transformers 5's name of a MoE block (Mixtral's `block_sparse_moe` became `mlp`).
fn v5_block(block: &str) -> String {
    match block.strip_suffix(".block_sparse_moe") {
        Some(layer) => format!("{layer}.mlp"),
        None => block.to_string(),
    }
}

/// One expert's adapter tensors, by role and part (A, B).
#[derive(Default)]
struct Expert {
    parts: BTreeMap<(Role, char), Tensor>,
}

/// Our tensors (full size, by our names) with the experts' adapters fused as peft holds
/// them, and the `target_parameters` they need (empty for a model without experts).
pub struct Fused {
    pub tensors: BTreeMap<String, Tensor>,
    pub target_parameters: Vec<&'static str>,
    /// Our names of the layers adapted through `target_parameters` (not target_modules).
    pub parameter_layers: HashSet<String>,
}

/// Our per-expert adapter tensors as peft's fused ones (see the module docs).
pub fn fuse(tensors: &BTreeMap<String, Tensor>) -> Result<Fused> {
    let has_experts = tensors.keys().any(|n| n.contains(".experts."));
    let mut out = BTreeMap::new();
    let mut blocks: BTreeMap<String, BTreeMap<usize, Expert>> = BTreeMap::new();
    let mut parameter_layers = HashSet::new();
    let mut router = false;
    for (name, t) in tensors {
        if let Some((block, rest)) = name.split_once(".experts.") {
            // rest: "{e}.{projection}.lora_{A,B}.weight"
            let parts: Vec<&str> = rest.split('.').collect();
            if let [e, leaf, part @ ("lora_A" | "lora_B"), "weight"] = parts.as_slice() {
                if let (Ok(e), Some(r)) = (e.parse::<usize>(), role(leaf)) {
                    let key = (r, part.chars().last().unwrap_or('A'));
                    blocks
                        .entry(v5_block(block))
                        .or_default()
                        .entry(e)
                        .or_default()
                        .parts
                        .insert(key, t.clone());
                    parameter_layers.insert(format!("{block}.experts.{e}.{leaf}"));
                    continue;
                }
            }
            return Err(unexpected(name));
        }
        // The router (a `gate` beside experts) is a parameter peft adapts directly too.
        let router_part = [".gate.lora_A.weight", ".gate.lora_B.weight"]
            .into_iter()
            .find_map(|p| Some((name.strip_suffix(p)?, p)))
            .filter(|_| has_experts);
        match router_part {
            Some((block, part)) => {
                out.insert(format!("{}{part}", v5_block(block)), t.clone());
                parameter_layers.insert(format!("{block}.gate"));
                router = true;
            }
            None => {
                out.insert(name.clone(), t.clone());
            }
        }
    }
    let (mut gate_up, mut down) = (false, false);
    for (block, experts) in &blocks {
        let n = experts.len();
        if experts.keys().copied().ne(0..n) {
            return Err(Error::Parallelism(format!(
                "{block}: adapters of experts {:?}, not 0..{n}",
                experts.keys().collect::<Vec<_>>()
            )));
        }
        let get = |e: &Expert, role: Role, part: char| -> Result<Tensor> {
            e.parts.get(&(role, part)).cloned().ok_or_else(|| {
                Error::Parallelism(format!(
                    "{block}: an expert lacks the {} adapter's {part} of its fused projection",
                    match role {
                        Role::Gate => "gate",
                        Role::Up => "up",
                        Role::Down => "down",
                    }
                ))
            })
        };
        let has = |role: Role| {
            experts
                .values()
                .any(|e| e.parts.keys().any(|k| k.0 == role))
        };
        let (gu, dn) = (has(Role::Gate) || has(Role::Up), has(Role::Down));
        // Each fused projection: A rows expert-major; B [E, out, R] -> [out, R x E], column
        // k x E + e. gate_up's B stacks each expert's gate and up Bs (its A is shared).
        let mut write = |at: &str, roles: &[Role]| -> Result<()> {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for e in experts.values() {
                a.push(get(e, roles[0], 'A')?);
                let bs: Vec<Tensor> = roles
                    .iter()
                    .map(|&r| get(e, r, 'B'))
                    .collect::<Result<_>>()?;
                b.push(Tensor::cat(&bs, 0)?);
            }
            let s = Tensor::stack(&b, 0)?.permute((1, 2, 0))?;
            let (o, r, e) = s.dims3()?;
            out.insert(format!("{block}.{at}.lora_A.weight"), Tensor::cat(&a, 0)?);
            out.insert(
                format!("{block}.{at}.lora_B.weight"),
                s.contiguous()?.reshape((o, r * e))?,
            );
            Ok(())
        };
        if gu {
            // The gate_up wrapper sits inside the down one when both exist.
            write(
                if dn { "experts.base_layer" } else { "experts" },
                &[Role::Gate, Role::Up],
            )?;
            gate_up = true;
        }
        if dn {
            write("experts", &[Role::Down])?;
            down = true;
        }
    }
    let target_parameters = [(gate_up, GATE_UP), (down, DOWN), (router, ROUTER)]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
    Ok(Fused {
        tensors: out,
        target_parameters,
        parameter_layers,
    })
}

fn unexpected(name: &str) -> Error {
    Error::Parallelism(format!(
        "{name}: an expert adapter tensor of no projection peft fuses (gate_proj, up_proj, down_proj, w1, w3, w2)"
    ))
}

/// peft's fused expert adapters (`target_parameters`, the gate_up rank `gate_up_rank`, the
/// down rank `r`) as our per-expert tensors, named as Qwen3-MoE names its layers
/// (`mlp.experts.{e}.gate_proj`; [`align`] renames them for a model that names them
/// otherwise). Other tensors pass unchanged.
pub fn unfuse(
    tensors: BTreeMap<String, Tensor>,
    target_parameters: &[String],
    (gate_up_rank, r): (usize, usize),
    source: &str,
) -> Result<BTreeMap<String, Tensor>> {
    let has = |p: &str| target_parameters.iter().any(|t| t == p);
    let (gu, dn) = (has(GATE_UP), has(DOWN));
    let mut out = BTreeMap::new();
    for (name, t) in tensors {
        let Some((block, rest)) = name.split_once(".experts.") else {
            out.insert(name, t);
            continue;
        };
        let (inner, part) = match rest {
            "base_layer.lora_A.weight" => (true, 'A'),
            "base_layer.lora_B.weight" => (true, 'B'),
            "lora_A.weight" => (false, 'A'),
            "lora_B.weight" => (false, 'B'),
            _ => {
                return Err(Error::config(
                    source,
                    &name,
                    "an expert adapter tensor peft does not write (expected experts[.base_layer].lora_A/B.weight)",
                ))
            }
        };
        let gate_up = match (gu, dn, inner) {
            (true, true, true) | (true, false, false) => true,
            (_, true, false) => false,
            _ => {
                return Err(Error::config(
                    source,
                    &name,
                    format!("not among the target_parameters {target_parameters:?}"),
                ))
            }
        };
        let rank = if gate_up { gate_up_rank } else { r };
        let bad = |m: String| Error::config(source, &name, m);
        match part {
            'A' => {
                let (rows, _) = t.dims2()?;
                if rows % rank != 0 {
                    return Err(bad(format!("{rows} rows for rank {rank}")));
                }
                for e in 0..rows / rank {
                    let a = t.narrow(0, e * rank, rank)?;
                    let leaf = if gate_up { "gate_proj" } else { "down_proj" };
                    out.insert(format!("{block}.experts.{e}.{leaf}.lora_A.weight"), a);
                }
            }
            _ => {
                let (o, cols) = t.dims2()?;
                if cols % rank != 0 {
                    return Err(bad(format!("{cols} columns for rank {rank}")));
                }
                let experts = cols / rank;
                // [out, R x E] -> [E, out, R].
                let per = t.reshape((o, rank, experts))?.permute((2, 0, 1))?;
                for e in 0..experts {
                    let b = per.get(e)?.contiguous()?;
                    if gate_up {
                        let half = o / 2;
                        for (leaf, at) in [("gate_proj", 0), ("up_proj", half)] {
                            out.insert(
                                format!("{block}.experts.{e}.{leaf}.lora_B.weight"),
                                b.narrow(0, at, half)?.contiguous()?,
                            );
                        }
                    } else {
                        out.insert(format!("{block}.experts.{e}.down_proj.lora_B.weight"), b);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// `name` as the model names it: itself when `ours` has it, else Mixtral's names of the same
/// tensor (`block_sparse_moe`, w1 / w3 / w2) when it has those.
pub fn align(name: &str, ours: &HashSet<&str>) -> String {
    if ours.contains(name) {
        return name.to_string();
    }
    let mut mixtral = name
        .replace(".mlp.experts.", ".block_sparse_moe.experts.")
        .replace(".mlp.gate.", ".block_sparse_moe.gate.");
    for [qwen, theirs] in [EXPERT_GATE, EXPERT_UP, EXPERT_DOWN] {
        mixtral = mixtral.replace(&format!(".{qwen}."), &format!(".{theirs}."));
    }
    match ours.contains(mixtral.as_str()) {
        true => mixtral,
        false => name.to_string(),
    }
}

/// peft's names for adapters on parameters (`target_parameters`): each adapted parameter is
/// wrapped in a ParamWrapper around its module, in the order the module registers its
/// parameters, so the first wrapped sits innermost: gpt-oss's experts with both fused
/// projections adapted keep gate_up_proj's adapter as `mlp.experts.base_layer.lora_A.weight`
/// and down_proj's as `mlp.experts.lora_A.weight`. `adapted` lists the adapted parameters in
/// the model's order; returns, for each, its adapter's peft prefix (`...experts.base_layer`).
pub fn wrapper_prefixes(adapted: &[String]) -> BTreeMap<String, String> {
    let module = |p: &str| {
        p.rsplit_once('.')
            .map_or(String::new(), |(m, _)| m.to_string())
    };
    adapted
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let m = module(p);
            let later = adapted[i + 1..].iter().filter(|q| module(q) == m).count();
            (p.clone(), format!("{m}{}", ".base_layer".repeat(later)))
        })
        .collect()
}

/// Our names of the adapters on the parameters `adapted` (in the model's order) and peft's
/// (see [`wrapper_prefixes`]), as (ours, peft's).
fn wrapper_names(adapted: &[String]) -> Vec<(String, String)> {
    wrapper_prefixes(adapted)
        .into_iter()
        .flat_map(|(p, prefix)| {
            ["lora_A.weight", "lora_B.weight"]
                .map(|part| (format!("{p}.{part}"), format!("{prefix}.{part}")))
        })
        .collect()
}

/// `tensors` with the names `renamed` maps renamed; others pass unchanged.
fn rename(
    tensors: BTreeMap<String, Tensor>,
    renamed: HashMap<String, String>,
) -> BTreeMap<String, Tensor> {
    tensors
        .into_iter()
        .map(|(name, t)| (renamed.get(&name).cloned().unwrap_or(name), t))
        .collect()
}

/// Our adapter tensors on parameters (`{parameter}.lora_A.weight`) under peft's names;
/// `adapted` in the model's order. Other tensors pass unchanged.
pub fn nest(tensors: BTreeMap<String, Tensor>, adapted: &[String]) -> BTreeMap<String, Tensor> {
    rename(tensors, wrapper_names(adapted).into_iter().collect())
}

/// The inverse of [`nest`]: peft's names of adapters on the parameters `adapted` (in the
/// model's order) back to ours; other tensors pass unchanged.
pub fn unnest(tensors: BTreeMap<String, Tensor>, adapted: &[String]) -> BTreeMap<String, Tensor> {
    let back = wrapper_names(adapted).into_iter().map(|(o, p)| (p, o));
    rename(tensors, back.collect())
}
