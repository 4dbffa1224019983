//! Packing examples into rows of at most `max_length` tokens, keeping each piece's length so
//! that positions restart per document (and attention stays inside it).
//!
//! - `bfd`: best-fit decreasing (TRL's default): longest first, each into the fullest row that
//!   still has room; examples longer than `max_length` are truncated.
//! - `bfd_split`: the same, but longer examples are split into `max_length` pieces (no token lost).
//! - `wrapped`: concatenate everything and cut every `max_length` tokens (no padding at all);
//!   a document cut in two continues in the next row as a new piece.

use super::Example;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackingStrategy {
    Bfd,
    BfdSplit,
    Wrapped,
}

pub const PACKING_STRATEGIES: &[&str] = &["bfd", "bfd_split", "wrapped"];

impl PackingStrategy {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "bfd" => Some(PackingStrategy::Bfd),
            "bfd_split" => Some(PackingStrategy::BfdSplit),
            "wrapped" => Some(PackingStrategy::Wrapped),
            _ => None,
        }
    }
}

/// One packed row: the pieces' tokens back to back, and each piece's length.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PackedSequence {
    pub input_ids: Vec<u32>,
    pub labels: Vec<i64>,
    pub seq_lengths: Vec<usize>,
}

impl PackedSequence {
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    fn push(&mut self, ids: &[u32], labels: &[i64]) {
        self.input_ids.extend_from_slice(ids);
        self.labels.extend_from_slice(labels);
        self.seq_lengths.push(ids.len());
    }

    /// Position ids restarting at 0 for every piece.
    pub fn position_ids(&self) -> Vec<i64> {
        self.seq_lengths.iter().flat_map(|&n| 0..n as i64).collect()
    }

    /// An unpacked example as a one-piece row.
    pub fn single(e: &Example) -> Self {
        let mut p = PackedSequence::default();
        p.push(&e.input_ids, &e.labels);
        p
    }
}

/// Packs `examples` into rows of at most `max_length` tokens. Deterministic; empty examples
/// are dropped.
pub fn pack(
    examples: &[Example],
    max_length: usize,
    strategy: PackingStrategy,
) -> Vec<PackedSequence> {
    assert!(max_length > 0, "max_length must be positive");
    match strategy {
        PackingStrategy::Wrapped => wrapped(examples, max_length),
        PackingStrategy::Bfd | PackingStrategy::BfdSplit => {
            // Pieces: (example index, start, end).
            let mut pieces: Vec<(usize, usize, usize)> = Vec::new();
            for (i, e) in examples.iter().enumerate() {
                if strategy == PackingStrategy::Bfd {
                    pieces.push((i, 0, e.len().min(max_length)));
                } else {
                    let mut start = 0;
                    while start < e.len() {
                        let end = (start + max_length).min(e.len());
                        pieces.push((i, start, end));
                        start = end;
                    }
                }
            }
            pieces.retain(|(_, s, e)| e > s);
            // Longest first; ties keep dataset order (stable sort).
            pieces.sort_by_key(|&(_, s, e)| std::cmp::Reverse(e - s));
            best_fit(examples, &pieces, max_length)
        }
    }
}

fn best_fit(
    examples: &[Example],
    pieces: &[(usize, usize, usize)],
    max_length: usize,
) -> Vec<PackedSequence> {
    let mut rows: Vec<PackedSequence> = Vec::new();
    // Free space -> rows with that much room (lowest index first), for best-fit lookups.
    let mut by_space: BTreeMap<usize, std::collections::BTreeSet<usize>> = BTreeMap::new();
    for &(i, s, e) in pieces {
        let n = e - s;
        let found = by_space
            .range(n..)
            .next()
            .map(|(&space, rows)| (space, *rows.iter().next().unwrap()));
        let (row, space) = match found {
            Some((space, row)) => {
                let set = by_space.get_mut(&space).unwrap();
                set.remove(&row);
                if set.is_empty() {
                    by_space.remove(&space);
                }
                (row, space)
            }
            None => {
                rows.push(PackedSequence::default());
                (rows.len() - 1, max_length)
            }
        };
        rows[row].push(&examples[i].input_ids[s..e], &examples[i].labels[s..e]);
        let left = space - n;
        if left > 0 {
            by_space.entry(left).or_default().insert(row);
        }
    }
    rows
}

fn wrapped(examples: &[Example], max_length: usize) -> Vec<PackedSequence> {
    let mut rows = vec![PackedSequence::default()];
    for e in examples {
        let mut start = 0;
        while start < e.len() {
            if rows.last().unwrap().len() == max_length {
                rows.push(PackedSequence::default());
            }
            let room = max_length - rows.last().unwrap().len();
            let end = (start + room).min(e.len());
            rows.last_mut()
                .unwrap()
                .push(&e.input_ids[start..end], &e.labels[start..end]);
            start = end;
        }
    }
    rows.retain(|r| !r.is_empty());
    rows
}

/// Fraction of `rows x max_length` slots holding real tokens.
pub fn fill_rate(rows: &[PackedSequence], max_length: usize) -> f64 {
    let tokens: usize = rows.iter().map(PackedSequence::len).sum();
    tokens as f64 / (rows.len() * max_length).max(1) as f64
}
