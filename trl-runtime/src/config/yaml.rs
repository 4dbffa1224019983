//! A typed reader over one YAML mapping that remembers which keys were read, so that every
//! error names the file and the full key path, and leftover keys can be reported as unknown.

use super::named::Named;
use crate::error::{Error, Result};
use serde_yaml::{Mapping, Value};
use std::collections::BTreeSet;

pub(crate) struct Section<'a> {
    file: &'a str,
    prefix: String,
    map: &'a Mapping,
    seen: BTreeSet<String>,
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string '{s}'"),
        Value::Sequence(_) => "a list".into(),
        Value::Mapping(_) => "a mapping".into(),
        Value::Tagged(t) => format!("tagged value {}", t.tag),
    }
}

impl<'a> Section<'a> {
    pub fn new(file: &'a str, prefix: &str, map: &'a Mapping) -> Self {
        Section {
            file,
            prefix: prefix.to_string(),
            map,
            seen: BTreeSet::new(),
        }
    }

    pub fn path(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::Config {
            file: self.file.to_string(),
            key: self.path(key),
            message: message.into(),
        }
    }

    /// Whether the section holds `key` (without marking it read).
    pub fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// The raw value; `null` counts as absent (Accelerate writes `key: null` for unset values).
    pub fn raw(&mut self, key: &str) -> Option<&'a Value> {
        self.seen.insert(key.to_string());
        match self.map.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn string(&mut self, key: &str) -> Result<Option<String>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(Value::Bool(b)) => Ok(Some(b.to_string())),
            Some(v) => Err(self.error(key, format!("expected a string, found {}", describe(v)))),
        }
    }

    /// A boolean; Accelerate also writes booleans as strings ("true"/"false").
    pub fn bool(&mut self, key: &str) -> Result<Option<bool>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(Some(true)),
            Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(Some(false)),
            Some(v) => Err(self.error(
                key,
                format!("expected true or false, found {}", describe(v)),
            )),
        }
    }

    /// A non-negative integer; strings holding integers are accepted ("2").
    pub fn uint(&mut self, key: &str) -> Result<Option<u64>> {
        self.number(key, serde_yaml::Number::as_u64, "a non-negative integer")
    }

    /// A number of type `T` read by `of` (strings holding one are accepted, as Accelerate
    /// writes some); else an error saying it expected `what`.
    fn number<T: std::str::FromStr>(
        &mut self,
        key: &str,
        of: fn(&serde_yaml::Number) -> Option<T>,
        what: &str,
    ) -> Result<Option<T>> {
        let Some(v) = self.raw(key) else {
            return Ok(None);
        };
        let parsed = match v {
            Value::Number(n) => of(n),
            Value::String(s) => s.trim().parse::<T>().ok(),
            _ => None,
        };
        parsed
            .map(Some)
            .ok_or_else(|| self.error(key, format!("expected {what}, found {}", describe(v))))
    }

    pub fn uint_in(&mut self, key: &str, min: u64, max: u64) -> Result<Option<u64>> {
        match self.uint(key)? {
            Some(n) if n < min || n > max => Err(self.error(
                key,
                format!("{n} is out of range: accepted values are {min} to {max}"),
            )),
            other => Ok(other),
        }
    }

    pub fn float(&mut self, key: &str) -> Result<Option<f64>> {
        self.number(key, serde_yaml::Number::as_f64, "a number")
    }

    /// A string that must be one of `accepted` (compared case-insensitively).
    pub fn choice(&mut self, key: &str, accepted: &[&'static str]) -> Result<Option<&'static str>> {
        let Some(s) = self.string(key)? else {
            return Ok(None);
        };
        accepted
            .iter()
            .find(|a| a.eq_ignore_ascii_case(s.trim()))
            .copied()
            .map(Some)
            .ok_or_else(|| {
                self.error(
                    key,
                    format!("'{s}' is not accepted: use one of {}", accepted.join(", ")),
                )
            })
    }

    /// A [`Named`] value: one of its names, as [`Self::choice`] reads them.
    pub fn named<T: Named>(&mut self, key: &str) -> Result<Option<T>> {
        Ok(self.choice(key, T::NAMES)?.and_then(T::from_name))
    }

    /// A nested mapping; `{}` or absent gives None.
    pub fn mapping(&mut self, key: &str) -> Result<Option<&'a Mapping>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Mapping(m)) => Ok(Some(m)),
            Some(v) => Err(self.error(key, format!("expected a mapping, found {}", describe(v)))),
        }
    }

    /// Keys present in the mapping that nobody read, with their full paths.
    pub fn unknown_keys(&self) -> Vec<String> {
        self.map
            .keys()
            .map(|k| match k {
                Value::String(s) => s.clone(),
                other => describe(other),
            })
            .filter(|k| !self.seen.contains(k))
            .map(|k| self.path(&k))
            .collect()
    }
}
