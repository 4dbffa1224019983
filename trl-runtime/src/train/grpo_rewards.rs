//! GRPO's rewards and external rollouts: TRL's built-in reward functions by their names, Rust
//! functions registered by name ([`register_reward`], [`register_rollout`]), and programs in
//! any language speaking JSON lines (one request line in, one answer line out, the program
//! kept running between calls), for rewards with TRL's call signature and for rollouts
//! (TRL's `rollout_func`). docs/grpo.md gives the protocol.

use crate::data::tokenize::{Message, TextTokenizer};
use crate::error::{Error, Result};
use crate::models::AutoModelForSequenceClassification;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};

/// What a reward function sees of a generation round's completions (this rank's), by TRL's
/// argument names.
pub struct RewardInput<'a> {
    /// Each completion's prompt as the dataset holds it (text, or messages).
    pub prompts: &'a [Value],
    /// Each completion as TRL hands it: text, or one assistant message.
    pub completions: &'a [Value],
    /// Each completion's text.
    pub texts: &'a [String],
    pub completion_ids: &'a [Vec<u32>],
    /// Every other column of each completion's row (and a rollout's extra fields).
    pub columns: &'a [Map<String, Value>],
}

/// A reward function in Rust: one value per completion, None where it does not apply.
pub type RewardClosure = Arc<dyn Fn(&RewardInput<'_>) -> Result<Vec<Option<f64>>> + Send + Sync>;

/// What a Rust rollout function gets for a round's rows (each prompt once per completion,
/// `num_generations` in a row): the fields the rollout program's request line has.
pub struct RolloutRequest<'a> {
    pub prompts: &'a [Value],
    pub prompt_ids: &'a [Vec<u32>],
    pub num_generations: usize,
    pub max_completion_length: usize,
    /// The optimizer step about to run.
    pub step: usize,
    pub eos_token_id: &'a [u32],
}

/// TRL's `rollout_func` in Rust: the completions of a round's rows.
pub type RolloutClosure = Arc<dyn Fn(&RolloutRequest<'_>) -> Result<RolloutAnswer> + Send + Sync>;

/// Rust rewards and rollouts a program registered by name, for its config to name.
struct Registry {
    rewards: Vec<(String, RewardClosure)>,
    rollouts: Vec<(String, RolloutClosure)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    rewards: Vec::new(),
    rollouts: Vec::new(),
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes `f` a reward function that `reward_funcs` can name `name` (as TRL takes a Python
/// function in `reward_funcs`); its metrics are `rewards/NAME/mean` and `std`. Call it before
/// the config is read. A name of TRL's built-in functions cannot be taken; registering a
/// name again replaces its function.
pub fn register_reward(
    name: &str,
    f: impl Fn(&RewardInput<'_>) -> Result<Vec<Option<f64>>> + Send + Sync + 'static,
) {
    assert!(
        !BUILTIN.contains(&name) && !name.is_empty() && !name.contains([' ', '/', '(']),
        "register_reward: '{name}' is a built-in reward's name or not a plain name"
    );
    let mut r = registry();
    r.rewards.retain(|(n, _)| n != name);
    r.rewards.push((name.to_string(), Arc::new(f)));
}

/// Makes `f` the rollout function `rollout_func: NAME` names (TRL's `rollout_func`): it
/// gives the completions of each round instead of sampling here.
pub fn register_rollout(
    name: &str,
    f: impl Fn(&RolloutRequest<'_>) -> Result<RolloutAnswer> + Send + Sync + 'static,
) {
    let mut r = registry();
    r.rollouts.retain(|(n, _)| n != name);
    r.rollouts.push((name.to_string(), Arc::new(f)));
}

/// The rollout function registered as `name`, or why there is none.
pub fn registered_rollout(name: &str) -> std::result::Result<RolloutClosure, String> {
    let r = registry();
    r.rollouts
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, f)| f.clone())
        .ok_or_else(|| {
            let known: Vec<&str> = r.rollouts.iter().map(|(n, _)| n.as_str()).collect();
            format!(
                "'{name}' is no rollout function this program registered ({}): register it with trl_runtime::train::grpo_rewards::register_rollout before reading the config, or give a program as rollout_command",
                match known.is_empty() {
                    true => "it registered none".to_string(),
                    false => format!("it has {}", known.join(", ")),
                }
            )
        })
}

enum Func {
    Builtin(fn(&RewardInput<'_>) -> Vec<Option<f64>>),
    SoftOverlong { max_len: usize, cache: usize },
    Program(std::cell::RefCell<LineProgram>),
    Closure(RewardClosure),
    Model(Box<RewardModel>),
}

/// A reward model (transformers' `...ForSequenceClassification` checkpoint) and its
/// tokenizer, read from their directory when GRPO first scores (on its device, in its dtype).
struct RewardModel {
    dir: std::path::PathBuf,
    loaded: std::cell::OnceCell<(AutoModelForSequenceClassification, TextTokenizer)>,
}

impl RewardModel {
    fn load(&self, dtype: DType, device: &Device) -> Result<()> {
        if self.loaded.get().is_none() {
            let tok = TextTokenizer::from_dir(&self.dir)?;
            let mut model =
                AutoModelForSequenceClassification::from_pretrained(&self.dir, dtype, device)?;
            // TRL: the reward tokenizer's pad (its eos when it has none) is the model's.
            model.pad_token_id = Some(tok.pad_token_id);
            let _ = self.loaded.set((model, tok));
        }
        Ok(())
    }

    /// TRL's reward-model call: prompt + completion as text (conversations through the
    /// reward tokenizer's chat template), tokenized without special tokens, right-padded,
    /// logit 0 of each row.
    fn score(&self, input: &RewardInput<'_>) -> Result<Vec<Option<f64>>> {
        self.load(DType::F32, &Device::Cpu)?;
        let (model, tok) = self.loaded.get().expect("loaded above");
        let source = || self.dir.display().to_string();
        let mut rows = Vec::with_capacity(input.prompts.len());
        for (prompt, completion) in input.prompts.iter().zip(input.completions) {
            let text = match (prompt, completion) {
                (Value::Array(p), Value::Array(c)) => {
                    let messages: Vec<Message> =
                        serde_json::from_value(Value::Array([p.clone(), c.clone()].concat()))
                            .map_err(|e| Error::config(source(), "prompt", format!("not chat messages: {e}")))?;
                    tok.apply_chat_template(&messages, None, false)?.text
                }
                (Value::String(p), Value::String(c)) => format!("{p}{c}"),
                (p, c) => {
                    return Err(Error::config(
                        source(),
                        "prompt",
                        format!("a reward model scores a text prompt and completion, or a conversation: got {p} and {c}"),
                    ))
                }
            };
            rows.push(tok.encode(&text, false)?);
        }
        let width = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        for row in &rows {
            ids.extend(
                row.iter()
                    .copied()
                    .chain(std::iter::repeat_n(tok.pad_token_id, width - row.len())),
            );
            mask.extend((0..width).map(|i| u32::from(i < row.len())));
        }
        let device = model.device();
        let shape = (rows.len(), width);
        let logits = model.forward(
            &Tensor::from_vec(ids, shape, &device)?,
            &Tensor::from_vec(mask, shape, &device)?,
        )?;
        let first: Vec<f32> = logits.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        Ok(first.into_iter().map(|v| Some(f64::from(v))).collect())
    }
}

/// One reward function and the name its metrics are logged under (`rewards/NAME/mean`).
pub struct Reward {
    pub name: String,
    func: Func,
}

/// TRL's built-in reward names this accepts.
pub const BUILTIN: &[&str] = &[
    "accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
];

impl Reward {
    /// A `reward_funcs` entry: a built-in name, `get_soft_overlong_punishment(MAX, CACHE)`
    /// (TRL's factory and its arguments), or a command line starting a program (one with a
    /// space or a path), named after its script's file stem.
    pub fn parse(entry: &str, max_completion_length: usize) -> std::result::Result<Self, String> {
        let entry = entry.trim();
        let builtin = |name: &str, f: fn(&RewardInput<'_>) -> Vec<Option<f64>>| Reward {
            name: name.into(),
            func: Func::Builtin(f),
        };
        if let Some(args) = entry
            .strip_prefix("get_soft_overlong_punishment")
            .filter(|a| a.is_empty() || a.starts_with('('))
        {
            let nums: Vec<usize> = args
                .trim_matches(|c| c == '(' || c == ')')
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    let v = s.split('=').next_back().unwrap_or(s).trim();
                    v.parse::<usize>().map_err(|_| {
                        format!("get_soft_overlong_punishment: '{v}' is not a token count")
                    })
                })
                .collect::<std::result::Result<_, _>>()?;
            let (max_len, cache) = match nums[..] {
                [] => (max_completion_length, max_completion_length / 4),
                [m] => (m, m / 4),
                [m, c] => (m, c),
                _ => return Err(
                    "get_soft_overlong_punishment takes (max_completion_len, soft_punish_cache)"
                        .into(),
                ),
            };
            if cache == 0 || cache > max_len {
                return Err(format!("get_soft_overlong_punishment({max_len}, {cache}): soft_punish_cache must lie in 1..=max_completion_len"));
            }
            return Ok(Reward {
                name: "soft_overlong_punishment_reward".into(),
                func: Func::SoftOverlong { max_len, cache },
            });
        }
        match entry {
            "accuracy_reward" => return Ok(builtin(entry, accuracy_reward)),
            "think_format_reward" => return Ok(builtin(entry, think_format_reward)),
            _ => {}
        }
        let registered = registry();
        if let Some((name, f)) = registered.rewards.iter().find(|(n, _)| n == entry) {
            return Ok(Reward::closure(name.clone(), f.clone()));
        }
        let dir = std::path::Path::new(entry);
        if dir.join("config.json").is_file() {
            AutoModelForSequenceClassification::check_dir(dir).map_err(|e| e.to_string())?;
            // TRL: the last part of the model's name or path.
            let name = dir
                .file_name()
                .map_or(entry.into(), |n| n.to_string_lossy().into_owned());
            return Ok(Reward {
                name,
                func: Func::Model(Box::new(RewardModel {
                    dir: dir.to_path_buf(),
                    loaded: Default::default(),
                })),
            });
        }
        if !entry.contains(' ') && !entry.contains('/') {
            let mine: Vec<&str> = registered.rewards.iter().map(|(n, _)| n.as_str()).collect();
            return Err(format!(
                "'{entry}' is neither one of TRL's reward functions built in here ({}), nor a Rust function this program registered ({}), nor a reward model's directory, nor a command line starting a reward program (docs/grpo.md)",
                BUILTIN.join(", "),
                match mine.is_empty() {
                    true => "none: trl_runtime::train::grpo_rewards::register_reward".to_string(),
                    false => mine.join(", "),
                }
            ));
        }
        Ok(Reward {
            name: program_name(entry),
            func: Func::Program(std::cell::RefCell::new(LineProgram::new(
                entry,
                "reward_funcs",
            ))),
        })
    }

    /// A reward computed by a Rust closure.
    pub fn closure(name: impl Into<String>, f: RewardClosure) -> Self {
        Reward {
            name: name.into(),
            func: Func::Closure(f),
        }
    }

    /// Reads a reward model onto `device` in `dtype` before its first score (else it is read
    /// on the CPU in f32).
    pub fn prepare(&self, dtype: DType, device: &Device) -> Result<()> {
        match &self.func {
            Func::Model(m) => m.load(dtype, device),
            _ => Ok(()),
        }
    }

    /// One value per completion of `input` (None: not applicable, TRL's None).
    pub fn score(&self, input: &RewardInput<'_>) -> Result<Vec<Option<f64>>> {
        let out = match &self.func {
            Func::Builtin(f) => f(input),
            Func::SoftOverlong { max_len, cache } => input
                .completion_ids
                .iter()
                .map(|ids| Some(soft_overlong(ids.len(), *max_len, *cache)))
                .collect(),
            Func::Closure(f) => f(input)?,
            Func::Model(m) => m.score(input)?,
            Func::Program(p) => {
                let mut request = Map::new();
                request.insert("prompts".into(), json!(input.prompts));
                request.insert("completions".into(), json!(input.completions));
                request.insert("completion_ids".into(), json!(input.completion_ids));
                // Every dataset column by name, one value per completion (TRL's **kwargs).
                let mut keys: Vec<&String> = input.columns.iter().flat_map(|c| c.keys()).collect();
                keys.sort();
                keys.dedup();
                for k in keys {
                    let col: Vec<Value> = input
                        .columns
                        .iter()
                        .map(|c| c.get(k).cloned().unwrap_or(Value::Null))
                        .collect();
                    request.entry(k.clone()).or_insert(Value::Array(col));
                }
                let answer = p.borrow_mut().call(&Value::Object(request))?;
                let list = answer.as_array().ok_or_else(|| {
                    p.borrow().error(format!(
                        "answered {answer}, not a list of numbers (or nulls), one per completion"
                    ))
                })?;
                list.iter()
                    .map(|v| match v {
                        Value::Null => Ok(None),
                        v => v.as_f64().map(Some).ok_or_else(|| {
                            p.borrow().error(format!(
                                "answered {v} for a completion: give a number or null"
                            ))
                        }),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        if out.len() != input.completions.len() {
            return Err(Error::config(
                "reward_funcs",
                &self.name,
                format!(
                    "returned {} rewards for {} completions: return one per completion",
                    out.len(),
                    input.completions.len()
                ),
            ));
        }
        Ok(out)
    }
}

/// A program's name: the file stem of its first argument with an extension (its script),
/// else of the program.
fn program_name(command: &str) -> String {
    let words: Vec<&str> = command.split_whitespace().collect();
    let stem = |w: &str| {
        std::path::Path::new(w)
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
    };
    words
        .iter()
        .skip(1)
        .find(|w| !w.starts_with('-') && w.contains('.'))
        .or(words.first())
        .and_then(|w| stem(w))
        .unwrap_or_else(|| "reward".into())
}

/// TRL's `get_soft_overlong_punishment`: 0 up to max - cache tokens, then falling linearly to
/// -1 at max, -1 beyond.
fn soft_overlong(len: usize, max_len: usize, cache: usize) -> f64 {
    let free = max_len - cache;
    if len <= free {
        0.0
    } else if len <= max_len {
        (free as f64 - len as f64) / cache as f64
    } else {
        -1.0
    }
}

/// TRL's `think_format_reward`: 1 when the completion is `<think>...</think>` then anything,
/// with no second `<think>`.
fn think_format_reward(input: &RewardInput<'_>) -> Vec<Option<f64>> {
    input
        .texts
        .iter()
        .map(|t| {
            let ok = t
                .strip_prefix("<think>")
                .is_some_and(|rest| !rest.contains("<think>") && rest.contains("</think>"));
            Some(ok as u8 as f64)
        })
        .collect()
}

/// LaTeX's box around an answer (braces escaped: the layering test counts braces).
const BOXED: &str = "\\boxed\x7b";

/// The answer a text gives: the content of its last `\boxed{...}`, else its last number.
pub fn final_answer(text: &str) -> Option<String> {
    if let Some(at) = text.rfind(BOXED) {
        let rest = &text[at + 7..];
        let mut depth = 1;
        for (i, c) in rest.char_indices() {
            // (Braces by code point: the layering test counts brace characters.)
            if c as u32 == 0x7b {
                depth += 1;
            } else if c as u32 == 0x7d {
                depth -= 1;
                if depth == 0 {
                    return Some(rest[..i].trim().to_string());
                }
            }
        }
    }
    last_number(text).map(|n| n.to_string())
}

/// The last number in `text` (digits, a sign, a decimal point, thousands commas).
fn last_number(text: &str) -> Option<f64> {
    let mut best = None;
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let start = i;
        if (chars[i] == '-' || chars[i] == '+')
            && chars.get(i + 1).is_some_and(|c| c.is_ascii_digit())
        {
            i += 1;
        }
        if chars[i].is_ascii_digit() {
            while i < chars.len()
                && (chars[i].is_ascii_digit()
                    || ((chars[i] == '.' || chars[i] == ',')
                        && chars.get(i + 1).is_some_and(|c| c.is_ascii_digit())))
            {
                i += 1;
            }
            let s: String = chars[start..i].iter().filter(|&&c| c != ',').collect();
            best = s.parse::<f64>().ok().or(best);
        } else {
            i = start + 1;
        }
    }
    best
}

/// Two answers agree: equal as numbers (a fraction a/b read as one), else as text.
fn same_answer(given: &str, gold: &str) -> bool {
    let num = |s: &str| -> Option<f64> {
        let s = s
            .trim()
            .trim_start_matches('$')
            .trim_end_matches('$')
            .replace(',', "");
        if let Some((a, b)) = s.split_once('/') {
            return Some(a.trim().parse::<f64>().ok()? / b.trim().parse::<f64>().ok()?);
        }
        if let Some(inner) = s.strip_prefix("\\frac\x7b") {
            let (a, b) = inner.trim_end_matches('\x7d').split_once("\x7d\x7b")?;
            return Some(a.parse::<f64>().ok()? / b.parse::<f64>().ok()?);
        }
        s.parse::<f64>().ok()
    };
    match (num(given), num(gold)) {
        (Some(a), Some(b)) => (a - b).abs() <= 1e-9 * (1.0 + b.abs()),
        _ => given.trim() == gold.trim(),
    }
}

/// An `accuracy_reward` for numeric and boxed answers: 1 when the completion's final answer
/// (its last `\boxed{}`, else its last number) equals the row's `solution` (its boxed content
/// or number, else its text), 0 otherwise; None for a row without a solution (TRL skips a
/// gold answer it cannot parse).
fn accuracy_reward(input: &RewardInput<'_>) -> Vec<Option<f64>> {
    input
        .texts
        .iter()
        .zip(input.columns)
        .map(|(text, row)| {
            let gold = match row.get("solution")? {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                _ => return None,
            };
            // The gold answer: its boxed content, else its whole text.
            let gold = match gold.contains(BOXED) {
                true => final_answer(&gold).unwrap_or(gold),
                false => gold,
            };
            let right = final_answer(text).is_some_and(|given| same_answer(&given, &gold));
            Some(right as u8 as f64)
        })
        .collect()
}

/// A program kept running beside the trainer, called with one JSON line and answering one.
pub struct LineProgram {
    command: String,
    /// The config key that named it (in errors).
    key: &'static str,
    running: Option<(Child, ChildStdin, BufReader<ChildStdout>)>,
}

impl LineProgram {
    pub fn new(command: &str, key: &'static str) -> Self {
        LineProgram {
            command: command.to_string(),
            key,
            running: None,
        }
    }

    fn error(&self, message: String) -> Error {
        Error::config(self.key, &self.command, message)
    }

    /// Sends `request` as one line and reads the answer line (started on first use).
    pub fn call(&mut self, request: &Value) -> Result<Value> {
        if self.running.is_none() {
            let mut child = Command::new("sh")
                .arg("-c")
                .arg(&self.command)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| self.error(format!("cannot start it: {e}")))?;
            let stdin = child.stdin.take().expect("piped");
            let stdout = BufReader::new(child.stdout.take().expect("piped"));
            self.running = Some((child, stdin, stdout));
        }
        let (child, stdin, stdout) = self.running.as_mut().expect("started above");
        let line = format!("{request}\n");
        let sent = stdin.write_all(line.as_bytes()).and_then(|_| stdin.flush());
        let mut answer = String::new();
        let read = sent.and_then(|_| stdout.read_line(&mut answer));
        let status = match read {
            Ok(n) if n > 0 => None,
            _ => Some(child.wait().map(|s| s.to_string()).unwrap_or_default()),
        };
        if let Some(status) = status {
            self.running = None;
            return Err(self.error(format!(
                "the program ended without answering ({status}); it must read one JSON line per call from stdin and write one JSON line to stdout, and keep running"
            )));
        }
        serde_json::from_str(answer.trim()).map_err(|e| {
            self.error(format!(
                "answered a line that is not JSON ({e}): {}",
                answer.chars().take(200).collect::<String>()
            ))
        })
    }
}

impl Drop for LineProgram {
    fn drop(&mut self) {
        // Its stdin closed, a program reading lines ends; one that does not is stopped.
        if let Some((mut child, stdin, _)) = self.running.take() {
            drop(stdin);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What an external rollout program returned for a round's rows.
pub struct RolloutAnswer {
    pub prompt_ids: Vec<Vec<u32>>,
    pub completion_ids: Vec<Vec<u32>>,
    /// The sampler's log-probabilities of each completion token, when it gives them.
    pub logprobs: Option<Vec<Vec<f64>>>,
    /// Its other fields, per row, handed to the rewards as columns.
    pub extra: Vec<Map<String, Value>>,
}

impl RolloutAnswer {
    /// Why this is no answer for `n` rows, if it is not.
    pub fn check(&self, n: usize) -> std::result::Result<(), String> {
        for (key, rows) in [
            ("prompt_ids", self.prompt_ids.len()),
            ("completion_ids", self.completion_ids.len()),
        ] {
            if rows != n {
                return Err(format!(
                    "`{key}` has {rows} rows for {n} prompts: one per row asked"
                ));
            }
        }
        if let Some(l) = &self.logprobs {
            if l.len() != n
                || l.iter()
                    .zip(&self.completion_ids)
                    .any(|(l, c)| l.len() != c.len())
            {
                return Err("`logprobs` must give one number per completion token".into());
            }
        }
        Ok(())
    }
}

/// TRL's `rollout_func` as a program: it gets the round's rows (each prompt once per
/// completion) and returns their prompt and completion ids.
pub fn rollout(
    program: &mut LineProgram,
    prompts: &[Value],
    prompt_ids: &[Vec<u32>],
    context: Map<String, Value>,
) -> Result<RolloutAnswer> {
    let mut request = context;
    request.insert("prompts".into(), json!(prompts));
    request.insert("prompt_ids".into(), json!(prompt_ids));
    let answer = program.call(&Value::Object(request))?;
    let n = prompts.len();
    let obj = answer.as_object().ok_or_else(|| {
        program.error(format!(
            "answered {answer}: give an object with prompt_ids, completion_ids and logprobs"
        ))
    })?;
    let ids = |key: &str| -> Result<Vec<Vec<u32>>> {
        let v = obj.get(key).ok_or_else(|| program.error(format!("its answer has no `{key}` (TRL's rollout_func returns prompt_ids, completion_ids and logprobs)")))?;
        serde_json::from_value(v.clone())
            .map_err(|e| program.error(format!("`{key}` is not a list of token id lists: {e}")))
    };
    let prompt_ids = ids("prompt_ids")?;
    let completion_ids = ids("completion_ids")?;
    let logprobs = match obj.get("logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => Some(serde_json::from_value(v.clone()).map_err(|e| {
            program.error(format!("`logprobs` is not a list of number lists: {e}"))
        })?),
    };
    // Other fields: a list is one value per row, anything else the same for every row.
    let mut extra = vec![Map::new(); n];
    for (k, v) in obj {
        if ["prompt_ids", "completion_ids", "logprobs"].contains(&k.as_str()) {
            continue;
        }
        for (i, row) in extra.iter_mut().enumerate() {
            let value = match v {
                Value::Array(list) if list.len() == n => list[i].clone(),
                v => v.clone(),
            };
            row.insert(k.clone(), value);
        }
    }
    let answer = RolloutAnswer {
        prompt_ids,
        completion_ids,
        logprobs,
        extra,
    };
    answer.check(n).map_err(|m| program.error(m))?;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input_of<'a>(
        texts: &'a [String],
        completions: &'a [Value],
        columns: &'a [Map<String, Value>],
        ids: &'a [Vec<u32>],
    ) -> RewardInput<'a> {
        RewardInput {
            prompts: completions,
            completions,
            texts,
            completion_ids: ids,
            columns,
        }
    }

    #[test]
    fn builtin_rewards_score_as_trl_does() {
        let texts: Vec<String> = [
            "<think>\nreason\n</think>\nThe sum is 12.",
            "<think>a<think>b</think> \\boxed{1/2}",
            "no tags, answer 7",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let completions: Vec<Value> = texts.iter().map(|t| json!(t)).collect();
        let columns: Vec<Map<String, Value>> = [
            json!({"solution": "12"}),
            json!({"solution": "\\frac{1}{2}"}),
            json!({}),
        ]
        .into_iter()
        .map(|v| v.as_object().unwrap().clone())
        .collect();
        let ids = vec![vec![1; 3], vec![1; 7], vec![1; 9]];
        let input = input_of(&texts, &completions, &columns, &ids);
        let score = |e: &str| Reward::parse(e, 8).unwrap().score(&input).unwrap();
        assert_eq!(
            score("think_format_reward"),
            [Some(1.0), Some(0.0), Some(0.0)]
        );
        assert_eq!(score("accuracy_reward"), [Some(1.0), Some(1.0), None]);
        // 8 tokens at most, the last 2 punished: 3 -> 0, 7 -> -0.5, 9 -> -1.
        assert_eq!(
            score("get_soft_overlong_punishment(8, 2)"),
            [Some(0.0), Some(-0.5), Some(-1.0)]
        );
        assert!(Reward::parse("no_such_reward", 8).is_err());
        assert_eq!(
            program_name("python3 scripts/exact_reward.py --x"),
            "exact_reward"
        );
    }

    /// A directory with a classifier's config.json is a reward model named after it; a
    /// causal LM's directory is refused by its architectures.
    #[test]
    fn a_model_directory_is_a_reward_model() {
        let assets = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets");
        let rm = Reward::parse(&assets.join("tiny-qwen3/reward").display().to_string(), 8).unwrap();
        assert_eq!(rm.name, "reward");
        let err = Reward::parse(&assets.join("tiny-qwen3/model").display().to_string(), 8)
            .err()
            .unwrap();
        assert!(
            err.contains("architectures") && err.contains("Qwen3ForCausalLM"),
            "{err}"
        );
        // Scores a text prompt and its completion as one row.
        let texts = vec!["a b".to_string(), "c".to_string()];
        let completions: Vec<Value> = texts.iter().map(|t| json!(t)).collect();
        let prompts = vec![json!("x "), json!("y ")];
        let columns = vec![Map::new(), Map::new()];
        let ids = vec![vec![1], vec![1]];
        let mut input = input_of(&texts, &completions, &columns, &ids);
        input.prompts = &prompts;
        let scores = rm.score(&input).unwrap();
        assert!(
            scores.iter().all(|s| s.is_some_and(f64::is_finite)),
            "{scores:?}"
        );
        assert_ne!(scores[0], scores[1]);
    }

    #[test]
    fn a_reward_program_answers_one_line_per_call() {
        let texts = vec!["a".to_string(), "bb".to_string()];
        let completions: Vec<Value> = texts.iter().map(|t| json!(t)).collect();
        let columns = vec![Map::new(), Map::new()];
        let ids = vec![vec![1], vec![1, 2]];
        let input = input_of(&texts, &completions, &columns, &ids);
        // A shell loop answering each line with the lengths of completion_ids.
        let script = r#"while read -r line; do echo "$line" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(json.dumps([len(c) if len(c) > 1 else None for c in r["completion_ids"]]))'; done"#;
        let reward =
            Reward::parse(&format!("sh -c '{}'", script.replace('\'', "'\\''")), 8).unwrap();
        assert_eq!(reward.score(&input).unwrap(), [None, Some(2.0)]);
        assert_eq!(reward.score(&input).unwrap(), [None, Some(2.0)]);
        let dead = Reward::parse("sh -c true", 8).unwrap();
        let err = dead.score(&input).unwrap_err().to_string();
        assert!(err.contains("ended without answering"), "{err}");
    }
}
