//! The data pipeline (SFT's rows and DPO's preference pairs): examples with loss masks, packing, collation into batches, and the
//! distributed sampler.

pub mod collate;
pub mod dataset;
pub mod local_dir;
pub mod mixture;
pub mod pack;
pub mod preference;
pub mod sampler;
pub mod sequence;
pub mod tokenize;

pub use collate::{collate, Batch, CollateOptions};
pub use dataset::{
    load, load_in, load_jsonl, load_parquet, parse_record, to_example, OnBadRow, Record, Split,
    TokenizeOptions,
};
pub use pack::{pack, PackedSequence, PackingStrategy};
pub use sampler::{BatchDeal, DistributedSampler};
pub use tokenize::{Message, RenderedChat, TextTokenizer};

/// One tokenized training example: `labels` holds the token where the loss applies and
/// [`crate::nn::IGNORE_INDEX`] (-100) where it does not (prompt, system, padding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub input_ids: Vec<u32>,
    pub labels: Vec<i64>,
}

impl Example {
    /// An example trained on every token.
    pub fn full(input_ids: Vec<u32>) -> Self {
        let labels = input_ids.iter().map(|&t| t as i64).collect();
        Example { input_ids, labels }
    }

    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// The tokens the loss applies to (labels not -100), in order.
    pub fn target_ids(&self) -> Vec<u32> {
        self.input_ids
            .iter()
            .zip(&self.labels)
            .filter(|(_, &l)| l != crate::nn::IGNORE_INDEX)
            .map(|(&t, _)| t)
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}
