//! Parameters sharded over the data-parallel group (ZeRO-3, `[parallelism] sharding = "full"`):
//! between uses a layer's weights hold no memory; each replica keeps only the f32 masters of its
//! share ([`crate::ShardedAdamW`]).
//!
//! The parameters of each layer (those whose state-dict names share a prefix ending in the
//! layer's index, `transformer.layers.3.…`) sit in buckets of their own, and so do those before
//! the layers (the stem: embedders) and after them (the head: the output layer;
//! [`flux_model::execution::residency::units`]). When the framework runs a layer of a
//! `#[layers]` field ([`flux_model::execution::Layers`]), or a model's stem or head, the layer's
//! buckets are all-gathered from the masters into its weights, and after its forward pass their memory is given back; when backward
//! reaches the layer they are gathered again, and given back as soon as their gradients are
//! reduce-scattered ([`crate::parallel::sharded_grads::GradShard`]). While a layer runs, the gathers of
//! the next one (in the order of the forward pass, reversed in backward) are already in flight
//! (non-blocking all-gathers), so at most two layers' weights are whole at a time. A layer's
//! weights are managed this way from the first time a model runs it; a layer a model never
//! runs stays whole, updated by the optimizer as under `"gradients"`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use flux_model::execution::residency::{
    fill_storage, release_storage, storage_present, LayerParams,
};
use flux_model::tp::{Collective, Pass, Pending};
use tch::Tensor;

use crate::parallel::shard_layout::{gather_share, local_share, ShardLayout};

/// Bytes of weights this process has received from full sharding's all-gathers.
static GATHERED: AtomicU64 = AtomicU64::new(0);

/// Bytes of weights this process has received from `sharding = "full"`'s all-gathers so far,
/// at the weights' width (every rank's share of each gathered bucket, padding included).
pub fn weight_gather_bytes() -> u64 {
    GATHERED.load(Ordering::Relaxed)
}

/// Which weights are present, and the means to gather them.
pub(crate) struct ShardedParams<'a> {
    state: RefCell<Residency<'a>>,
    shard: &'a dyn Collective,
}

/// A layer's bucket gathers started ahead of its use.
type Prefetch<'a> = (String, Vec<(usize, Box<dyn Pending + 'a>)>);

struct Residency<'a> {
    /// The trained parameters, in the optimizer's order.
    params: Vec<Tensor>,
    layout: ShardLayout,
    /// `[owned]` f32 masters, laid out as the optimizer state (shared with the optimizer).
    masters: Tensor,
    /// Buckets of each layer, by name.
    buckets_of: HashMap<String, Vec<usize>>,
    /// The layer (or stem, or head) of each bucket.
    unit_of_bucket: Vec<String>,
    /// Layers a model has run: their weights come and go.
    managed: Vec<String>,
    /// Whether each bucket's weights hold memory.
    present: Vec<bool>,
    /// Managed layers in the order the forward pass runs them.
    order: Vec<String>,
    /// The gathers of the layer expected next, in flight.
    prefetch: Option<Prefetch<'a>>,
}

impl<'a> ShardedParams<'a> {
    /// The weights `params` (optimizer order, `units` the layer, stem or head each is gathered
    /// with) laid out by `layout`, whose buckets do not straddle units, gathered from `masters`
    /// over `shard`.
    pub(crate) fn new(
        params: &[Tensor],
        units: &[String],
        layout: &ShardLayout,
        masters: &Tensor,
        shard: &'a dyn Collective,
    ) -> Self {
        let unit_of_bucket: Vec<String> = layout
            .buckets
            .iter()
            .map(|b| units[b.params.start].clone())
            .collect();
        let mut buckets_of: HashMap<String, Vec<usize>> = HashMap::new();
        for (b, unit) in unit_of_bucket.iter().enumerate() {
            buckets_of.entry(unit.clone()).or_default().push(b);
        }
        Self {
            state: RefCell::new(Residency {
                params: params.iter().map(Tensor::shallow_clone).collect(),
                layout: layout.clone(),
                masters: masters.shallow_clone(),
                buckets_of,
                present: layout
                    .buckets
                    .iter()
                    .map(|b| b.params.clone().all(|p| storage_present(&params[p])))
                    .collect(),
                unit_of_bucket,
                managed: Vec::new(),
                order: Vec::new(),
                prefetch: None,
            }),
            shard,
        }
    }

    /// Whether bucket `b`'s weights belong to a layer the model runs (they are gathered when
    /// used, not written by the optimizer).
    pub(crate) fn is_managed(&self, b: usize) -> bool {
        self.state.borrow().is_managed(b)
    }

    /// Give back bucket `b`'s weights if its layer is managed (its gradients are reduced, or the
    /// masters changed under them).
    pub(crate) fn release_bucket(&self, b: usize) {
        if self.is_managed(b) {
            self.state.borrow_mut().release(b);
        }
    }

    /// Give back the weights of `layers` (the model's, in the order its forward pass runs them,
    /// [`flux_model::DiffusionModel::layers`]) now, once the masters hold them, rather than when
    /// each first runs. Weights given back while the model was built whose layer is not among
    /// them are gathered again: they stay whole, as parameters outside layers do.
    pub(crate) fn release_layers(&self, layers: &[String]) {
        let mut state = self.state.borrow_mut();
        for layer in layers {
            state.manage(layer, true);
            for b in state.buckets(layer) {
                state.release(b);
            }
        }
        for b in 0..state.present.len() {
            if !state.present[b] && !state.is_managed(b) {
                let full = gather_share(&state.share(b), self.shard);
                state.fill(b, &full);
            }
        }
    }

    /// Wait for and drop gathers in flight (before the masters change under them).
    pub(crate) fn discard_prefetch(&self) {
        if let Some((_, pending)) = self.state.borrow_mut().prefetch.take() {
            pending.into_iter().for_each(|(_, p)| drop(p.wait()));
        }
    }
}

impl<'a> Residency<'a> {
    /// Whether bucket `b` belongs to a managed layer (or stem, or head).
    fn is_managed(&self, b: usize) -> bool {
        self.managed.contains(&self.unit_of_bucket[b])
    }

    /// This rank's share of bucket `b` from the masters in the weights' dtype, as the
    /// all-gather sends it (bf16 weights gather half of f32's bytes, to the same values).
    fn share(&self, b: usize) -> Tensor {
        let bucket = &self.layout.buckets[b];
        let parts: Vec<Tensor> = bucket
            .segments
            .iter()
            .map(|s| self.masters.narrow(0, s.in_state as i64, s.len as i64))
            .collect();
        let kind = self.params[bucket.params.start].kind();
        local_share(bucket, &parts, self.masters.device(), kind)
    }

    /// Fill bucket `b`'s weights from `full`, its gathered elements end to end.
    fn fill(&mut self, b: usize, full: &Tensor) {
        let bytes = full.numel() * full.kind().elt_size_in_bytes();
        GATHERED.fetch_add(bytes as u64, Ordering::Relaxed);
        let mut start = 0;
        for p in self.layout.buckets[b].params.clone() {
            let n = self.layout.numels[p] as i64;
            fill_storage(&self.params[p], &full.narrow(0, start, n));
            start += n;
        }
        self.present[b] = true;
    }

    /// The buckets of `layer`, a layer of the model's trained parameters.
    fn buckets(&self, layer: &str) -> Vec<usize> {
        match self.buckets_of.get(layer) {
            Some(buckets) => buckets.clone(),
            None => panic!(
                "layer `{layer}` has no trained parameters: the name the framework runs a \
                 layer under (DiffusionModel::layers) must be the state-dict prefix of the \
                 layer's parameters"
            ),
        }
    }

    /// The buckets of `layer` whose weights hold no memory.
    fn absent(&self, layer: &str) -> Vec<usize> {
        let buckets = self.buckets(layer).into_iter();
        buckets.filter(|&b| !self.present[b]).collect()
    }

    /// Manage `layer`'s weights from now on; `forward` when its forward pass runs it.
    fn manage(&mut self, layer: &str, forward: bool) {
        if !self.managed.iter().any(|l| l == layer) {
            self.managed.push(layer.to_string());
        }
        if forward && !self.order.iter().any(|l| l == layer) {
            self.order.push(layer.to_string());
        }
    }

    /// The layer run after `layer` in `pass`, if known.
    fn next(&self, layer: &str, pass: Pass) -> Option<String> {
        let at = self.order.iter().position(|l| l == layer)?;
        let next = match pass {
            Pass::Forward => at + 1,
            Pass::Backward => at.checked_sub(1)?,
        };
        self.order.get(next).cloned()
    }

    fn release(&mut self, b: usize) {
        if self.present[b] {
            for p in self.layout.buckets[b].params.clone() {
                release_storage(&self.params[p]);
            }
            self.present[b] = false;
        }
    }
}

impl LayerParams for ShardedParams<'_> {
    fn gather(&self, layer: &str, pass: Pass) {
        let mut state = self.state.borrow_mut();
        state.manage(layer, pass == Pass::Forward);
        // Gathers in flight complete in the order they were started, on every rank alike. A
        // layer already whole (gathered again by its second output's hook) leaves them be;
        // otherwise those of another layer than expected are dropped.
        let needed = !state.absent(layer).is_empty();
        let take = needed || state.prefetch.as_ref().is_some_and(|(e, _)| e == layer);
        if let Some((expected, pending)) = state.prefetch.take_if(|_| take) {
            tracing::trace!(
                layer,
                expected,
                buckets = pending.len(),
                "prefetched gathers"
            );
            for (b, p) in pending {
                let full = p.wait();
                if expected == layer && !state.present[b] {
                    state.fill(b, &full);
                }
            }
        }
        for b in state.absent(layer) {
            let full = gather_share(&state.share(b), self.shard);
            state.fill(b, &full);
        }
        if let Some(next) = state.next(layer, pass).filter(|_| state.prefetch.is_none()) {
            let pending: Vec<_> = state
                .absent(&next)
                .into_iter()
                .map(|b| (b, self.shard.start_all_gather(state.share(b))))
                .collect();
            state.prefetch = (!pending.is_empty()).then_some((next, pending));
        }
    }

    fn release(&self, layer: &str) {
        let mut state = self.state.borrow_mut();
        for b in state.buckets(layer) {
            state.release(b);
        }
    }
}
