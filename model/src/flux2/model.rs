//! The FLUX.2 transformer: embedders, the modulations shared by all blocks, double- and
//! single-stream blocks and the output layer, with diffusers' state-dict names.

use flux_macros::diffusion_block;
use tch::{Device, Kind, Tensor};

use crate::architecture::Built;
use crate::embeddings::{EmbedNd, EmbedderDims, TimeStepEmbedder};
use crate::execution::Layers;
use crate::flux2::{Flux2Config, Flux2SingleTransformerBlock, Flux2TransformerBlock};
use crate::layers::{adaln_continuous, modulation_params, Halves};
use crate::patchify::{patchify, unpatchify};
use crate::tp::Linear;

/// Timestep and guidance embedders (`time_guidance_embed`), bias-free.
#[diffusion_block(config = Flux2Config)]
#[derive(Debug)]
pub struct TimeGuidanceEmbed {
    /// Timestep sinusoids → `D`.
    #[module(config = EmbedderDims { in_dim: config.timestep_guidance_channels, hidden: config.hidden_size(), bias: false })]
    pub timestep_embedder: TimeStepEmbedder,
    /// Guidance-strength sinusoids → `D`, when `guidance_embeds`.
    #[module(config = EmbedderDims { in_dim: config.timestep_guidance_channels, hidden: config.hidden_size(), bias: false },
             when = config.guidance_embeds)]
    pub guidance_embedder: Option<TimeStepEmbedder>,
}

impl TimeGuidanceEmbed {
    /// `t [B]` in `[0, 1]`, guidance `[B]` → conditioning `[B, D]`.
    pub fn forward(&self, t: &Tensor, guidance: Option<&Tensor>) -> Tensor {
        let emb = self.timestep_embedder.forward(t);
        match (&self.guidance_embedder, guidance) {
            (Some(embedder), Some(g)) => emb + embedder.forward(g),
            _ => emb,
        }
    }
}

/// FLUX.2's module tree (`x_embedder`, `context_embedder`, `time_guidance_embed`,
/// `double_stream_modulation_{img,txt}`, `single_stream_modulation`, `transformer_blocks.{i}`,
/// `single_transformer_blocks.{i}`, `norm_out`, `proj_out`). Embedders, modulations and the
/// output layer are replicated.
#[diffusion_block(config = Flux2Config)]
#[derive(Debug)]
pub struct Flux2Transformer {
    /// Image tokens `C·p²` → `D`.
    #[linear(in = config.token_channels(), out = config.hidden_size(), bias = false)]
    pub x_embedder: Linear,
    /// Text states → `D`.
    #[linear(in = config.joint_attention_dim, out = config.hidden_size(), bias = false)]
    pub context_embedder: Linear,
    /// Timestep (and guidance) conditioning.
    #[module]
    pub time_guidance_embed: TimeGuidanceEmbed,
    /// Image modulation of every double block: two (shift, scale, gate) triples, `[6D, D]`.
    #[linear(in = config.hidden_size(), out = 6 * config.hidden_size(), bias = false,
             name = "double_stream_modulation_img.linear")]
    pub double_stream_modulation_img: Linear,
    /// Text modulation of every double block, `[6D, D]`.
    #[linear(in = config.hidden_size(), out = 6 * config.hidden_size(), bias = false,
             name = "double_stream_modulation_txt.linear")]
    pub double_stream_modulation_txt: Linear,
    /// Modulation of every single block, `[3D, D]`.
    #[linear(in = config.hidden_size(), out = 3 * config.hidden_size(), bias = false,
             name = "single_stream_modulation.linear")]
    pub single_stream_modulation: Linear,
    /// Double-stream blocks.
    #[layers(count = config.num_layers)]
    pub transformer_blocks: Layers<Flux2TransformerBlock>,
    /// Single-stream blocks.
    #[layers(count = config.num_single_layers)]
    pub single_transformer_blocks: Layers<Flux2SingleTransformerBlock>,
    /// Output modulation `[2D, D]`, rows `[scale; shift]`.
    #[linear(in = config.hidden_size(), out = 2 * config.hidden_size(), bias = false,
             name = "norm_out.linear")]
    pub norm_out: Linear,
    /// Projection to `C·p²` channels per token.
    #[linear(in = config.hidden_size(), out = config.token_channels(), bias = false)]
    pub proj_out: Linear,
    #[value(EmbedNd::new(config.rope_theta, &config.axes_dims_rope, true))]
    pe_embedder: EmbedNd,
    #[value(config.clone())]
    config: Flux2Config,
}

/// Position ids `[B, L, 4]` (time, row, column, text index): image tokens `(0, r, c, 0)` of a
/// `rows × cols` grid in row-major order, text tokens `(0, 0, 0, i)`, text first.
fn position_ids(batch: i64, text_len: i64, rows: i64, cols: i64, device: Device) -> Tensor {
    let opts = (Kind::Float, device);
    let zeros = |n| Tensor::zeros([n], opts);
    let text = Tensor::stack(
        &[
            zeros(text_len),
            zeros(text_len),
            zeros(text_len),
            Tensor::arange(text_len, opts),
        ],
        -1,
    );
    let r = Tensor::arange(rows, opts).repeat_interleave_self_int(cols, 0, None);
    let c = Tensor::arange(cols, opts).repeat([rows]);
    let n = rows * cols;
    let image = Tensor::stack(&[zeros(n), r, c, zeros(n)], -1);
    Tensor::cat(&[text, image], 0)
        .unsqueeze(0)
        .expand([batch, text_len + n, 4], false)
}

impl Flux2Transformer {
    /// The configuration.
    pub fn config(&self) -> &Flux2Config {
        &self.config
    }

    /// The name a double-stream (`single = false`) or single-stream block `i` runs under: its
    /// parameters' state-dict prefix.
    pub fn layer_name(single: bool, i: usize) -> String {
        match single {
            false => format!("transformer_blocks.{i}"),
            true => format!("single_transformer_blocks.{i}"),
        }
    }

    /// `latents [B, C, H, W]`, `text [B, S, joint_attention_dim]`, `t [B]` (σ in `[0, 1]`),
    /// `guidance [B]` → predicted velocity `[B, C, H, W]`.
    pub fn forward(
        &self,
        latents: &Tensor,
        text: &Tensor,
        t: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Tensor {
        let p = self.config.patch_size;
        let (b, _, h, w) = latents.size4().expect("latents must be [B, C, H, W]");
        let (rows, cols) = (h / p, w / p);
        let text_len = text.size()[1];

        // Conditioning, and the modulations of every block computed once.
        let temb = self.time_guidance_embed.forward(t, guidance);
        let silu = temb.silu();
        let mod_img = modulation_params(&self.double_stream_modulation_img, &silu);
        let mod_txt = modulation_params(&self.double_stream_modulation_txt, &silu);
        let mod_single = modulation_params(&self.single_stream_modulation, &silu);
        let img = self.x_embedder.forward(&patchify(latents, p));
        let txt = self.context_embedder.forward(text);
        let rope =
            self.pe_embedder
                .forward(&position_ids(b, text_len, rows, cols, latents.device()));

        let (img, txt) = self.transformer_blocks.run(
            (img, txt),
            (&mod_img, &mod_txt, &rope),
            |block, (img, txt), (mod_img, mod_txt, rope)| {
                block.forward(&img, &txt, mod_img, mod_txt, rope)
            },
        );
        let x = self.single_transformer_blocks.run(
            Tensor::cat(&[txt, img], 1),
            (&mod_single, &rope),
            |block, x, (mod_single, rope)| block.forward(&x, mod_single, rope),
        );

        let img = x.narrow(1, text_len, rows * cols);
        let out = adaln_continuous(
            &self.norm_out,
            &img,
            &temb,
            self.config.eps,
            Halves::ScaleShift,
        );
        unpatchify(&self.proj_out.forward(&out), p, rows, cols)
    }
}

/// A FLUX.2 model with its weights on this rank.
pub type Flux2 = Built<Flux2Transformer>;
