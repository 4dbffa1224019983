//! Turning rows into a batch of tensors: padded (right, with the pad id; labels -100;
//! positions continued) or padding-free (all rows in one, positions restarting per piece),
//! optionally padded to a multiple of N (what sequence and context parallelism need).

use super::pack::PackedSequence;
use crate::nn::IGNORE_INDEX;
use candle_core::{Device, Result, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollateOptions {
    pub pad_token_id: u32,
    pub padding_free: bool,
    pub pad_to_multiple_of: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct Batch {
    /// [rows, len] u32.
    pub input_ids: Tensor,
    /// [rows, len] i64, -100 where no loss applies; not shifted (the loss shifts).
    pub labels: Tensor,
    /// [rows, len] i64, restarting at 0 for every document.
    pub position_ids: Tensor,
    /// Tokens the next-token loss is computed on (labels after the shift that are not -100).
    pub num_target_tokens: usize,
    /// The next-token targets, when they were taken before the rows were cut along the
    /// sequence (a chunk's last token predicts the next chunk's first); None: shift `labels`.
    pub shifted_targets: Option<Tensor>,
    /// [rows, len] u8 on the host, 1 for real tokens and 0 for padding, as transformers'
    /// attention_mask (what a mixture of experts' router loss counts); None for padding-free
    /// rows, which TRL passes without one.
    pub attention_mask: Option<Tensor>,
}

impl Batch {
    /// The same batch on `device` (collation happens on the CPU).
    pub fn to_device(self, device: &candle_core::Device) -> candle_core::Result<Batch> {
        Ok(Batch {
            input_ids: self.input_ids.to_device(device)?,
            labels: self.labels.to_device(device)?,
            position_ids: self.position_ids.to_device(device)?,
            num_target_tokens: self.num_target_tokens,
            shifted_targets: self
                .shifted_targets
                .map(|t| t.to_device(device))
                .transpose()?,
            // Only read on the host.
            attention_mask: self.attention_mask,
        })
    }

    /// Next-token targets aligned with the positions (-100: no loss): what a loss over this
    /// batch's logits compares with, whole or cut along the sequence.
    pub fn targets(&self) -> candle_core::Result<Tensor> {
        match &self.shifted_targets {
            Some(t) => Ok(t.clone()),
            None => crate::nn::loss::shift_labels(&self.labels),
        }
    }

    /// [`Self::attention_mask`] row-major, as one flag per token (None: every token is real).
    pub fn real_tokens(&self) -> candle_core::Result<Option<Vec<bool>>> {
        self.attention_mask
            .as_ref()
            .map(|m| {
                Ok(m.flatten_all()?
                    .to_vec1::<u8>()?
                    .iter()
                    .map(|&v| v == 1)
                    .collect())
            })
            .transpose()
    }
}

struct Row {
    ids: Vec<u32>,
    labels: Vec<i64>,
    positions: Vec<i64>,
}

fn row_of(pieces: &[&PackedSequence]) -> Row {
    let mut row = Row {
        ids: Vec::new(),
        labels: Vec::new(),
        positions: Vec::new(),
    };
    for p in pieces {
        let mut offset = 0;
        for &n in &p.seq_lengths {
            let at = row.ids.len();
            row.ids.extend_from_slice(&p.input_ids[offset..offset + n]);
            row.labels.extend_from_slice(&p.labels[offset..offset + n]);
            row.positions.extend(0..n as i64);
            // The first token of a document is not predicted from the previous document:
            // attention never crosses the boundary, so that target would only be noise.
            if at > 0 {
                row.labels[at] = IGNORE_INDEX;
            }
            offset += n;
        }
    }
    row
}

fn pad(row: &mut Row, len: usize, pad_id: u32) -> Vec<u8> {
    let mut mask = vec![1u8; row.ids.len()];
    mask.resize(len.max(row.ids.len()), 0);
    let mut next = row.positions.last().map_or(0, |p| p + 1);
    while row.ids.len() < len {
        row.ids.push(pad_id);
        row.labels.push(IGNORE_INDEX);
        row.positions.push(next);
        next += 1;
    }
    mask
}

/// Collates `rows` (packed or single examples) into one batch on `device`.
pub fn collate(rows: &[&PackedSequence], opts: CollateOptions, device: &Device) -> Result<Batch> {
    let mut out: Vec<Row> = if opts.padding_free {
        vec![row_of(rows)]
    } else {
        rows.iter().map(|r| row_of(&[r])).collect()
    };
    let mut len = out.iter().map(|r| r.ids.len()).max().unwrap_or(0).max(1);
    if let Some(m) = opts.pad_to_multiple_of.filter(|&m| m > 1) {
        len = len.div_ceil(m) * m;
    }
    let mask: Vec<u8> = out
        .iter_mut()
        .flat_map(|r| pad(r, len, opts.pad_token_id))
        .collect();
    let num_target_tokens = out
        .iter()
        .map(|r| {
            r.labels
                .iter()
                .skip(1)
                .filter(|&&l| l != IGNORE_INDEX)
                .count()
        })
        .sum();
    let n = out.len();
    let ids: Vec<u32> = out.iter().flat_map(|r| r.ids.iter().copied()).collect();
    let labels: Vec<i64> = out.iter().flat_map(|r| r.labels.iter().copied()).collect();
    let positions: Vec<i64> = out
        .iter()
        .flat_map(|r| r.positions.iter().copied())
        .collect();
    Ok(Batch {
        input_ids: Tensor::from_vec(ids, (n, len), device)?,
        labels: Tensor::from_vec(labels, (n, len), device)?,
        position_ids: Tensor::from_vec(positions, (n, len), device)?,
        num_target_tokens,
        shifted_targets: None,
        attention_mask: match opts.padding_free {
            true => None,
            false => Some(Tensor::from_vec(mask, (n, len), device)?),
        },
    })
}
