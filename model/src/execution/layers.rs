//! [`Layers`]: what a `#[layers]` field becomes. A model hands its stack the token streams and
//! the conditioning and says what one block does with them; the stack decides how each block
//! runs — its parameters gathered, its activations kept or recomputed, released, gathered again
//! for backward, its streams split over a sequence-parallel group — so model code is the model's
//! math only.

use std::cell::Cell;
use std::rc::Rc;

use tch::Tensor;

use crate::execution::args::{Conditioning, Stream};
use crate::execution::residency::{self, run_layer, HEAD, STEM};
use crate::tp::TpContext;

/// A `#[layers]` field's blocks, each under its state-dict prefix (`transformer.layers.3`),
/// run in order by [`Layers::run`].
pub struct Layers<B> {
    /// The blocks, shared with the recomputations of graphs not yet back-propagated.
    blocks: Vec<Rc<B>>,
    /// Each block's state-dict prefix: the unit its parameters are gathered and released as.
    names: Vec<String>,
    /// The tensor-parallel group whose ranks split the streams under sequence parallelism.
    tp: TpContext,
    /// Where the stack stands in its model (set by the model that owns it).
    role: Cell<Role>,
    /// Recompute each block's activations in the backward pass of this forward pass.
    recompute: Cell<bool>,
}

/// Where a stack runs in its model's forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Inside another block: its blocks run as plain calls (the enclosing layer is the unit).
    Nested,
    /// A stack of the root block. `opens`: the first one, whose start ends the stem; `closes`:
    /// the last one, whose end starts the head.
    Root { opens: bool, closes: bool },
}

/// What the framework sets on every stack of a model (`Block::visit_layers`).
pub trait LayerStack {
    /// Each block's state-dict prefix, in order.
    fn names(&self) -> &[String];

    /// Where the stack stands in its model's forward pass.
    fn set_role(&self, role: Role);

    /// Recompute each block's activations in the backward pass of the coming forward passes.
    fn set_recompute(&self, on: bool);
}

impl<B> Layers<B> {
    /// The stack of `blocks` (prefix, block) of the group `tp`, nested until its model says
    /// otherwise.
    pub fn new(tp: &TpContext, blocks: impl IntoIterator<Item = (String, B)>) -> Self {
        let (names, blocks) = blocks.into_iter().map(|(n, b)| (n, Rc::new(b))).unzip();
        Self {
            blocks,
            names,
            tp: tp.clone(),
            role: Cell::new(Role::Nested),
            recompute: Cell::new(false),
        }
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the stack has no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The blocks, in order.
    pub fn iter(&self) -> impl Iterator<Item = &B> {
        self.blocks.iter().map(|b| &**b)
    }
}

impl<B: 'static> Layers<B> {
    /// Run every block in order: `f(block, streams, conditioning)` is one block's forward pass,
    /// taking the streams `[B, L, D]` the previous block returned and the `conditioning` every
    /// block reads, and returning the new streams. The streams come back whole (`[B, L, D]`)
    /// whatever the parallel layout.
    ///
    /// `f` must compute the same function each time it runs (a recomputed block runs twice), and
    /// the head may read only what the stacks return and what the stem made for them.
    pub fn run<S: Stream, C: Conditioning>(
        &self,
        streams: S,
        conditioning: C,
        f: impl Fn(&B, S, &C::Owned) -> S + 'static,
    ) -> S {
        let Role::Root { opens, closes } = self.role.get() else {
            let conditioning = conditioning.with_tensors(&mut conditioning.tensors().into_iter());
            return self.iter().fold(streams, |s, b| f(b, s, &conditioning));
        };
        let entering = streams.into_tensors();
        let read = conditioning.tensors();
        // What the stem made: its parameters are gathered again when backward reaches any.
        if opens {
            residency::release(STEM, &entering.iter().chain(&read).collect::<Vec<_>>());
        } else if residency::installed() {
            residency::on_backward(STEM, &read.iter().collect::<Vec<_>>());
        }
        // The entering streams go as they are split: nothing holds them past the first block.
        let mut x: Vec<Tensor> = entering
            .into_iter()
            .map(|t| self.tp.scatter_sequence(&t))
            .collect();
        let n_streams = x.len();
        let f = Rc::new(f);
        let template =
            Rc::new(conditioning.with_tensors(&mut read.iter().map(|t| t.shallow_clone())));
        for (block, name) in self.blocks.iter().zip(&self.names) {
            let (block, f, template) = (block.clone(), f.clone(), template.clone());
            let inputs: Vec<&Tensor> = x.iter().chain(&read).collect();
            x = run_layer(
                name,
                &inputs,
                n_streams,
                self.recompute.get(),
                move |args| {
                    let mut args = args.iter().map(Tensor::shallow_clone);
                    let streams = S::from_tensors(&mut args);
                    let conditioning = template.with_tensors(&mut args);
                    f(&block, streams, &conditioning).into_tensors()
                },
            );
        }
        let whole: Vec<Tensor> = x.iter().map(|t| self.tp.gather_sequence(t)).collect();
        if closes {
            residency::gather(HEAD);
        }
        S::from_tensors(&mut whole.into_iter())
    }
}

impl<B> LayerStack for Layers<B> {
    fn names(&self) -> &[String] {
        &self.names
    }

    fn set_role(&self, role: Role) {
        self.role.set(role);
    }

    fn set_recompute(&self, on: bool) {
        self.recompute.set(on);
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for Layers<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.names.iter().zip(self.iter()))
            .finish()
    }
}

impl<B> std::ops::Index<usize> for Layers<B> {
    type Output = B;

    fn index(&self, i: usize) -> &B {
        &self.blocks[i]
    }
}

/// Run a root block's forward pass `forward`, whose stacks are `stacks` (in field order): the
/// stem's parameters gathered before it, the head's released after it (and gathered again when
/// backward starts from the prediction), each layer recomputed when `recompute`.
pub(crate) fn run_model<E>(
    stacks: &[&dyn LayerStack],
    recompute: bool,
    forward: impl FnOnce() -> Result<Tensor, E>,
) -> Result<Tensor, E> {
    let last = stacks.len().saturating_sub(1);
    for (i, stack) in stacks.iter().enumerate() {
        stack.set_role(Role::Root {
            opens: i == 0,
            closes: i == last,
        });
        stack.set_recompute(recompute);
    }
    residency::gather(STEM);
    match forward() {
        Ok(prediction) => {
            residency::release(HEAD, &[&prediction]);
            Ok(prediction)
        }
        Err(e) => {
            residency::release(STEM, &[]);
            Err(e)
        }
    }
}
