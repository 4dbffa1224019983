//! Values built on first request and shared afterwards: the attention masks every layer of one
//! forward and its backward use.

use candle_core::Result;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

#[derive(Debug)]
pub(crate) struct Memo<K, V>(Mutex<HashMap<K, V>>);

impl<K, V> Default for Memo<K, V> {
    fn default() -> Self {
        Memo(Mutex::new(HashMap::new()))
    }
}

impl<K: Hash + Eq, V: Clone> Memo<K, V> {
    /// The value under `key`, built by `build` the first time.
    pub(crate) fn get_or_build(&self, key: K, build: impl FnOnce() -> Result<V>) -> Result<V> {
        let mut values = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = values.get(&key) {
            return Ok(v.clone());
        }
        let v = build()?;
        values.insert(key, v.clone());
        Ok(v)
    }

    #[cfg(test)]
    pub(crate) fn values(&self) -> Vec<V> {
        let values = self.0.lock().unwrap_or_else(|e| e.into_inner());
        values.values().cloned().collect()
    }
}
