#!/usr/bin/env python3
"""The PyTorch side of benches/encode.sh, and its set-up.

    .venv/bin/python benches/encode_reference.py setup OUT_DIR [--images N] [--size PX]
    .venv/bin/python benches/encode_reference.py run IMAGES_DIR FLUX_DIR [--batch B] [--text-len L]

`setup` writes OUT_DIR/flux/: random encoders at realistic widths in diffusers' FLUX.1 layout
(FLUX.1's VAE: channels 128/256/512/512, two ResNets per block, 16 latent channels; CLIP-L's
text transformer: width 768, 12 layers; a T5 v1.1 encoder at base width: 768, 12 blocks, 12
heads, d_ff 2048), with the tiny tokenizers of tests/fixtures/make_text_fixtures.py, and
OUT_DIR/images/: N seeded noise PNGs of SIZE × SIZE with `.txt` captions.

`run` encodes every image as `flux-hpc data encode` does, with diffusers and transformers: PIL
bicubic resize to cover SIZE × SIZE and a center crop, the VAE's posterior (mean, log-variance),
CLIP's pooled vector and T5's states for the caption, in batches, and prints one JSON line with
images/s (wall time including model loading, as the flux-hpc side).
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch


def setup(args):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    out = Path(args.out)
    fixtures = out / "fixtures"
    subprocess.run([sys.executable, "tests/fixtures/make_text_fixtures.py", str(fixtures)],
                   check=True)
    flux = out / "flux"
    flux.mkdir(parents=True, exist_ok=True)
    for name, source in (("tokenizer", "clip_files"), ("tokenizer_2", "t5")):
        link = flux / name
        if not link.exists():
            link.symlink_to((fixtures / source).resolve())
    torch.manual_seed(0)
    AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, norm_num_groups=32,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
    ).save_pretrained(flux / "vae")
    vocab = len(json.loads((fixtures / "clip_files" / "vocab.json").read_text()))
    CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, eos_token_id=2,
    )).save_pretrained(flux / "text_encoder")
    from transformers import AutoTokenizer
    t5_vocab = len(AutoTokenizer.from_pretrained(fixtures / "t5"))
    T5EncoderModel(T5Config(
        vocab_size=t5_vocab, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False,
    )).save_pretrained(flux / "text_encoder_2")
    images = out / "images"
    images.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    from PIL import Image
    for i in range(args.images):
        pixels = (rng.uniform(size=(args.size, args.size, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(images / f"{i:04d}.png")
        (images / f"{i:04d}.txt").write_text(f"a photograph number {i} of a quiet street")


def run(args):
    start = time.perf_counter()
    from diffusers import AutoencoderKL
    from PIL import Image
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    flux = Path(args.flux)
    device = torch.device(args.device)
    t5_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    vae = AutoencoderKL.from_pretrained(flux / "vae").eval().to(device)
    clip_tok = AutoTokenizer.from_pretrained(flux / "tokenizer")
    clip = CLIPTextModel.from_pretrained(flux / "text_encoder").eval().to(device)
    t5_tok = AutoTokenizer.from_pretrained(flux / "tokenizer_2")
    t5 = T5EncoderModel.from_pretrained(flux / "text_encoder_2", torch_dtype=t5_dtype)
    t5 = t5.eval().to(device)
    paths = sorted(Path(args.images).glob("*.png"))
    size = args.size

    def load(path):
        image = Image.open(path).convert("RGB")
        w, h = image.size
        scale = max(size / w, size / h)
        sw, sh = max(round(w * scale), size), max(round(h * scale), size)
        image = image.resize((sw, sh), Image.BICUBIC)
        x, y = (sw - size) // 2, (sh - size) // 2
        image = image.crop((x, y, x + size, y + size))
        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float() / 127.5 - 1

    with torch.no_grad():
        for i in range(0, len(paths), args.batch):
            batch = paths[i:i + args.batch]
            images = torch.stack([load(p) for p in batch]).to(device)
            captions = [p.with_suffix(".txt").read_text().strip() for p in batch]
            posterior = vae.encode(images).latent_dist
            _ = posterior.mean, posterior.logvar
            ids = clip_tok(captions, padding="max_length", max_length=77, truncation=True,
                           return_tensors="pt").input_ids.to(device)
            _ = clip(ids).pooler_output
            ids = t5_tok(captions, padding="max_length", max_length=args.text_len,
                         truncation=True, return_tensors="pt").input_ids.to(device)
            _ = t5(ids).last_hidden_state
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"impl": "pytorch", "images": len(paths), "seconds": seconds,
                      "images_per_s": len(paths) / seconds, "threads": torch.get_num_threads()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("setup")
    s.add_argument("out")
    s.add_argument("--images", type=int, default=16)
    s.add_argument("--size", type=int, default=512)
    r = sub.add_parser("run")
    r.add_argument("images")
    r.add_argument("flux")
    r.add_argument("--batch", type=int, default=4)
    r.add_argument("--size", type=int, default=512)
    r.add_argument("--text-len", type=int, default=512)
    r.add_argument("--device", default="cpu", help="cpu or cuda (T5 in bf16 there)")
    args = ap.parse_args()
    setup(args) if args.what == "setup" else run(args)


if __name__ == "__main__":
    main()
