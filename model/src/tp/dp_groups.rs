//! A rank's data-parallel group and, for sharded data parallelism, its split into shard groups
//! (HSDP, torchtitan's and FSDP's hybrid sharding: state sharded within a group of ranks,
//! replicated across the groups).

use super::{Collective, SingleRank};

/// The data-parallel groups a rank takes part in. Without a split, `shard` is `all` and `across`
/// is this rank alone; with shard groups of `g` consecutive data-parallel ranks, `shard` holds
/// this rank's group and `across` the `all.size() / g` ranks at the same position in every group
/// (the ranks that hold the same share).
#[derive(Clone, Copy)]
pub struct DpGroups<'a> {
    /// Every data-parallel replica: the batch is split over it, the loss summed over it.
    pub all: &'a dyn Collective,
    /// The replicas this rank shards state with.
    pub shard: &'a dyn Collective,
    /// The ranks holding the same share in the other shard groups; summing a share over it
    /// completes a sum over `all`.
    pub across: &'a dyn Collective,
}

impl<'a> DpGroups<'a> {
    /// `all`, unsplit: state is sharded over every replica.
    pub fn whole(all: &'a dyn Collective) -> Self {
        Self {
            all,
            shard: all,
            across: &SingleRank,
        }
    }
}

impl std::fmt::Debug for DpGroups<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DpGroups(rank {} of {}, shard {} of {}, across {} of {})",
            self.all.rank(),
            self.all.size(),
            self.shard.rank(),
            self.shard.size(),
            self.across.rank(),
            self.across.size()
        )
    }
}
