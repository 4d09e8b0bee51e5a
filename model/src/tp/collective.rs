//! The communication a tensor- or data-parallel group needs, behind a trait so that the model
//! crate needs no MPI (`flux-cluster` implements it over MPI).

/// A group of ranks that can sum, scatter and gather `f32` buffers. Every rank of the group must make the
/// same calls in the same order (as with any collective).
pub trait Collective {
    /// This rank's index in the group, `0 ..< size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Replace `data` with its elementwise sum over the group.
    fn all_reduce_sum(&self, data: &mut [f32]);
    /// Write every rank's `data` (equal lengths), in rank order, into `out` (`size()` times longer).
    fn all_gather(&self, data: &[f32], out: &mut [f32]);
    /// Sum `data` (`size()` times `out`'s length) elementwise over the group and write block
    /// `rank()` of the sum into `out`: an all-reduce of which each rank keeps only its part, for
    /// a `1 / size()` share of an all-reduce's traffic.
    fn reduce_scatter_sum(&self, data: &[f32], out: &mut [f32]);

    /// Start replacing `data` by its elementwise sum over the group and return at once where
    /// the group can (MPI's non-blocking all-reduce), so that computation goes on while the sum
    /// travels; the default sums before returning. Every rank of the group must start the same
    /// sums in the same order.
    fn start_all_reduce_sum(&self, mut data: Vec<f32>) -> Box<dyn Pending + '_> {
        self.all_reduce_sum(&mut data);
        Box::new(Finished(data))
    }

    /// Start gathering every rank's `data` (equal lengths), in rank order, and return at once
    /// where the group can (MPI's non-blocking all-gather); the default gathers before
    /// returning. Every rank of the group must start the same gathers in the same order.
    fn start_all_gather(&self, data: Vec<f32>) -> Box<dyn Pending + '_> {
        let mut out = vec![0f32; data.len() * self.size()];
        self.all_gather(&data, &mut out);
        Box::new(Finished(out))
    }

    /// How many ranks of the group pass `failed = true` (an all-reduce): every rank learns of a
    /// failure anywhere, so all can stop together instead of one leaving the others in a
    /// collective.
    fn count_failures(&self, failed: bool) -> u32 {
        let mut flag = [if failed { 1.0f32 } else { 0.0 }];
        self.all_reduce_sum(&mut flag);
        flag[0] as u32
    }
}

/// A collective started by [`Collective::start_all_reduce_sum`] or
/// [`Collective::start_all_gather`], in flight.
pub trait Pending {
    /// Let the collective progress without blocking (MPI moves a non-blocking collective along
    /// only inside its calls); whether it has finished.
    fn test(&mut self) -> bool;
    /// Wait for the collective and return its result.
    fn wait(self: Box<Self>) -> Vec<f32>;
}

/// A collective that was finished when it was started.
#[derive(Debug)]
pub struct Finished(pub Vec<f32>);

impl Pending for Finished {
    fn test(&mut self) -> bool {
        true
    }

    fn wait(self: Box<Self>) -> Vec<f32> {
        self.0
    }
}

/// The group of one rank: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&self, _data: &mut [f32]) {}

    fn all_gather(&self, data: &[f32], out: &mut [f32]) {
        out.copy_from_slice(data);
    }

    fn reduce_scatter_sum(&self, data: &[f32], out: &mut [f32]) {
        out.copy_from_slice(data);
    }
}
