//! Vision-language checkpoints whose language model is trained alone: Gemma 3's 4B and
//! larger (`model_type` gemma3, Gemma3ForConditionalGeneration), Qwen3-VL (`qwen3_vl`,
//! Qwen3VLForConditionalGeneration), Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) and Llama 4 (`llama4`, Llama4ForConditionalGeneration:
//! the hub's Scout and Maverick). Their config.json nests the language model's config
//! under `text_config`; their weight files hold its tensors under another name ([`Layout`],
//! as transformers writes them, the hub's files and `save_pretrained` alike) beside the
//! vision tower's and the projector's.
//!
//! The language model is built from the text config under its own names; the weight files
//! read them through the layout (`params::WeightFiles`) and every full checkpoint writes
//! them back under it, the other tensors copied unchanged beside them
//! (`tensor_file::Others`), so a checkpoint opens as the model it came from. Text rows never
//! reach the vision tower, and TRL leaves it as it is too (no gradient: AdamW skips it).
//! Qwen3-VL's multimodal RoPE gives text positions plain RoPE, so its language model is
//! Qwen3's. Qwen3.5 and Qwen3.5-MoE (`qwen3_5`, `qwen3_5_moe`: every Qwen3.5 on the hub) are
//! laid out as Qwen3-VL, around their own language models.

/// How a composite's files name its language model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `language_model.` before the causal LM's names (Gemma 3:
    /// `language_model.model.layers...`, `language_model.lm_head.weight`).
    Prefixed,
    /// The PyTorch tree's (Qwen3-VL: `model.language_model.layers...`, `lm_head.weight`).
    Tree,
}

const PREFIX: &str = "language_model.";

impl Layout {
    /// The files' name of the language model's tensor `name`.
    pub fn stored(self, name: &str) -> String {
        match self {
            Layout::Prefixed => format!("{PREFIX}{name}"),
            Layout::Tree => module_name(name),
        }
    }

    /// The language model's name of the files' tensor `stored`; None for another part's.
    pub fn text(self, stored: &str) -> Option<String> {
        match self {
            Layout::Prefixed => stored.strip_prefix(PREFIX).map(str::to_string),
            Layout::Tree => text_module_name(stored),
        }
    }
}

/// A wrapper `model_type` read this way: its files' layout, its PyTorch tree's (peft names
/// adapters by it), the `model_type` its language model is built as, and the sizes
/// transformers' text config defaults to (the hub's gemma-3-4b-it names only the sizes that
/// differ).
struct Wrapper {
    model_type: &'static str,
    layout: Layout,
    tree: Layout,
    text_type: &'static str,
    defaults: &'static [(&'static str, u64)],
}

const WRAPPERS: &[Wrapper] = &[
    Wrapper {
        model_type: "gemma3",
        layout: Layout::Prefixed,
        tree: Layout::Tree,
        text_type: "gemma3_text",
        defaults: &[
            ("vocab_size", 262_208),
            ("hidden_size", 2304),
            ("intermediate_size", 9216),
            ("num_hidden_layers", 26),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
        ],
    },
    Wrapper {
        // Gemma4ForConditionalGeneration: the language model under `model.language_model.`,
        // the head at `lm_head` (tied), as Qwen3-VL's tree.
        model_type: "gemma4",
        layout: Layout::Tree,
        tree: Layout::Tree,
        text_type: "gemma4_text",
        defaults: &[],
    },
    Wrapper {
        model_type: "qwen3_vl",
        layout: Layout::Tree,
        tree: Layout::Tree,
        // qwen3_vl_text: Qwen3's layers.
        text_type: "qwen3",
        defaults: &[],
    },
    Wrapper {
        // Qwen3.5 (Qwen3_5ForConditionalGeneration): Qwen3-VL's tree around Qwen3.5's
        // hybrid layers (models/qwen3_next.rs).
        model_type: "qwen3_5",
        layout: Layout::Tree,
        tree: Layout::Tree,
        text_type: "qwen3_5_text",
        defaults: &[],
    },
    Wrapper {
        model_type: "qwen3_5_moe",
        layout: Layout::Tree,
        tree: Layout::Tree,
        text_type: "qwen3_5_moe_text",
        defaults: &[],
    },
    Wrapper {
        // Llama4ForConditionalGeneration holds its Llama4ForCausalLM as `language_model`:
        // the files and the tree alike.
        model_type: "llama4",
        layout: Layout::Prefixed,
        tree: Layout::Prefixed,
        text_type: "llama4_text",
        defaults: &[
            ("vocab_size", 202_048),
            ("hidden_size", 5120),
            ("intermediate_size", 8192),
            ("num_hidden_layers", 48),
            ("num_attention_heads", 40),
            ("num_key_value_heads", 8),
        ],
    },
];

fn wrapper(config: &serde_json::Value) -> Option<&'static Wrapper> {
    let model_type = config.get("model_type")?.as_str()?;
    let found = WRAPPERS.iter().find(|w| w.model_type == model_type)?;
    config.get("text_config")?.as_object().map(|_| found)
}

/// The language model's config of a composite config.json (`text_config` as the model it
/// is built as, with the wrapper's `tie_word_embeddings` and transformers' default sizes
/// where it gives none); None for any other config.
pub fn text_config(config: &serde_json::Value) -> Option<serde_json::Value> {
    let wrapper = wrapper(config)?;
    let mut text = config.get("text_config")?.as_object()?.clone();
    text.insert("model_type".into(), wrapper.text_type.into());
    for (key, value) in wrapper.defaults {
        text.entry(*key).or_insert_with(|| (*value).into());
    }
    if let Some(tied) = config.get("tie_word_embeddings") {
        text.entry("tie_word_embeddings")
            .or_insert_with(|| tied.clone());
    }
    Some(text.into())
}

/// The layout of the weight files of model directory `dir` (None: not a composite).
pub fn layout_of_dir(dir: &std::path::Path) -> Option<Layout> {
    wrapper_of_dir(dir).map(|w| w.layout)
}

/// The layout of the PyTorch tree of model directory `dir`, by which peft names adapters
/// (None: not a composite).
pub fn tree_of_dir(dir: &std::path::Path) -> Option<Layout> {
    wrapper_of_dir(dir).map(|w| w.tree)
}

fn wrapper_of_dir(dir: &std::path::Path) -> Option<&'static Wrapper> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&text).ok()?;
    wrapper(&config)
}

/// Where the language model's modules sit in a composite's PyTorch tree (peft names
/// adapters by it, not by the files' names).
const MODULES: &str = "model.language_model.";

/// peft's name of our (the language model's) module or tensor `name` in a composite.
pub fn module_name(name: &str) -> String {
    match name.strip_prefix("model.") {
        Some(rest) => format!("{MODULES}{rest}"),
        None => name.to_string(),
    }
}

/// Ours of peft's module or tensor `name` in a composite; None for one outside the language
/// model (the vision tower's, the projector's). A target may be any dotted suffix of the
/// tree's name (peft writes `language_model.layers.0.mlp.down_proj` where a shorter one would
/// reach a vision module too): that too is made ours.
pub fn text_module_name(name: &str) -> Option<String> {
    let within = MODULES
        .strip_prefix("model.")
        .expect("the tree's modules under model.");
    match name
        .strip_prefix(MODULES)
        .or_else(|| name.strip_prefix(within))
    {
        Some(rest) => Some(format!("model.{rest}")),
        None if name.starts_with("model.") => None,
        None => Some(name.to_string()),
    }
}

/// Whether the model directory `dir` holds a composite (its config.json says).
pub fn is_composite_dir(dir: &std::path::Path) -> bool {
    layout_of_dir(dir).is_some()
}

/// config.json text `text` as the model it builds reads it: a composite's language model's
/// config ([`text_config`]), any other config as it is.
pub fn language_model_json(text: &str) -> serde_json::Result<serde_json::Value> {
    let json: serde_json::Value = serde_json::from_str(text)?;
    Ok(text_config(&json).unwrap_or(json))
}

/// The tree a composite's adapter names its language model's modules by, read off one of
/// its module or tensor names (after `base_model.model.`); None for a causal LM's name.
pub fn tree_of_module(name: &str) -> Option<Layout> {
    match () {
        _ if name.starts_with(MODULES) => Some(Layout::Tree),
        _ if name.starts_with(PREFIX) => Some(Layout::Prefixed),
        _ => None,
    }
}

/// The top-level modules of a Prefixed tree that are not the language model (Llama 4's).
const OTHER_PARTS: [&str; 2] = ["vision_model.", "multi_modal_projector."];

impl Layout {
    /// peft's name in this tree of our module or tensor `name`.
    pub fn module(self, name: &str) -> String {
        self.stored(name)
    }

    /// Ours of peft's module or tensor `name` in this tree (a target's short name such as
    /// `q_proj` as it is); None for one outside the language model.
    pub fn text_module(self, name: &str) -> Option<String> {
        match self {
            Layout::Tree => text_module_name(name),
            Layout::Prefixed => match name.strip_prefix(PREFIX) {
                Some(rest) => Some(rest.to_string()),
                None if OTHER_PARTS.iter().any(|p| name.starts_with(p)) => None,
                None => Some(name.to_string()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hub's gemma-3-4b-it config.json names few text keys (the rest are transformers'
    /// defaults) and ties the head at the top level.
    #[test]
    fn the_text_config_is_the_nested_one_with_the_wrappers_tie() {
        let hub = serde_json::json!({
            "model_type": "gemma3",
            "text_config": {"hidden_size": 2560, "model_type": "gemma3_text"},
            "vision_config": {"model_type": "siglip_vision_model"},
        });
        let text = text_config(&hub).unwrap();
        assert_eq!(text["hidden_size"], 2560);
        assert_eq!(text["num_key_value_heads"], 4);
        let tied = serde_json::json!({
            "model_type": "gemma3",
            "tie_word_embeddings": true,
            "text_config": {"hidden_size": 8},
        });
        let text = text_config(&tied).unwrap();
        assert_eq!(text["tie_word_embeddings"], true);
        assert_eq!(text["model_type"], "gemma3_text");
        assert!(text_config(&serde_json::json!({"model_type": "gemma3_text"})).is_none());
        let llama = r#"{"model_type": "llama", "text_config": {}}"#;
        assert_eq!(
            language_model_json(llama).unwrap(),
            serde_json::from_str::<serde_json::Value>(llama).unwrap()
        );
    }

    /// peft's names of a composite's modules follow the PyTorch tree
    /// (Gemma3ForConditionalGeneration: model.language_model.layers..., lm_head), and the
    /// vision tower's are not ours.
    #[test]
    fn peft_names_map_both_ways() {
        let ours = "model.layers.0.self_attn.q_proj.lora_A.weight";
        let theirs = module_name(ours);
        assert_eq!(
            theirs,
            "model.language_model.layers.0.self_attn.q_proj.lora_A.weight"
        );
        assert_eq!(text_module_name(&theirs).as_deref(), Some(ours));
        assert_eq!(module_name("lm_head.weight"), "lm_head.weight");
        assert_eq!(
            text_module_name("lm_head.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(
            text_module_name("model.vision_tower.encoder.layers.0.mlp.fc1"),
            None
        );
        // A target cut within the tree's prefix (peft's, where `layers.0.mlp.down_proj`
        // would reach a vision module too).
        assert_eq!(
            text_module_name("language_model.layers.0.mlp.down_proj").as_deref(),
            Some("model.layers.0.mlp.down_proj")
        );
    }

    /// Each layout names the language model's tensors as transformers' files do, and only
    /// those: Gemma 3's behind `language_model.`, Qwen3-VL's in the PyTorch tree.
    #[test]
    fn layouts_name_the_files_tensors() {
        let (prefixed, tree) = (Layout::Prefixed, Layout::Tree);
        let layer = "model.layers.0.mlp.up_proj.weight";
        assert_eq!(
            prefixed.stored(layer),
            "language_model.model.layers.0.mlp.up_proj.weight"
        );
        assert_eq!(
            tree.stored(layer),
            "model.language_model.layers.0.mlp.up_proj.weight"
        );
        assert_eq!(
            prefixed.stored("lm_head.weight"),
            "language_model.lm_head.weight"
        );
        assert_eq!(tree.stored("lm_head.weight"), "lm_head.weight");
        for (layout, vision) in [
            (prefixed, "vision_tower.encoder.layers.0.mlp.fc1.weight"),
            (tree, "model.visual.blocks.0.mlp.linear_fc1.weight"),
        ] {
            assert_eq!(layout.text(&layout.stored(layer)).as_deref(), Some(layer));
            assert_eq!(layout.text(vision), None);
        }
        let qwen = serde_json::json!({
            "model_type": "qwen3_vl",
            "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 8},
        });
        assert_eq!(text_config(&qwen).unwrap()["model_type"], "qwen3");
    }
}
