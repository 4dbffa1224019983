//! A batch cut along the sequence for context / sequence parallelism: every rank of the group
//! takes one contiguous chunk of each row. Labels are shifted into next-token targets before
//! the cut, so the last token of a chunk keeps its target (the first token of the next chunk).

use super::collate::Batch;
use crate::error::{Error, Result};
use crate::nn::loss::IGNORE_INDEX;
use crate::nn::ring::balanced_indices;
use candle_core::Tensor;

/// This rank's part of a batch.
#[derive(Debug, Clone)]
pub struct SequenceChunk {
    /// [rows, len / group] u32.
    pub input_ids: Tensor,
    /// The global positions of the chunk's tokens (documents restart at 0).
    pub position_ids: Tensor,
    /// Next-token targets of the chunk's positions, aligned (-100: no loss).
    pub targets: Tensor,
    /// Targets of this chunk that count.
    pub num_target_tokens: usize,
}

impl SequenceChunk {
    /// Chunk `rank` of `size` of every row of `batch` (the whole batch for a group of one):
    /// Ulysses' split.
    pub fn of(batch: &Batch, rank: usize, size: usize) -> Result<Self> {
        let chunk = chunk_len(batch, size)?;
        Self::take(batch, (rank * chunk..(rank + 1) * chunk).collect())
    }

    /// Chunks `rank` and `2 * size - 1 - rank` of `2 * size` (ring attention's head-tail
    /// balance: with a causal mask every rank then does the same work).
    pub fn balanced(batch: &Batch, rank: usize, size: usize) -> Result<Self> {
        let chunk = chunk_len(batch, 2 * size)?;
        Self::take(batch, balanced_indices(rank, size, chunk))
    }

    /// The positions `index` of every row.
    fn take(batch: &Batch, index: Vec<usize>) -> Result<Self> {
        let index: Vec<u32> = index.into_iter().map(|i| i as u32).collect();
        let index = Tensor::new(index.as_slice(), batch.input_ids.device())?;
        let cut = |t: &Tensor| t.index_select(&index, 1);
        let targets = cut(&batch.targets()?)?;
        let num_target_tokens = targets
            .flatten_all()?
            .to_vec1::<i64>()?
            .iter()
            .filter(|&&t| t != IGNORE_INDEX)
            .count();
        Ok(SequenceChunk {
            input_ids: cut(&batch.input_ids)?,
            position_ids: cut(&batch.position_ids)?,
            targets,
            num_target_tokens,
        })
    }
}

/// The length of each of `parts` equal chunks of the batch's rows.
fn chunk_len(batch: &Batch, parts: usize) -> Result<usize> {
    let len = batch.input_ids.dim(1)?;
    if len % parts != 0 {
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
        };
        let chunks: Vec<SequenceChunk> = (0..3)
            .map(|r| SequenceChunk::of(&batch, r, 3).unwrap())
            .collect();
        let targets: Vec<Vec<i64>> = chunks
            .iter()
            .map(|c| c.targets.flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        assert_eq!(targets, vec![vec![11, 12], vec![-100, 14], vec![15, -100]]);
        let counted: usize = chunks.iter().map(|c| c.num_target_tokens).sum();
        assert_eq!(counted, batch.num_target_tokens);
        let e = SequenceChunk::of(&batch, 0, 4).unwrap_err().to_string();
        assert!(
            e.contains("pad_to_multiple_of must be a multiple of 4"),
            "{e}"
        );
        // Ring: chunks 0 and 3 of 4 on rank 0 (rows of 6 split in 4 do not divide).
        assert!(SequenceChunk::balanced(&batch, 0, 2).is_err());
        let whole = SequenceChunk::balanced(&batch, 0, 1).unwrap();
        assert_eq!(whole.num_target_tokens, 4);
        assert_eq!(lcm(8, 3), 24);
        assert_eq!(lcm(1, 4), 4);
    }
}
