//! An exponential moving average of the trained weights, kept in f32 beside the master weights
//! (the same local shards), saved in checkpoints and resumed exactly.

use tch::Tensor;

/// `ema ← decay · ema + (1 − decay) · weights`, every `every` optimizer steps.
pub struct Ema {
    decay: f64,
    every: u64,
    /// One f32 tensor per trained parameter (local shards), in spec order.
    shadows: Vec<Tensor>,
}

impl Ema {
    /// An average starting at `masters` (the f32 master weights).
    pub fn new(decay: f64, every: u64, masters: &[Tensor]) -> Self {
        Self {
            decay,
            every,
            shadows: masters.iter().map(|m| m.detach().copy()).collect(),
        }
    }

    /// Fold in `masters` after optimizer step `step` (1-based) when it is an update step.
    pub fn update(&mut self, step: u64, masters: &[Tensor]) {
        if !step.is_multiple_of(self.every) {
            return;
        }
        tch::no_grad(|| {
            for (shadow, master) in self.shadows.iter_mut().zip(masters) {
                // shadow + (1 − decay) · (master − shadow)
                let _ = shadow.lerp_(master, 1.0 - self.decay);
            }
        });
    }

    /// The averages, one per trained parameter.
    pub fn shadows(&self) -> &[Tensor] {
        &self.shadows
    }

    /// Continue from saved averages.
    pub fn load(&mut self, saved: Vec<Tensor>) {
        tch::no_grad(|| {
            for (shadow, value) in self.shadows.iter_mut().zip(saved) {
                shadow.copy_(&value);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_average_moves_a_one_minus_decay_share_toward_the_weights_on_update_steps() {
        let start = Tensor::from_slice(&[0.0f32, 10.0]);
        let mut ema = Ema::new(0.9, 2, &[start]);
        let target = Tensor::from_slice(&[1.0f32, 0.0]);
        for step in 1..=6 {
            ema.update(step, std::slice::from_ref(&target));
        }
        // Three updates (steps 2, 4, 6): ema = 0.9³ · start + (1 − 0.9³) · target.
        let kept = 0.9f64.powi(3);
        let got = Vec::<f32>::try_from(&ema.shadows()[0]).unwrap();
        assert!((got[0] as f64 - (1.0 - kept)).abs() < 1e-6, "{got:?}");
        assert!((got[1] as f64 - 10.0 * kept).abs() < 1e-5, "{got:?}");
    }
}
