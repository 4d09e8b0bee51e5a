//! Building a fully sharded model (`[parallelism] sharding = "full"`) one weight at a time: as
//! each weight is created, this rank's parts of it are copied into the f32 masters, and the
//! weight then gives its memory back at once (the optimizer gathers again those of layers the
//! model never runs). A rank so never holds more than its
//! masters and the weight being initialised, where building the whole model first would hold
//! every weight of its tensor-parallel shard (2 bytes a parameter in bf16: 64 GB for FLUX.2 at
//! TP 1).

use std::collections::HashMap;

use flux_model::execution::residency::release_storage;
use flux_model::tp::ParamSpec;
use tch::{Device, Kind, Tensor};

use crate::config::run_config::Sharding;
use crate::parallel::shard_layout::{ParamOrder, Segment};

/// The masters of a fully sharded model being built, filled as its weights are created.
pub(crate) struct ShardedBuild {
    /// Each parameter's optimizer index, by state-dict name.
    index: HashMap<String, usize>,
    /// The parts of each parameter (optimizer order) this rank owns.
    segments: Vec<Vec<Segment>>,
    /// Whether each parameter has been created.
    created: Vec<bool>,
    /// `[owned]` f32 masters, laid out as the optimizer keeps them.
    masters: Tensor,
}

impl ShardedBuild {
    /// The masters of parameters `specs` (a rank's at tensor-parallel size `tp`), in buckets of
    /// at most `bucket` elements over `ranks` replicas, of which this is `rank`, on `device`:
    /// laid out exactly as [`crate::ShardedAdamW`] lays out its state under `"full"`.
    pub(crate) fn new(
        specs: &[ParamSpec],
        tp: usize,
        bucket: usize,
        (ranks, rank): (usize, usize),
        device: Device,
    ) -> Self {
        let order = ParamOrder::new(specs, tp, Sharding::Full, bucket, ranks, rank);
        let mut segments = vec![Vec::new(); order.spec_of.len()];
        for s in order.layout.segments() {
            segments[s.param].push(*s);
        }
        Self {
            index: order
                .spec_of
                .iter()
                .enumerate()
                .map(|(p, &i)| (specs[i].name.clone(), p))
                .collect(),
            created: vec![false; segments.len()],
            segments,
            masters: Tensor::zeros([order.layout.owned as i64], (Kind::Float, device)),
        }
    }

    /// Weight `name` was just created holding `value` (this rank's tensor-parallel shard, in the
    /// training dtype): copy the parts this rank owns into the masters, and give the weight's
    /// memory back.
    pub(crate) fn take(&mut self, name: &str, value: &Tensor) {
        let Some(&p) = self.index.get(name) else {
            panic!("weight `{name}` was created but is not among the model's parameter specs");
        };
        tch::no_grad(|| {
            let flat = value.view([-1]);
            for s in &self.segments[p] {
                self.masters
                    .narrow(0, s.in_state as i64, s.len as i64)
                    .copy_(&flat.narrow(0, s.in_param as i64, s.len as i64));
            }
        });
        self.created[p] = true;
        release_storage(value);
    }

    /// The masters, once every parameter has been created.
    pub(crate) fn finish(self) -> Tensor {
        let missing: Vec<&str> = self
            .index
            .iter()
            .filter(|&(_, &p)| !self.created[p])
            .map(|(name, _)| name.as_str())
            .collect();
        assert!(
            missing.is_empty(),
            "weights the model's specs list were never created: {missing:?}"
        );
        self.masters
    }
}
