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

impl<'de> serde::Deserialize<'de> for NameList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        Ok(match OneOrMany::deserialize(d)? {
            OneOrMany::One(s) => NameList::split(&s),
            OneOrMany::Many(v) => NameList(v),
        })
    }
}
