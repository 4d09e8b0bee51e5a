//! What a stack of layers passes from block to block ([`Stream`]) and what every block of it reads
//! unchanged ([`Conditioning`]): the framework hands both to each block as tensors, so that it can
//! keep them for recomputation and split the streams over a sequence-parallel group.

use tch::Tensor;

use crate::embeddings::Rope;

/// The token streams each block transforms and returns: one tensor `[B, L, D]` or a tuple of
/// them (FLUX's image and text streams).
pub trait Stream: Sized + 'static {
    /// The tensors, in order.
    fn into_tensors(self) -> Vec<Tensor>;

    /// The stream from exactly as many tensors as [`Stream::into_tensors`] gives.
    fn from_tensors(tensors: &mut dyn Iterator<Item = Tensor>) -> Self;
}

impl Stream for Tensor {
    fn into_tensors(self) -> Vec<Tensor> {
        vec![self]
    }

    fn from_tensors(tensors: &mut dyn Iterator<Item = Tensor>) -> Self {
        tensors.next().expect("one tensor per stream")
    }
}

impl Stream for (Tensor, Tensor) {
    fn into_tensors(self) -> Vec<Tensor> {
        vec![self.0, self.1]
    }

    fn from_tensors(tensors: &mut dyn Iterator<Item = Tensor>) -> Self {
        (Tensor::from_tensors(tensors), Tensor::from_tensors(tensors))
    }
}

/// What every block of a stack reads besides the streams: conditioning vectors (`[B, D]`),
/// modulations, rotary tables. Passed by reference (`(&vec, &rope)`); each block gets an owned
/// copy that shares the tensors ([`Conditioning::Owned`]).
pub trait Conditioning {
    /// The value the blocks receive.
    type Owned: Conditioning<Owned = Self::Owned> + 'static;

    /// The tensors it holds (sharing storage), in order.
    fn tensors(&self) -> Vec<Tensor>;

    /// The same value holding the next tensors of `tensors` instead (as many as
    /// [`Conditioning::tensors`] gives): how a recomputed block reads the tensors autograd saved.
    fn with_tensors(&self, tensors: &mut dyn Iterator<Item = Tensor>) -> Self::Owned;
}

impl Conditioning for Tensor {
    type Owned = Tensor;

    fn tensors(&self) -> Vec<Tensor> {
        vec![self.shallow_clone()]
    }

    fn with_tensors(&self, tensors: &mut dyn Iterator<Item = Tensor>) -> Tensor {
        tensors.next().expect("one tensor per conditioning tensor")
    }
}

impl Conditioning for Rope {
    type Owned = Rope;

    fn tensors(&self) -> Vec<Tensor> {
        let (cos, sin) = self.tables();
        vec![cos.shallow_clone(), sin.shallow_clone()]
    }

    fn with_tensors(&self, tensors: &mut dyn Iterator<Item = Tensor>) -> Rope {
        let cos = tensors.next().expect("the cosine table");
        let sin = tensors.next().expect("the sine table");
        self.with_tables(cos, sin)
    }
}

impl<T: Conditioning + ?Sized> Conditioning for &T {
    type Owned = T::Owned;

    fn tensors(&self) -> Vec<Tensor> {
        (**self).tensors()
    }

    fn with_tensors(&self, tensors: &mut dyn Iterator<Item = Tensor>) -> T::Owned {
        (**self).with_tensors(tensors)
    }
}

impl<A: Conditioning, B: Conditioning> Conditioning for (A, B) {
    type Owned = (A::Owned, B::Owned);

    fn tensors(&self) -> Vec<Tensor> {
        let mut all = self.0.tensors();
        all.extend(self.1.tensors());
        all
    }

    fn with_tensors(&self, tensors: &mut dyn Iterator<Item = Tensor>) -> Self::Owned {
        (self.0.with_tensors(tensors), self.1.with_tensors(tensors))
    }
}

impl<A: Conditioning, B: Conditioning, C: Conditioning> Conditioning for (A, B, C) {
    type Owned = (A::Owned, B::Owned, C::Owned);

    fn tensors(&self) -> Vec<Tensor> {
        let mut all = self.0.tensors();
        all.extend(self.1.tensors());
        all.extend(self.2.tensors());
        all
    }

    fn with_tensors(&self, tensors: &mut dyn Iterator<Item = Tensor>) -> Self::Owned {
        (
            self.0.with_tensors(tensors),
            self.1.with_tensors(tensors),
            self.2.with_tensors(tensors),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn conditioning_round_trips_through_its_tensors() {
        let a = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
        let b = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let value = (&a, &b);
        let tensors = value.tensors();
        assert_eq!(tensors.len(), 2);
        let replaced = [b.shallow_clone(), a.shallow_clone()];
        let (x, y) = value.with_tensors(&mut replaced.into_iter());
        assert_eq!(x.size(), [4]);
        assert_eq!(y.size(), [2, 3]);
    }

    #[test]
    fn streams_come_back_in_order() {
        let a = Tensor::ones([1], (Kind::Float, Device::Cpu));
        let b = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let (x, y) = <(Tensor, Tensor)>::from_tensors(&mut (a, b).into_tensors().into_iter());
        assert_eq!((x.size(), y.size()), (vec![1], vec![2]));
    }
}
