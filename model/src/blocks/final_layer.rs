//! The output layer: adaptive LayerNorm on the image tokens, then a projection to patch channels.

use tch::Tensor;

use crate::layers::{AdaLnContinuous, Linear};
use crate::params::ParamPath;
use crate::FluxConfig;

/// `norm_out` (`AdaLNContinuous`, rows `[shift; scale]`) then `proj_out` `[C·p², D]`.
#[derive(Debug)]
pub struct FinalLayer<P = Tensor> {
    /// Output modulation.
    pub norm_out: AdaLnContinuous<P>,
    /// Projection to `C·p²` channels per token.
    pub proj_out: Linear<P>,
}

impl<P> FinalLayer<P> {
    /// Create `p.norm_out` and `p.proj_out` (top-level names in the state dict).
    pub fn new<T: ParamPath<Param = P>>(p: &T, config: &FluxConfig) -> Self {
        let d = config.hidden_size;
        Self {
            norm_out: AdaLnContinuous::new(&p.sub("norm_out"), d, config.layernorm_epsilon),
            proj_out: Linear::new(&p.sub("proj_out"), d, config.token_channels(), true),
        }
    }
}

impl FinalLayer {
    /// `img [B, L, D]`, `vec [B, D]` → `[B, L, C·p²]`.
    pub fn forward(&self, img: &Tensor, vec: &Tensor) -> Tensor {
        self.proj_out.forward(&self.norm_out.forward(img, vec))
    }
}
