//! A batch cut along the sequence for context / sequence parallelism: every rank of the group
//! takes its chunks of each row. Labels are shifted into next-token targets before the cut
//! (`Batch::targets`), so the last token of a chunk keeps its target (the first token of the
//! next chunk).

use super::collate::Batch;
use crate::error::{Error, Result};
use crate::nn::loss::IGNORE_INDEX;
use candle_core::Tensor;

/// The global token index of each of rank `rank`'s local positions (its two chunks of `chunk`
/// tokens) among `2 * size` chunks: ring attention's head-tail balance.
pub fn balanced_indices(rank: usize, size: usize, chunk: usize) -> Vec<usize> {
    let tail = 2 * size - 1 - rank;
    (rank * chunk..(rank + 1) * chunk)
        .chain(tail * chunk..(tail + 1) * chunk)
        .collect()
}

/// The positions of a row of `len` that rank `rank` of `size` keeps: chunk `rank` of `size`
/// (Ulysses), or with `ring` chunks `rank` and `2 * size - 1 - rank` of `2 * size` (ring
/// attention's head-tail balance: with a causal mask every rank then does the same work).
pub fn split_columns(len: usize, rank: usize, size: usize, ring: bool) -> Result<Vec<usize>> {
    let parts = if ring { 2 * size } else { size };
    let chunk = chunk_len(len, parts)?;
    Ok(match ring {
        true => balanced_indices(rank, size, chunk),
        false => (rank * chunk..(rank + 1) * chunk).collect(),
    })
}

impl Batch {
    /// Chunk `rank` of `size` of every row: Ulysses' split.
    pub fn chunk(&self, rank: usize, size: usize) -> Result<Batch> {
        self.split(rank, size, false)
    }

    /// Chunks `rank` and `2 * size - 1 - rank` of `2 * size` of every row: ring attention's.
    pub fn balanced_chunks(&self, rank: usize, size: usize) -> Result<Batch> {
        self.split(rank, size, true)
    }

    fn split(&self, rank: usize, size: usize, ring: bool) -> Result<Batch> {
        if size == 1 {
            return Ok(self.clone());
        }
        self.take(split_columns(self.input_ids.dim(1)?, rank, size, ring)?)
    }

    /// The positions `index` of every row; the targets are taken from the whole rows.
    fn take(&self, index: Vec<usize>) -> Result<Batch> {
        let index: Vec<u32> = index.into_iter().map(|i| i as u32).collect();
        let index = Tensor::new(index.as_slice(), self.input_ids.device())?;
        let cut = |t: &Tensor| t.index_select(&index, 1);
        let targets = cut(&self.targets()?)?;
        let num_target_tokens = targets
            .flatten_all()?
            .to_vec1::<i64>()?
            .iter()
            .filter(|&&t| t != IGNORE_INDEX)
            .count();
        Ok(Batch {
            input_ids: cut(&self.input_ids)?,
            labels: cut(&self.labels)?,
            position_ids: cut(&self.position_ids)?,
            num_target_tokens,
            shifted_targets: Some(targets),
            attention_mask: self
                .attention_mask
                .as_ref()
                .map(|m| m.index_select(&index.to_device(m.device())?, 1))
                .transpose()?,
        })
    }
}

/// The length of each of `parts` equal chunks of rows of `len` positions.
fn chunk_len(len: usize, parts: usize) -> Result<usize> {
    if !len.is_multiple_of(parts) {
        return Err(Error::Config {
            file: "training arguments".into(),
            key: "pad_to_multiple_of".into(),
            message: format!(
                "a batch of length {len} cannot be split into {parts} equal sequence chunks: \
                 pad_to_multiple_of must be a multiple of {parts} (the trainer sets it so \
                 unless it was given)"
            ),
        });
    }
    Ok(len / parts)
}

/// The smallest multiple of both (the padding a split into `parts` chunks needs).
pub fn lcm(a: usize, parts: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, parts) * parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn chunks_keep_the_targets_across_their_edges() {
        let dev = Device::Cpu;
        let batch = Batch {
            input_ids: Tensor::new(&[[10u32, 11, 12, 13, 14, 15]], &dev).unwrap(),
            labels: Tensor::new(&[[-100i64, 11, 12, -100, 14, 15]], &dev).unwrap(),
            position_ids: Tensor::new(&[[0i64, 1, 2, 0, 1, 2]], &dev).unwrap(),
            num_target_tokens: 4,
            shifted_targets: None,
            attention_mask: None,
        };
        let chunks: Vec<Batch> = (0..3).map(|r| batch.chunk(r, 3).unwrap()).collect();
        let targets: Vec<Vec<i64>> = chunks
            .iter()
            .map(|c| {
                c.targets()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        assert_eq!(targets, vec![vec![11, 12], vec![-100, 14], vec![15, -100]]);
        let counted: usize = chunks.iter().map(|c| c.num_target_tokens).sum();
        assert_eq!(counted, batch.num_target_tokens);
        // Labels keep their meaning (not shifted) in a chunk.
        let labels: Vec<i64> = chunks[1].labels.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(labels, vec![12, -100]);
        let e = batch.chunk(0, 4).unwrap_err().to_string();
        assert!(
            e.contains("pad_to_multiple_of must be a multiple of 4"),
            "{e}"
        );
        // Ring: rank 0 of 3 holds chunks 0 and 5 of 6; rows of 6 do not split into 2 x 2.
        let ring = batch.balanced_chunks(0, 3).unwrap();
        let ring_targets: Vec<i64> = ring
            .targets()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(ring_targets, vec![11, -100]);
        assert!(batch.balanced_chunks(0, 2).is_err());
        let whole = batch.balanced_chunks(0, 1).unwrap();
        assert_eq!(whole.num_target_tokens, 4);
        assert_eq!(lcm(8, 3), 24);
        assert_eq!(lcm(1, 4), 4);
    }
}
