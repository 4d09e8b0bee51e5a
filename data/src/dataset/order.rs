//! The order samples are visited in: a seeded permutation per epoch, and which global sample
//! counters each data-parallel rank reads for each micro-batch.
//!
//! Training numbers every sample it consumes with a global counter `c = 0, 1, 2, …`; counter `c`
//! is position `c mod N` of epoch `c div N`, and each position maps through that epoch's
//! permutation to a dataset index. Every rank computes the same permutation, and the micro-batch
//! plan gives each rank disjoint counters, so the split across ranks is disjoint and
//! deterministic, and a checkpoint only needs the counter (stored as epoch and index). A dataset
//! of several resolution buckets is read a step at a time from one bucket, the steps' order
//! and each bucket's samples permuted per epoch by the same keyed randomness.

use crate::rng::KeyedRng;

/// Random stream of epoch permutations.
const SHUFFLE_STREAM: u64 = 7;
/// Random stream of the order of a bucketed epoch's steps.
const STEP_STREAM: u64 = 8;
/// First random stream of the per-bucket permutations (bucket `b` uses `BUCKET_STREAM + b`).
const BUCKET_STREAM: u64 = 1 << 20;

/// Where a run is in its data: the epoch and the position inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DataPosition {
    /// Completed passes over the dataset.
    pub epoch: u64,
    /// Samples consumed in the current epoch.
    pub index: u64,
}

impl DataPosition {
    /// The position of global sample counter `counter` in a dataset of `len` samples.
    pub fn of(counter: u64, len: u64) -> Self {
        Self {
            epoch: counter / len,
            index: counter % len,
        }
    }

    /// The global sample counter of this position in a dataset of `len` samples.
    pub fn counter(self, len: u64) -> u64 {
        self.epoch * len + self.index
    }
}

/// What an epoch is made of.
#[derive(Debug, Clone)]
enum Epoch {
    /// Every sample of a dataset of `len` once.
    Flat { len: u64 },
    /// Steps of `step` consecutive counters, each step from one resolution bucket (`members`:
    /// the dataset indices of each bucket); a bucket's samples past its last full step sit the
    /// epoch out (each epoch leaves out others).
    Buckets { members: Vec<Vec<u64>>, step: u64 },
}

/// The epoch orders of a dataset: which dataset index each global sample counter reads.
#[derive(Debug, Clone)]
pub struct SampleOrder {
    seed: u64,
    shuffle: bool,
    epoch: Epoch,
    cached: Option<(u64, Vec<u64>)>,
}

/// Fisher–Yates over `items`.
fn shuffle(items: &mut [u64], rng: &mut KeyedRng) {
    for i in (1..items.len()).rev() {
        let j = (rng.uniform() * (i + 1) as f64) as usize;
        items.swap(i, j.min(i));
    }
}

impl SampleOrder {
    /// The order of a dataset of `len` samples for `seed`; without `shuffle` every epoch visits
    /// the samples in file order.
    pub fn new(seed: u64, len: u64, shuffle: bool) -> Self {
        assert!(len > 0, "a sample order needs at least one sample");
        Self {
            seed,
            shuffle,
            epoch: Epoch::Flat { len },
            cached: None,
        }
    }

    /// The order of a dataset whose samples fall in resolution buckets (`members`: each bucket's
    /// dataset indices), read in optimizer steps of `step` samples: every step takes all its
    /// samples from one bucket, so each micro-batch, on every data-parallel rank, has one size.
    /// With `shuffle`, each epoch permutes every bucket's samples and then the order of the
    /// steps; without, buckets are read in turn, in file order. Needs one bucket at least `step`
    /// samples large ([`SampleOrder::len`] is then positive).
    pub fn bucketed(seed: u64, members: Vec<Vec<u64>>, step: u64, shuffle: bool) -> Self {
        assert!(step > 0, "a step holds at least one sample");
        let order = Self {
            seed,
            shuffle,
            epoch: Epoch::Buckets { members, step },
            cached: None,
        };
        assert!(!order.is_empty(), "no bucket fills one step");
        order
    }

    /// Samples read per epoch.
    pub fn len(&self) -> u64 {
        match &self.epoch {
            Epoch::Flat { len } => *len,
            Epoch::Buckets { members, step } => {
                members.iter().map(|m| m.len() as u64 / step * step).sum()
            }
        }
    }

    /// Whether an epoch reads nothing (never, for a constructed order).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The permutation of `epoch` (Fisher–Yates keyed by seed and epoch).
    pub fn permutation(seed: u64, len: u64, epoch: u64) -> Vec<u64> {
        let mut order: Vec<u64> = (0..len).collect();
        shuffle(&mut order, &mut KeyedRng::new(seed, epoch, SHUFFLE_STREAM));
        order
    }

    /// The dataset indices epoch `epoch` visits, in order.
    fn epoch_order(&self, epoch: u64) -> Vec<u64> {
        match &self.epoch {
            Epoch::Flat { len } => Self::permutation(self.seed, *len, epoch),
            Epoch::Buckets { members, step } => {
                let step = *step as usize;
                let mut steps: Vec<Vec<u64>> = Vec::new();
                for (b, bucket) in members.iter().enumerate() {
                    let mut bucket = bucket.clone();
                    if self.shuffle {
                        let stream = BUCKET_STREAM + b as u64;
                        shuffle(&mut bucket, &mut KeyedRng::new(self.seed, epoch, stream));
                    }
                    steps.extend(bucket.chunks_exact(step).map(<[u64]>::to_vec));
                }
                let mut at: Vec<u64> = (0..steps.len() as u64).collect();
                if self.shuffle {
                    shuffle(&mut at, &mut KeyedRng::new(self.seed, epoch, STEP_STREAM));
                }
                at.iter()
                    .flat_map(|&i| steps[i as usize].iter().copied())
                    .collect()
            }
        }
    }

    /// The dataset index global counter `counter` reads.
    pub fn index(&mut self, counter: u64) -> u64 {
        let DataPosition { epoch, index } = DataPosition::of(counter, self.len());
        if !self.shuffle && matches!(self.epoch, Epoch::Flat { .. }) {
            return index;
        }
        if self.cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.cached = Some((epoch, self.epoch_order(epoch)));
        }
        self.cached.as_ref().expect("cached above").1[index as usize]
    }
}

/// The global sample counters one data-parallel rank consumes, micro-batch by micro-batch: step
/// `s` covers counters `first + s·global .. first + (s+1)·global`, and micro-batch `m` of rank `r`
/// takes `micro` consecutive counters at offset `(m·replicas + r)·micro` inside it.
#[derive(Debug, Clone, Copy)]
pub struct BatchPlan {
    /// Counter of the first sample of the next step.
    pub next_step_start: u64,
    /// Samples per optimizer step over all replicas.
    pub global: u64,
    /// Samples per micro-batch.
    pub micro: u64,
    /// This rank's data-parallel index.
    pub rank: u64,
    /// Data-parallel replicas.
    pub replicas: u64,
}

impl BatchPlan {
    /// Micro-batches per step on each rank.
    pub fn micro_steps(&self) -> u64 {
        self.global / (self.micro * self.replicas)
    }

    /// The counters of micro-batch `m` of the step starting at `start`.
    pub fn micro_batch(&self, start: u64, m: u64) -> Vec<u64> {
        let first = start + (m * self.replicas + self.rank) * self.micro;
        (first..first + self.micro).collect()
    }

    /// This rank's micro-batches in consumption order, from `next_step_start` on, forever.
    pub fn micro_batches(self) -> impl Iterator<Item = Vec<u64>> + Send + 'static {
        let per_step = self.micro_steps();
        (0u64..).flat_map(move |s| {
            let plan = self;
            let start = plan.next_step_start + s * plan.global;
            (0..per_step).map(move |m| plan.micro_batch(start, m))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets of 5, 9 and 2 samples (dataset indices 0..5, 5..14, 14..16).
    fn buckets() -> Vec<Vec<u64>> {
        vec![(0..5).collect(), (5..14).collect(), (14..16).collect()]
    }

    fn bucket_of(i: u64) -> usize {
        match i {
            0..5 => 0,
            5..14 => 1,
            _ => 2,
        }
    }

    #[test]
    fn every_step_of_a_bucketed_epoch_is_one_bucket() {
        let step = 4;
        for shuffle in [false, true] {
            let mut order = SampleOrder::bucketed(3, buckets(), step, shuffle);
            // 5 → one step, 9 → two, 2 → none.
            assert_eq!(order.len(), 12);
            for epoch in 0..3 {
                let visited: Vec<u64> = (0..12).map(|i| order.index(epoch * 12 + i)).collect();
                for chunk in visited.chunks(step as usize) {
                    let b = bucket_of(chunk[0]);
                    assert!(chunk.iter().all(|&i| bucket_of(i) == b), "{visited:?}");
                }
                let mut unique = visited.clone();
                unique.sort();
                unique.dedup();
                assert_eq!(unique.len(), 12, "no sample twice in an epoch");
                assert!(
                    visited.iter().all(|&i| i < 14),
                    "bucket 2 never fills a step"
                );
            }
        }
    }

    #[test]
    fn bucketed_orders_are_keyed_by_seed_and_epoch() {
        let read = |seed: u64, epoch: u64| {
            let mut order = SampleOrder::bucketed(seed, buckets(), 4, true);
            (0..12)
                .map(|i| order.index(epoch * 12 + i))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            read(3, 1),
            read(3, 1),
            "resumable: a pure function of the counter"
        );
        assert_ne!(read(3, 0), read(3, 1));
        assert_ne!(read(3, 0), read(4, 0));
        let mut plain = SampleOrder::bucketed(3, buckets(), 4, false);
        let first: Vec<u64> = (0..12).map(|i| plain.index(i)).collect();
        assert_eq!(first, [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12]);
    }
}
