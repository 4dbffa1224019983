//! Command-line values read as HF's argument parser reads them (also for environment variables
//! that carry flags, such as Accelerate's booleans).

use std::path::PathBuf;

/// Parses a command-line value the way HF's argument parser does (bools: true/false/yes/no/1/0
/// in any case; `none` for optional values).
pub trait CliValue: Sized + Clone + Send + Sync + 'static {
    fn parse_cli(s: &str) -> std::result::Result<Self, String>;
}

impl CliValue for bool {
    fn parse_cli(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "true" | "t" | "yes" | "y" | "1" => Ok(true),
            "false" | "f" | "no" | "n" | "0" => Ok(false),
            _ => Err(format!("'{s}' is not a boolean: use true or false")),
        }
    }
}

macro_rules! from_str_value {
    ($($t:ty),*) => {$(
        impl CliValue for $t {
            fn parse_cli(s: &str) -> std::result::Result<Self, String> {
                s.parse::<$t>().map_err(|e| format!("'{s}': {e}"))
            }
        }
    )*};
}
from_str_value!(usize, u64, i64, f64, String, PathBuf);

impl<T: CliValue> CliValue for Option<T> {
    fn parse_cli(s: &str) -> std::result::Result<Self, String> {
        if s.eq_ignore_ascii_case("none") || s.eq_ignore_ascii_case("null") {
            Ok(None)
        } else {
            T::parse_cli(s).map(Some)
        }
    }
}

/// TRL's `pad_to_multiple_of`: a number, none, or `auto` (TRL 1.16's default: 128 on AWS
/// Neuron, which compiles per shape, and no padding elsewhere; here, no padding).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PadMultiple(pub Option<usize>);

impl CliValue for PadMultiple {
    fn parse_cli(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "none" | "null" => Ok(PadMultiple(None)),
            _ => s
                .parse::<usize>()
                .map(|n| PadMultiple(Some(n)))
                .map_err(|_| format!("'{s}': expected a token count, auto or none")),
        }
    }
}

impl<'de> serde::Deserialize<'de> for PadMultiple {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(usize),
            Text(String),
        }
        match Option::<Raw>::deserialize(d)? {
            None => Ok(PadMultiple(None)),
            Some(Raw::Count(n)) => Ok(PadMultiple(Some(n))),
            Some(Raw::Text(s)) => PadMultiple::parse_cli(&s).map_err(serde::de::Error::custom),
        }
    }
}

/// A list of names: a YAML list or one string, and on the command line one value with the
/// names separated by commas or spaces (`--lora_target_modules q_proj,v_proj`; TRL's
/// `--lora_target_modules q_proj v_proj` is joined into one value before parsing).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NameList(pub Vec<String>);

impl NameList {
    fn split(s: &str) -> Self {
        NameList(
            s.split([',', ' '])
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(String::from)
                .collect(),
        )
    }
}

impl CliValue for NameList {
    fn parse_cli(s: &str) -> std::result::Result<Self, String> {
        let list = NameList::split(s);
        if list.0.is_empty() {
            return Err(format!("'{s}': expected one or more names"));
        }
        Ok(list)
    }
}

/// A YAML value of a list key: one item, a list of them, or a string to split.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
    Text(String),
}

impl<'de> serde::Deserialize<'de> for NameList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(match OneOrMany::<String>::deserialize(d)? {
            OneOrMany::One(s) | OneOrMany::Text(s) => NameList::split(&s),
            OneOrMany::Many(v) => NameList(v),
        })
    }
}

/// A list whose entries may be command lines or calls (`reward_funcs`): a YAML list, or one
/// value split only at commas outside parentheses and quotes, so `python3 reward.py` and
/// `get_soft_overlong_punishment(8, 2)` stay whole. TRL's `--reward_funcs a b` is joined with
/// commas before parsing; a command line with spaces is one quoted value.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EntryList(pub Vec<String>);

impl EntryList {
    fn split(s: &str) -> Self {
        let (mut out, mut cur) = (Vec::new(), String::new());
        let (mut depth, mut quote) = (0usize, None::<char>);
        for c in s.chars() {
            match (c, quote) {
                ('"' | '\'', None) => quote = Some(c),
                (q, Some(open)) if q == open => quote = None,
                ('(', None) => depth += 1,
                (')', None) => depth = depth.saturating_sub(1),
                (',', None) if depth == 0 => {
                    out.push(std::mem::take(&mut cur));
                    continue;
                }
                _ => {}
            }
            cur.push(c);
        }
        out.push(cur);
        EntryList(
            out.iter()
                .map(|e| e.trim().to_string())
                .filter(|e| !e.is_empty())
                .collect(),
        )
    }
}

impl CliValue for EntryList {
    fn parse_cli(s: &str) -> std::result::Result<Self, String> {
        let list = EntryList::split(s);
        if list.0.is_empty() {
            return Err(format!("'{s}': expected one or more entries"));
        }
        Ok(list)
    }
}

impl<'de> serde::Deserialize<'de> for EntryList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(match OneOrMany::<String>::deserialize(d)? {
            OneOrMany::One(s) | OneOrMany::Text(s) => EntryList::split(&s),
            OneOrMany::Many(v) => EntryList(v),
        })
    }
}

/// A list of numbers: a YAML list, or one value with the numbers separated by commas or
/// spaces (`--loss_weights 0.8,0.2`; TRL's `--loss_weights 0.8 0.2` is joined before parsing).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NumberList(pub Vec<f64>);

impl CliValue for NumberList {
    fn parse_cli(s: &str) -> std::result::Result<Self, String> {
        let names = NameList::parse_cli(s)?;
        names
            .0
            .iter()
            .map(|n| n.parse::<f64>().map_err(|e| format!("'{n}': {e}")))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(NumberList)
    }
}

impl<'de> serde::Deserialize<'de> for NumberList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match OneOrMany::<f64>::deserialize(d)? {
            OneOrMany::One(x) => Ok(NumberList(vec![x])),
            OneOrMany::Many(v) => Ok(NumberList(v)),
            OneOrMany::Text(s) => NumberList::parse_cli(&s).map_err(serde::de::Error::custom),
        }
    }
}

/// Keyword arguments of a transformers object (`lr_scheduler_kwargs`): a YAML mapping, or on
/// the command line (and as a string in a file) a JSON object, as TrainingArguments reads
/// `--lr_scheduler_kwargs '{"min_lr_rate": 0.1}'`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct KwArgs(pub std::collections::BTreeMap<String, serde_json::Value>);

impl CliValue for KwArgs {
    fn parse_cli(s: &str) -> std::result::Result<Self, String> {
        if s.trim().is_empty() {
            return Ok(KwArgs::default());
        }
        serde_json::from_str(s)
            .map(KwArgs)
            .map_err(|e| format!("'{s}': expected a JSON object of keyword arguments ({e})"))
    }
}

impl<'de> serde::Deserialize<'de> for KwArgs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum MapOrText {
            Map(std::collections::BTreeMap<String, serde_json::Value>),
            Text(String),
        }
        match Option::<MapOrText>::deserialize(d)? {
            None => Ok(KwArgs::default()),
            Some(MapOrText::Map(m)) => Ok(KwArgs(m)),
            Some(MapOrText::Text(s)) => KwArgs::parse_cli(&s).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_split_at_top_level_commas_only() {
        let got = EntryList::parse_cli(
            "accuracy_reward,get_soft_overlong_punishment(8, 2),python3 r.py --x 'a,b'",
        )
        .unwrap();
        assert_eq!(
            got.0,
            [
                "accuracy_reward",
                "get_soft_overlong_punishment(8, 2)",
                "python3 r.py --x 'a,b'"
            ]
        );
        assert!(EntryList::parse_cli(" , ").is_err());
    }
}
