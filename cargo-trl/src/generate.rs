//! `cargo trl generate CHECKPOINT` and `cargo trl chat CHECKPOINT`: a first look at what a run
//! trained, without going back to Python. A checkpoint is a model directory (config.json and
//! weights) or a LoRA adapter (adapter_config.json: applied unmerged to its base). Prompts go
//! through the checkpoint's chat template as TRL renders conversations; generation is
//! transformers' `generate` (its GenerationConfig names and defaults, the checkpoint's
//! generation_config.json, a KV cache), on this machine's CPU in float32.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use trl_runtime::candle_core::{DType, Device};
use trl_runtime::data::{Message, TextTokenizer};
use trl_runtime::generation::{
    generate_streaming, left_pad, load_prompts, GenerationConfig, Prompt,
};
use trl_runtime::models::AutoModelForCausalLM;

/// transformers' generation settings; what is not given comes from the checkpoint's
/// generation_config.json, else transformers' defaults.
#[derive(clap::Args, Debug)]
pub struct Sampling {
    /// Tokens to generate after the prompt (transformers' default: 20).
    #[arg(long = "max_new_tokens", alias = "max-new-tokens")]
    pub max_new_tokens: Option<usize>,
    /// Sample (true) or take the most likely token (false, greedy).
    #[arg(long = "do_sample", alias = "do-sample")]
    pub do_sample: Option<bool>,
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Keep the k most likely tokens when sampling (0: off).
    #[arg(long = "top_k", alias = "top-k")]
    pub top_k: Option<usize>,
    #[arg(long = "top_p", alias = "top-p")]
    pub top_p: Option<f64>,
    #[arg(long = "min_p", alias = "min-p")]
    pub min_p: Option<f64>,
    #[arg(long = "repetition_penalty", alias = "repetition-penalty")]
    pub repetition_penalty: Option<f64>,
    /// Seeds sampling: the same seed draws the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The base model of a LoRA checkpoint (default: its adapter_config.json's
    /// base_model_name_or_path).
    #[arg(long = "model_name_or_path", alias = "model-name-or-path")]
    pub model_name_or_path: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A model directory or a LoRA checkpoint.
    pub checkpoint: PathBuf,
    /// A prompt (repeatable): a user message through the chat template when the tokenizer
    /// has one (`--no_chat_template`: the text as it is).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// Prompts from a dataset (.jsonl, .json, .parquet or a directory): TRL's `prompt`
    /// column (text or messages), or `messages` without their last assistant turn, or `text`.
    #[arg(long = "dataset_name", alias = "dataset-name")]
    pub dataset_name: Option<PathBuf>,
    /// Encode --prompt as plain text, not as a user message.
    #[arg(long = "no_chat_template", alias = "no-chat-template")]
    pub no_chat_template: bool,
    /// Where the rows go (JSONL: prompt and completion, TRL's format); default: stdout.
    #[arg(long = "output_file", alias = "output-file")]
    pub output_file: Option<PathBuf>,
    /// Prompts generated together (left-padded), as a batch.
    #[arg(long = "batch_size", alias = "batch-size", default_value_t = 8)]
    pub batch_size: usize,
    #[command(flatten)]
    pub sampling: Sampling,
}

#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    /// A model directory or a LoRA checkpoint.
    pub checkpoint: PathBuf,
    /// A system message opening the conversation.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: Sampling,
}

/// The model, its tokenizer and the generation settings of a checkpoint.
struct Loaded {
    model: AutoModelForCausalLM,
    tok: TextTokenizer,
    cfg: GenerationConfig,
}

fn load(checkpoint: &Path, s: &Sampling) -> Result<Loaded, String> {
    let err = |e: trl_runtime::Error| e.to_string();
    if !checkpoint.is_dir() {
        return Err(format!(
            "{}: not a directory (a model directory or a LoRA checkpoint)",
            checkpoint.display()
        ));
    }
    let adapter = checkpoint.join("adapter_config.json");
    let base = match (adapter.is_file(), &s.model_name_or_path) {
        (_, Some(b)) => b.clone(),
        (true, None) => {
            let text = std::fs::read_to_string(&adapter)
                .map_err(|e| format!("{}: {e}", adapter.display()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("{}: {e}", adapter.display()))?;
            let name = v["base_model_name_or_path"].as_str().ok_or_else(|| {
                format!(
                    "{}: no base_model_name_or_path: name the base with --model_name_or_path",
                    adapter.display()
                )
            })?;
            PathBuf::from(name)
        }
        (false, None) => checkpoint.to_path_buf(),
    };
    let mut model =
        AutoModelForCausalLM::from_pretrained(&base, DType::F32, &Device::Cpu).map_err(err)?;
    if adapter.is_file() {
        model.load_adapter(checkpoint).map_err(err)?;
    }
    // The checkpoint's tokenizer (a run saves it beside its weights), else the base's.
    let tok_dir = match checkpoint.join("tokenizer.json").is_file() {
        true => checkpoint,
        false => base.as_path(),
    };
    let tok = TextTokenizer::from_dir(tok_dir).map_err(err)?;
    let cfg_dir = match checkpoint.join("generation_config.json").is_file() {
        true => checkpoint,
        false => base.as_path(),
    };
    // transformers' model.generation_config: generation_config.json, else config.json's keys.
    let mut cfg = GenerationConfig::for_model(cfg_dir).map_err(err)?;
    if cfg.eos_token_id.is_empty() {
        cfg.eos_token_id.extend(tok.eos_token_id);
    }
    cfg.pad_token_id = cfg.pad_token_id.or(Some(tok.pad_token_id));
    apply(&mut cfg, s);
    cfg.check("command line").map_err(err)?;
    Ok(Loaded { model, tok, cfg })
}

/// The flags over the checkpoint's settings.
fn apply(cfg: &mut GenerationConfig, s: &Sampling) {
    cfg.seed = s.seed;
    if let Some(v) = s.max_new_tokens {
        cfg.max_new_tokens = v;
    }
    if let Some(v) = s.do_sample {
        cfg.do_sample = v;
    }
    if let Some(v) = s.temperature {
        cfg.temperature = v;
    }
    if let Some(v) = s.top_k {
        cfg.top_k = v;
    }
    if let Some(v) = s.top_p {
        cfg.top_p = v;
    }
    if s.min_p.is_some() {
        cfg.min_p = s.min_p;
    }
    if let Some(v) = s.repetition_penalty {
        cfg.repetition_penalty = v;
    }
}

impl Loaded {
    /// Completions of `prompts` (token ids), left-padded together; `on_tokens` sees each
    /// step's tokens. Each completion ends before its EOS.
    fn complete(
        &self,
        prompts: &[Vec<u32>],
        on_tokens: &mut dyn FnMut(&[u32]) -> trl_runtime::Result<()>,
    ) -> Result<Vec<Vec<u32>>, String> {
        let asked: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let pad = self.cfg.pad_token_id.unwrap_or(0);
        let (ids, mask) = left_pad(&asked, pad).map_err(|e| e.to_string())?;
        let width = ids.dim(1).map_err(|e| e.to_string())?;
        let as_rows = |t: &trl_runtime::candle_core::Tensor| t.to_vec2::<u32>();
        let (rows, mask) = (as_rows(&ids), as_rows(&mask));
        let (rows, mask) = (
            rows.map_err(|e| e.to_string())?,
            mask.map_err(|e| e.to_string())?,
        );
        let out = generate_streaming(&self.model, &rows, &mask, &self.cfg, on_tokens)
            .map_err(|e| e.to_string())?;
        Ok(out
            .into_iter()
            .map(|r| {
                let new = &r[width..];
                let end = new
                    .iter()
                    .position(|t| self.cfg.eos_token_id.contains(t))
                    .unwrap_or(new.len());
                new[..end].to_vec()
            })
            .collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tok.decode(ids, true).map_err(|e| e.to_string())
    }
}

pub fn run(args: &GenerateArgs) -> Result<String, String> {
    let loaded = load(&args.checkpoint, &args.sampling)?;
    let mut prompts: Vec<Prompt> = args
        .prompt
        .iter()
        .map(
            |p| match args.no_chat_template || !loaded.tok.has_chat_template() {
                true => Prompt::Text(p.clone()),
                false => Prompt::Messages(vec![Message::new("user", p.as_str())]),
            },
        )
        .collect();
    if let Some(d) = &args.dataset_name {
        prompts.extend(load_prompts(d).map_err(|e| e.to_string())?);
    }
    if prompts.is_empty() {
        return Err("no prompt: give --prompt TEXT or --dataset_name FILE".into());
    }
    if let Some(dir) = args.output_file.as_ref().and_then(|f| f.parent()) {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
    }
    let mut out: Box<dyn Write> = match &args.output_file {
        Some(f) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(f).map_err(|e| format!("{}: {e}", f.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let write_err = |e: std::io::Error| format!("writing the rows: {e}");
    for batch in prompts.chunks(args.batch_size.max(1)) {
        let ids = batch
            .iter()
            .map(|p| p.ids(&loaded.tok))
            .collect::<trl_runtime::Result<Vec<_>>>()
            .map_err(|e| e.to_string())?;
        let completions = loaded.complete(&ids, &mut |_| Ok(()))?;
        for (p, c) in batch.iter().zip(completions) {
            let row = p.with_completion(&loaded.decode(&c)?);
            writeln!(out, "{row}").map_err(write_err)?;
        }
    }
    out.flush().map_err(write_err)?;
    Ok(match &args.output_file {
        Some(f) => format!("{} completions in {}", prompts.len(), f.display()),
        None => String::new(),
    })
}

/// A conversation on the terminal: each line a user turn, the reply streamed as it is
/// generated; `/clear` starts over, `/exit` (or end of input) ends.
pub fn chat(args: &ChatArgs) -> Result<String, String> {
    let loaded = load(&args.checkpoint, &args.sampling)?;
    if !loaded.tok.has_chat_template() {
        return Err(format!(
            "{}: the tokenizer has no chat template (tokenizer_config.json's chat_template); \
             use `cargo trl generate --no_chat_template` for plain text",
            args.checkpoint.display()
        ));
    }
    let opening: Vec<Message> = args
        .system
        .iter()
        .map(|s| Message::new("system", s.as_str()))
        .collect();
    let mut history = opening.clone();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!(">>> ");
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| format!("reading the terminal: {e}"))?;
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/clear" => {
                history = opening.clone();
                continue;
            }
            _ => {}
        }
        history.push(Message::new("user", line.as_str()));
        let ids = Prompt::Messages(history.clone())
            .ids(&loaded.tok)
            .map_err(|e| e.to_string())?;
        // Streamed: the text decoded so far, its new part printed at each token.
        let (mut so_far, mut shown) = (Vec::new(), 0usize);
        let eos = loaded.cfg.eos_token_id.clone();
        let mut stdout = std::io::stdout();
        let reply = loaded.complete(&[ids], &mut |t: &[u32]| {
            if eos.contains(&t[0]) {
                return Ok(());
            }
            so_far.push(t[0]);
            let text = loaded.tok.decode(&so_far, true)?;
            // A token that ends inside a character decodes to U+FFFD: wait for the rest.
            if !text.ends_with('\u{FFFD}') && text.len() > shown {
                print!("{}", &text[shown..]);
                let _ = stdout.flush();
                shown = text.len();
            }
            Ok(())
        })?;
        let reply = loaded.decode(&reply[0])?;
        if reply.len() > shown {
            print!("{}", &reply[shown..]);
        }
        println!();
        history.push(Message::new("assistant", reply.as_str()));
    }
    Ok(String::new())
}
