//! Packing, collation and the distributed sampler: properties checked over seeded random
//! datasets, and the fill rates of bfd against unpacked batches on a skewed length distribution.

use candle_core::Device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use trl_runtime::data::pack::fill_rate;
use trl_runtime::data::{
    collate, pack, CollateOptions, DistributedSampler, Example, PackedSequence, PackingStrategy,
};

/// Examples whose tokens identify (example, offset), so every token can be traced.
fn dataset(lengths: &[usize]) -> Vec<Example> {
    lengths
        .iter()
        .enumerate()
        .map(|(e, &n)| Example::full((0..n).map(|k| (e * 10_000 + k) as u32).collect()))
        .collect()
}

fn token_counts(rows: &[PackedSequence]) -> HashMap<u32, usize> {
    let mut m = HashMap::new();
    for r in rows {
        for &t in &r.input_ids {
            *m.entry(t).or_insert(0) += 1;
        }
    }
    m
}

/// `CASES` random cases from a fixed seed (a failure names its case, which reruns alone
/// with the same draw).
const CASES: u64 = 256;

fn cases(test: u64, mut check: impl FnMut(&mut StdRng)) {
    for case in 0..CASES {
        let mut rng = StdRng::seed_from_u64(test * 1_000_003 + case);
        check(&mut rng);
    }
}

/// Up to `most` lengths each below `below`.
fn lengths(rng: &mut StdRng, below: usize, most: usize) -> Vec<usize> {
    let n = rng.random_range(0..most);
    (0..n).map(|_| rng.random_range(0..below)).collect()
}

#[test]
fn bfd_keeps_every_token_of_sequences_that_fit() {
    cases(1, |rng| {
        let lengths = lengths(rng, 80, 60);
        let max_length = rng.random_range(1..64);
        let case = format!("lengths {lengths:?}, max_length {max_length}");
        let data = dataset(&lengths);
        let rows = pack(&data, max_length, PackingStrategy::Bfd);
        let counts = token_counts(&rows);
        for (e, ex) in data.iter().enumerate() {
            let kept = ex.len().min(max_length);
            for k in 0..ex.len() {
                let t = (e * 10_000 + k) as u32;
                // The first max_length tokens survive exactly once; longer ones are truncated.
                let n = counts.get(&t).copied().unwrap_or(0);
                assert_eq!(n, usize::from(k < kept), "{case}: token {t}");
            }
        }
        for r in &rows {
            assert!(r.len() <= max_length && !r.is_empty(), "{case}");
            assert_eq!(r.seq_lengths.iter().sum::<usize>(), r.len(), "{case}");
            assert_eq!(r.labels.len(), r.len(), "{case}");
            // Pieces are whole, contiguous runs of one example starting at its first token.
            let mut offset = 0;
            for &n in &r.seq_lengths {
                let first = r.input_ids[offset];
                assert_eq!(first % 10_000, 0, "{case}");
                for k in 0..n {
                    assert_eq!(r.input_ids[offset + k], first + k as u32, "{case}");
                }
                offset += n;
            }
        }
    });
}

#[test]
fn bfd_split_and_wrapped_keep_every_token() {
    cases(2, |rng| {
        let lengths = lengths(rng, 200, 40);
        let max_length = rng.random_range(1..64);
        let case = format!("lengths {lengths:?}, max_length {max_length}");
        let data = dataset(&lengths);
        for strategy in [PackingStrategy::BfdSplit, PackingStrategy::Wrapped] {
            let rows = pack(&data, max_length, strategy);
            let counts = token_counts(&rows);
            let total: usize = lengths.iter().sum();
            assert_eq!(counts.values().sum::<usize>(), total, "{case}");
            assert!(counts.values().all(|&c| c == 1), "{case}");
            for r in &rows {
                assert!(r.len() <= max_length, "{case}");
                assert_eq!(r.seq_lengths.iter().sum::<usize>(), r.len(), "{case}");
            }
            if strategy == PackingStrategy::Wrapped && !rows.is_empty() {
                // Every row but the last is full.
                let full = rows[..rows.len() - 1].iter().all(|r| r.len() == max_length);
                assert!(full, "{case}");
            }
        }
    });
}

#[test]
fn sampler_shards_are_disjoint_and_cover_the_data() {
    cases(3, |rng| {
        let len = rng.random_range(0..300);
        let world = rng.random_range(1..9);
        let seed = rng.random_range(0..1000);
        let epoch = rng.random_range(0..5);
        let case = format!("len {len}, world {world}, seed {seed}, epoch {epoch}");
        let sampler = |rank, drop_last| DistributedSampler {
            len,
            world,
            rank,
            seed,
            shuffle: true,
            drop_last,
        };
        let shards: Vec<Vec<usize>> = (0..world)
            .map(|rank| sampler(rank, true).batches(epoch, 1).concat())
            .collect();
        let mut all: Vec<usize> = shards.concat();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "{case}: disjoint");
        assert_eq!(
            n,
            len / world * world,
            "{case}: covers all but the ragged tail"
        );
        assert!(shards.iter().all(|s| s.len() == len / world), "{case}");
        // Without drop_last every example is read, the tail padded from the start.
        let mut all: Vec<usize> = (0..world)
            .flat_map(|rank| sampler(rank, false).batches(epoch, 1).concat())
            .collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), len, "{case}");
    });
}

#[test]
fn sampler_is_deterministic_and_reshuffles_per_epoch() {
    let s = DistributedSampler {
        len: 100,
        world: 2,
        rank: 1,
        seed: 42,
        shuffle: true,
        drop_last: true,
    };
    assert_eq!(s.batches(0, 1).concat(), s.batches(0, 1).concat());
    assert_ne!(s.batches(0, 1).concat(), s.batches(1, 1).concat());
    // 2 ranks x batch 2 see, step by step, the same examples as 1 rank x batch 4.
    let one = DistributedSampler {
        world: 1,
        rank: 0,
        ..s
    }
    .batches(3, 1)
    .concat();
    let r0 = DistributedSampler { rank: 0, ..s }.batches(3, 1).concat();
    let r1 = s.batches(3, 1).concat();
    for step in 0..10 {
        let mut two: Vec<usize> =
            [&r0[2 * step..2 * step + 2], &r1[2 * step..2 * step + 2]].concat();
        let mut single = one[4 * step..4 * step + 4].to_vec();
        two.sort();
        single.sort();
        assert_eq!(two, single);
    }
}

#[test]
fn bfd_pads_less_than_unpacked_batches_on_skewed_lengths() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    // Most examples short, a few long: the shape of chat SFT data.
    let lengths: Vec<usize> = (0..2000)
        .map(|_| {
            if rng.random_bool(0.9) {
                rng.random_range(8..64)
            } else {
                rng.random_range(200..512)
            }
        })
        .collect();
    let data = dataset(&lengths);
    let max_length = 512;
    let packed = pack(&data, max_length, PackingStrategy::Bfd);
    let packed_fill = fill_rate(&packed, max_length);
    // Unpacked: batches of 8 in dataset order, each padded to its longest example.
    let (mut tokens, mut slots) = (0usize, 0usize);
    for chunk in lengths.chunks(8) {
        tokens += chunk.iter().sum::<usize>();
        slots += chunk.len() * chunk.iter().max().unwrap();
    }
    let unpacked_fill = tokens as f64 / slots as f64;
    eprintln!("fill rate: bfd {packed_fill:.4}, unpacked batches of 8 {unpacked_fill:.4}");
    assert!(packed_fill > 0.99, "{packed_fill}");
    assert!(
        packed_fill > unpacked_fill + 0.3,
        "{packed_fill} vs {unpacked_fill}"
    );
}

#[test]
fn collation_padded_and_padding_free() {
    let data = vec![
        Example {
            input_ids: vec![5, 6, 7],
            labels: vec![-100, 6, 7],
        },
        Example::full(vec![8, 9]),
    ];
    let rows: Vec<PackedSequence> = data.iter().map(PackedSequence::single).collect();
    let opts = CollateOptions {
        pad_token_id: 0,
        padding_free: false,
        pad_to_multiple_of: Some(4),
    };
    let b = collate(&rows.iter().collect::<Vec<_>>(), opts, &Device::Cpu).unwrap();
    assert_eq!(
        b.input_ids.to_vec2::<u32>().unwrap(),
        vec![vec![5, 6, 7, 0], vec![8, 9, 0, 0]]
    );
    assert_eq!(
        b.labels.to_vec2::<i64>().unwrap(),
        vec![vec![-100, 6, 7, -100], vec![8, 9, -100, -100]]
    );
    assert_eq!(
        b.position_ids.to_vec2::<i64>().unwrap(),
        vec![vec![0, 1, 2, 3], vec![0, 1, 2, 3]]
    );
    assert_eq!(b.num_target_tokens, 3);

    let opts = CollateOptions {
        pad_token_id: 0,
        padding_free: true,
        pad_to_multiple_of: Some(4),
    };
    let b = collate(&rows.iter().collect::<Vec<_>>(), opts, &Device::Cpu).unwrap();
    assert_eq!(
        b.input_ids.to_vec2::<u32>().unwrap(),
        vec![vec![5, 6, 7, 8, 9, 0, 0, 0]]
    );
    // The second document's first token is not a target of the first document.
    assert_eq!(
        b.labels.to_vec2::<i64>().unwrap(),
        vec![vec![-100, 6, 7, -100, 9, -100, -100, -100]]
    );
    assert_eq!(
        b.position_ids.to_vec2::<i64>().unwrap(),
        vec![vec![0, 1, 2, 0, 1, 2, 3, 4]]
    );
    assert_eq!(b.num_target_tokens, 3);

    // A packed row keeps its pieces apart the same way.
    let packed = pack(&data, 8, PackingStrategy::Bfd);
    assert_eq!(packed.len(), 1);
    assert_eq!(packed[0].position_ids(), vec![0, 1, 2, 0, 1]);
}

/// Micro-batches per epoch as accelerate's prepared DataLoader deals them: with drop_last
/// the batches every rank fills; without, one process keeps a smaller last batch, and
/// several fill their last batches with the epoch's first rows. Every row is dealt.
#[test]
fn micro_batches_of_an_epoch_follow_accelerate() {
    let sampler = |world, rank, drop_last| DistributedSampler {
        len: 8,
        world,
        rank,
        seed: 3,
        shuffle: true,
        drop_last,
    };
    let sizes = |s: &DistributedSampler| s.batches(1, 3).iter().map(Vec::len).collect::<Vec<_>>();
    assert_eq!(sizes(&sampler(1, 0, true)), [3, 3]);
    assert_eq!(sizes(&sampler(1, 0, false)), [3, 3, 2]);
    let mut once: Vec<usize> = sampler(1, 0, false).batches(1, 3).concat();
    once.sort();
    assert_eq!(once, (0..8).collect::<Vec<_>>());
    // Two ranks: 3 batches of the 8 rows take 2 rounds, 12 rows, the first 4 again.
    let dealt: Vec<Vec<usize>> = (0..2)
        .map(|r| sampler(2, r, false).batches(1, 3).concat())
        .collect();
    assert!(dealt.iter().all(|d| d.len() == 6));
    let order = sampler(1, 0, false).batches(1, 8).concat();
    let mut all = dealt.concat();
    all.sort();
    let mut want: Vec<usize> = order.iter().chain(&order[..4]).copied().collect();
    want.sort();
    assert_eq!(all, want);
    assert_eq!(sampler(2, 1, true).deal(3).rounds(), 1);
    assert_eq!(sampler(2, 1, false).deal(3).rounds(), 2);
}

/// Positions in order, as accelerate deals them: one process reads every batch (the
/// last smaller); two read round by round, the last round filled from the start, its real
/// rows named; with drop_last only full rounds.
#[test]
fn positions_are_dealt_as_accelerate_deals_them() {
    use trl_runtime::data::BatchDeal;
    let deal = |world, drop_last| BatchDeal {
        len: 8,
        batch: 3,
        world,
        drop_last,
    };
    let one = deal(1, false);
    assert_eq!((one.rounds(), one.rows(2, 0)), (3, vec![6, 7]));
    let two = deal(2, false);
    assert_eq!(two.rounds(), 2);
    assert_eq!(
        (two.rows(1, 0), two.rows(1, 1)),
        (vec![6, 7, 0], vec![1, 2, 3])
    );
    assert_eq!(two.rows_in_last_round(), Some(2));
    // What gather_for_metrics keeps of the short last round: rank 0's two real rows, and
    // two per-rank scalars (it cuts the gathered [2] to 2 values, though rank 1 has no row).
    assert_eq!((two.real_rows(1, 0), two.real_rows(1, 1)), (2, 0));
    assert_eq!((two.ranks_kept(0), two.ranks_kept(1)), (2, 2));
    let seven = BatchDeal { len: 7, ..two };
    assert_eq!((seven.real_rows(1, 0), seven.ranks_kept(1)), (1, 1));
    assert_eq!((one.real_rows(2, 0), one.ranks_kept(2)), (2, 1));
    assert_eq!(
        (deal(2, true).rounds(), deal(2, true).rows_in_last_round()),
        (1, None)
    );
}
