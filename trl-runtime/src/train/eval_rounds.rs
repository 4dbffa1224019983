//! An evaluation's figures reduced as transformers' evaluation loop and TRL's trainers reduce
//! them over the rounds of a [`BatchDeal`] (one batch per rank per round, the last round
//! filled from the start): what accelerate's `gather_for_metrics` keeps of the last round
//! (the real rows of a per-row value, as many ranks' values of a per-batch scalar), what a
//! plain `gather` keeps (everything), and each figure the mean of its per-round values (TRL
//! logs the mean of what it appended).

use crate::data::BatchDeal;

/// Every rank's values of every round, `width` a batch, each rank writing its own and the
/// ranks' copies then summed into one.
#[derive(Debug, Clone)]
pub struct EvalSlots {
    deal: BatchDeal,
    width: usize,
    values: Vec<f64>,
}

impl EvalSlots {
    /// Zeros for every batch `deal` deals.
    pub fn new(deal: BatchDeal, width: usize) -> Self {
        let values = vec![0.0; deal.rounds() * deal.world * width];
        EvalSlots::from_values(deal, width, values)
    }

    /// The slots holding `values` (round by round, rank by rank).
    pub fn from_values(deal: BatchDeal, width: usize, values: Vec<f64>) -> Self {
        assert_eq!(values.len(), deal.rounds() * deal.world * width);
        EvalSlots {
            deal,
            width,
            values,
        }
    }

    /// The first values of rank `rank`'s batch in `round`.
    pub fn set(&mut self, round: usize, rank: usize, values: &[f64]) {
        let at = (round * self.deal.world + rank) * self.width;
        self.values[at..at + values.len()].copy_from_slice(values);
    }

    /// The slots with every rank's values in place: `sum` adds the ranks' copies.
    pub fn summed(
        self,
        sum: impl FnOnce(&[f64]) -> crate::error::Result<Vec<f64>>,
    ) -> crate::error::Result<Self> {
        let values = sum(&self.values)?;
        Ok(EvalSlots { values, ..self })
    }

    /// Each rank's slot in `round`.
    fn ranks(&self, round: usize) -> std::slice::Chunks<'_, f64> {
        let n = self.deal.world * self.width;
        self.values[round * n..][..n].chunks(self.width)
    }

    /// eval_loss: each rank's batch loss (`loss` of its slot) repeated once per real row, as
    /// `gather_for_metrics` keeps them, and their mean.
    pub fn loss(&self, loss: impl Fn(&[f64]) -> f64) -> f64 {
        let (mut sum, mut rows) = (0.0, 0.0);
        for round in 0..self.deal.rounds() {
            for (rank, s) in self.ranks(round).enumerate() {
                let real = self.deal.real_rows(round, rank) as f64;
                sum += loss(s) * real;
                rows += real;
            }
        }
        sum / rows.max(1.0)
    }

    /// The mean over rounds of value `num` summed over the ranks `ranks(round)` keeps, over
    /// value `den` summed alike (0 for a round without any).
    fn ratio(&self, num: usize, den: usize, ranks: impl Fn(usize) -> usize) -> f64 {
        let rounds = self.deal.rounds();
        let total: f64 = (0..rounds)
            .map(|round| {
                let kept = self.ranks(round).take(ranks(round));
                let (n, d) = kept.fold((0.0, 0.0), |(n, d), s| (n + s[num], d + s[den]));
                if d > 0.0 {
                    n / d
                } else {
                    0.0
                }
            })
            .sum();
        total / rounds.max(1) as f64
    }

    /// A figure whose per-rank sums TRL gathers with `gather_for_metrics` (entropy, token
    /// accuracy, mean logits): per round over the ranks it keeps.
    pub fn kept_ratio(&self, num: usize, den: usize) -> f64 {
        self.ratio(num, den, |round| self.deal.ranks_kept(round))
    }

    /// A per-batch scalar TRL gathers with `gather_for_metrics` (a mixture of experts' router
    /// loss): per round the mean over the ranks it keeps.
    pub fn kept_mean(&self, value: usize) -> f64 {
        let rounds = self.deal.rounds();
        let total: f64 = (0..rounds)
            .map(|round| {
                let kept = self.deal.ranks_kept(round);
                let sum: f64 = self.ranks(round).take(kept).map(|s| s[value]).sum();
                sum / kept.max(1) as f64
            })
            .sum();
        total / rounds.max(1) as f64
    }

    /// The largest of value `value` over every rank per round (a reward model's rewards, which
    /// TRL gathers whole), averaged over the rounds.
    pub fn gathered_max(&self, value: usize) -> f64 {
        let rounds = self.deal.rounds();
        let total: f64 = (0..rounds)
            .map(|round| {
                self.ranks(round)
                    .map(|s| s[value])
                    .fold(f64::NEG_INFINITY, f64::max)
            })
            .sum();
        total / rounds.max(1) as f64
    }

    /// A figure TRL gathers whole with `gather` (DPO's rewards and log-probs): per round over
    /// every rank, the refill included.
    pub fn gathered_ratio(&self, num: usize, den: usize) -> f64 {
        self.ratio(num, den, |_| self.deal.world)
    }
}
