//! The order samples are visited in: a seeded permutation per epoch, and which global sample
//! counters each data-parallel rank reads for each micro-batch.
//!
//! Training numbers every sample it consumes with a global counter `c = 0, 1, 2, …`; counter `c`
//! is position `c mod N` of epoch `c div N`, and each position maps through that epoch's
//! permutation to a dataset index. Every rank computes the same permutation, and the micro-batch
//! plan gives each rank disjoint counters, so the split across ranks is disjoint and
//! deterministic, and a checkpoint only needs the counter (stored as epoch and index).

use crate::rng::KeyedRng;

/// Random stream of epoch permutations.
const SHUFFLE_STREAM: u64 = 7;

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

/// The epoch permutations of a dataset of `len` samples.
#[derive(Debug, Clone)]
pub struct SampleOrder {
    seed: u64,
    len: u64,
    shuffle: bool,
    epoch: Option<(u64, Vec<u64>)>,
}

impl SampleOrder {
    /// The order for `seed`; without `shuffle` every epoch visits the samples in file order.
    pub fn new(seed: u64, len: u64, shuffle: bool) -> Self {
        assert!(len > 0, "a sample order needs at least one sample");
        Self {
            seed,
            len,
            shuffle,
            epoch: None,
        }
    }

    /// The permutation of `epoch` (Fisher–Yates keyed by seed and epoch).
    pub fn permutation(seed: u64, len: u64, epoch: u64) -> Vec<u64> {
        let mut rng = KeyedRng::new(seed, epoch, SHUFFLE_STREAM);
        let mut order: Vec<u64> = (0..len).collect();
        for i in (1..order.len()).rev() {
            let j = (rng.uniform() * (i + 1) as f64) as usize;
            order.swap(i, j.min(i));
        }
        order
    }

    /// The dataset index global counter `counter` reads.
    pub fn index(&mut self, counter: u64) -> u64 {
        let DataPosition { epoch, index } = DataPosition::of(counter, self.len);
        if !self.shuffle {
            return index;
        }
        if self.epoch.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.epoch = Some((epoch, Self::permutation(self.seed, self.len, epoch)));
        }
        self.epoch.as_ref().expect("cached above").1[index as usize]
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
