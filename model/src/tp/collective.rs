//! The communication a tensor- or data-parallel group needs, behind a trait so that the model
//! crate needs no MPI (`flux-cluster` implements it over MPI and over libtorch's c10d).

use tch::Tensor;

use super::staging;

/// A group of ranks that sums, scatters, gathers and broadcasts. Every rank of the group must
/// make the same calls in the same order (as with any collective).
///
/// Two layers: three required methods move `f32` buffers in host memory (what MPI moves, and
/// what the stop and failure agreements need); the tensor methods take tensors of any dtype and
/// device, contiguous, and by default stage them through host `f32` buffers and those three,
/// counting the bytes ([`staging::host_staged_bytes`]). A backend that moves a tensor where it
/// lies (c10d's NCCL on CUDA, gloo on the CPU) overrides them.
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

    /// Replace `t` (contiguous, any dtype and device) by its elementwise sum over the group.
    fn all_reduce(&self, t: &Tensor) {
        staging::all_reduce(self, t);
    }

    /// Write every rank's `input` (`n` elements, contiguous, any shape) in rank order into
    /// `output` (`size() · n` elements, contiguous, of `input`'s dtype and device).
    fn all_gather_into(&self, input: &Tensor, output: &Tensor) {
        staging::all_gather(self, input, output);
    }

    /// Sum `input` (`size() · n` elements, contiguous, any shape) over the group and write block
    /// `rank()` of the sum, in its flattened order, into `output` (`n` elements, contiguous, of
    /// `input`'s dtype and device).
    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor) {
        staging::reduce_scatter(self, input, output);
    }

    /// Replace `t` (contiguous, small: float8 scales' maxima) by its elementwise maximum over
    /// the group; by default every rank's `t` is gathered and reduced locally.
    fn all_reduce_max(&self, t: &Tensor) {
        if self.size() == 1 {
            return;
        }
        let all = t.new_zeros(
            [self.size() as i64, t.numel() as i64],
            (t.kind(), t.device()),
        );
        self.all_gather_into(t, &all);
        tch::no_grad(|| {
            let max = all.amax([0], false).view(t.size().as_slice());
            t.shallow_clone().copy_(&max)
        });
    }

    /// Replace `t` (contiguous) on every rank by rank `root`'s `t`.
    fn broadcast(&self, t: &Tensor, root: usize) {
        staging::broadcast(self, t, root);
    }

    /// Start replacing `t` (contiguous, any dtype and device) by its elementwise sum over the
    /// group and return at once where the backend can, so that computation goes on while the
    /// sum travels; the default sums before returning. The sum is what the handle's
    /// [`Pending::wait`] returns (`t` itself, or a tensor like it). Every rank of the group must
    /// start the same sums in the same order.
    fn start_all_reduce(&self, t: Tensor) -> Box<dyn Pending + '_> {
        self.all_reduce(&t);
        Box::new(Finished(t))
    }

    /// Start gathering every rank's `input` (`[n]`, contiguous) in rank order and return at once
    /// where the backend can; the handle's [`Pending::wait`] returns the `[size() · n]` result,
    /// of `input`'s dtype and device. Every rank of the group must start the same gathers in the
    /// same order.
    fn start_all_gather(&self, input: Tensor) -> Box<dyn Pending + '_> {
        let output = input.new_zeros(
            [input.numel() as i64 * self.size() as i64],
            (input.kind(), input.device()),
        );
        self.all_gather_into(&input, &output);
        Box::new(Finished(output))
    }

    /// Start summing `input` (`size() · n` elements, contiguous) over the group and keeping
    /// block `rank()`, as [`Collective::reduce_scatter_into`] does, and return at once where the
    /// backend can; the handle's [`Pending::wait`] returns the `[n]` block, of `input`'s dtype
    /// and device.
    fn start_reduce_scatter(&self, input: Tensor) -> Box<dyn Pending + '_> {
        let output = input.new_zeros(
            [input.numel() as i64 / self.size() as i64],
            (input.kind(), input.device()),
        );
        self.reduce_scatter_into(&input, &output);
        Box::new(Finished(output))
    }

    /// Start replacing `t` (contiguous) by rank `root`'s `t` and return at once where the
    /// backend can; the handle's [`Pending::wait`] returns `t`.
    fn start_broadcast(&self, t: Tensor, root: usize) -> Box<dyn Pending + '_> {
        self.broadcast(&t, root);
        Box::new(Finished(t))
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

/// A collective started by one of [`Collective`]'s `start_` methods, in flight.
pub trait Pending {
    /// Let the collective progress without blocking (MPI moves a non-blocking collective along
    /// only inside its calls); whether it has finished.
    fn test(&mut self) -> bool;
    /// Wait for the collective and return its result.
    fn wait(self: Box<Self>) -> Tensor;
}

/// A collective that was finished when it was started.
#[derive(Debug)]
pub struct Finished(pub Tensor);

impl Pending for Finished {
    fn test(&mut self) -> bool {
        true
    }

    fn wait(self: Box<Self>) -> Tensor {
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

    fn all_reduce(&self, _t: &Tensor) {}

    fn all_gather_into(&self, input: &Tensor, output: &Tensor) {
        tch::no_grad(|| output.shallow_clone().copy_(input));
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor) {
        tch::no_grad(|| output.shallow_clone().copy_(input));
    }

    fn broadcast(&self, _t: &Tensor, _root: usize) {}
}
