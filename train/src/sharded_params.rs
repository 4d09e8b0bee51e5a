//! Parameters sharded over the data-parallel group (ZeRO-3, `[parallelism] sharding = "full"`):
//! between uses a layer's weights hold no memory; each replica keeps only the f32 masters of its
//! share ([`crate::ShardedAdamW`]).
//!
//! The parameters of each layer (those whose state-dict names share a prefix ending in the
//! layer's index, `transformer.layers.3.…`) sit in buckets of their own. When a model runs a
//! layer through [`flux_model::residency::run_layer`], the layer's buckets are all-gathered from
//! the masters into its weights, and after its forward pass their memory is given back; when
//! backward reaches the layer they are gathered again, and given back as soon as their gradients
//! are reduce-scattered ([`crate::sharded_grads::GradShard`]). A layer's weights are managed this
//! way from the first time a model runs it; parameters outside layers (embedders, the final
//! projection) and layers a model never announces stay whole, updated by the optimizer as under
//! `"gradients"`.

use std::cell::RefCell;
use std::collections::HashMap;

use flux_model::residency::{fill_storage, release_storage, LayerParams};
use flux_model::tp::Collective;
use tch::Tensor;

use crate::shard_layout::{gather_bucket, ShardLayout};

/// The layer a parameter belongs to: its name up to and including the first all-digit component
/// (`transformer.layers.3.attn.to_q.weight` → `transformer.layers.3`), or `None` outside layers.
pub(crate) fn layer_of(name: &str) -> Option<&str> {
    let mut end = 0;
    for part in name.split('.') {
        end += part.len();
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return Some(&name[..end]);
        }
        end += 1;
    }
    None
}

/// Which weights are present, and the means to gather them.
pub(crate) struct ShardedParams<'a> {
    state: RefCell<Residency>,
    shard: &'a dyn Collective,
}

struct Residency {
    /// The trained parameters, in the optimizer's order.
    params: Vec<Tensor>,
    layout: ShardLayout,
    /// `[owned]` f32 masters, laid out as the optimizer state (shared with the optimizer).
    masters: Tensor,
    /// Buckets of each layer, by name.
    buckets_of: HashMap<String, Vec<usize>>,
    /// The layer of each bucket, if any.
    layer_of_bucket: Vec<Option<String>>,
    /// Layers a model has run: their weights come and go.
    managed: Vec<String>,
    /// Whether each bucket's weights hold memory.
    present: Vec<bool>,
}

impl<'a> ShardedParams<'a> {
    /// The weights `params` (optimizer order, `names` their state-dict names) laid out by
    /// `layout`, whose buckets do not straddle layers, gathered from `masters` over `shard`.
    pub(crate) fn new(
        params: &[Tensor],
        names: &[&str],
        layout: &ShardLayout,
        masters: &Tensor,
        shard: &'a dyn Collective,
    ) -> Self {
        let mut buckets_of: HashMap<String, Vec<usize>> = HashMap::new();
        let layer_of_bucket: Vec<Option<String>> = layout
            .buckets
            .iter()
            .map(|b| layer_of(names[b.params.start]).map(str::to_string))
            .collect();
        for (b, layer) in layer_of_bucket.iter().enumerate() {
            if let Some(layer) = layer {
                buckets_of.entry(layer.clone()).or_default().push(b);
            }
        }
        Self {
            state: RefCell::new(Residency {
                params: params.iter().map(Tensor::shallow_clone).collect(),
                layout: layout.clone(),
                masters: masters.shallow_clone(),
                buckets_of,
                present: vec![true; layer_of_bucket.len()],
                layer_of_bucket,
                managed: Vec::new(),
            }),
            shard,
        }
    }

    /// Whether bucket `b`'s weights belong to a layer the model runs (they are gathered when
    /// used, not written by the optimizer).
    pub(crate) fn is_managed(&self, b: usize) -> bool {
        let state = self.state.borrow();
        state.layer_of_bucket[b]
            .as_ref()
            .is_some_and(|l| state.managed.contains(l))
    }

    /// Give back bucket `b`'s weights if its layer is managed (its gradients are reduced, or the
    /// masters changed under them).
    pub(crate) fn release_bucket(&self, b: usize) {
        if self.is_managed(b) {
            self.state.borrow_mut().release(b);
        }
    }
}

impl Residency {
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
    fn gather(&self, layer: &str) {
        let mut state = self.state.borrow_mut();
        let Some(buckets) = state.buckets_of.get(layer).cloned() else {
            panic!(
                "layer `{layer}` has no trained parameters: the name a model passes to \
                 run_layer must be the state-dict prefix of the layer's parameters"
            );
        };
        if !state.managed.iter().any(|l| l == layer) {
            state.managed.push(layer.to_string());
        }
        for b in buckets {
            if state.present[b] {
                continue;
            }
            let bucket = &state.layout.buckets[b];
            let parts: Vec<Tensor> = bucket
                .segments
                .iter()
                .map(|s| state.masters.narrow(0, s.in_state as i64, s.len as i64))
                .collect();
            let full = gather_bucket(bucket, &parts, self.shard);
            let mut start = 0;
            for p in bucket.params.clone() {
                let n = state.layout.numels[p] as i64;
                fill_storage(&state.params[p], &full.narrow(0, start, n));
                start += n;
            }
            state.present[b] = true;
        }
    }

    fn release(&self, layer: &str) {
        let mut state = self.state.borrow_mut();
        for b in state.buckets_of.get(layer).cloned().unwrap_or_default() {
            state.release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_is_the_name_through_its_index() {
        assert_eq!(
            layer_of("transformer.layers.3.attn.to_q.weight"),
            Some("transformer.layers.3")
        );
        assert_eq!(layer_of("blocks.12.mlp.fc1.bias"), Some("blocks.12"));
        assert_eq!(layer_of("x_embedder.weight"), None);
        assert_eq!(layer_of("a.b2.c"), None);
    }
}
