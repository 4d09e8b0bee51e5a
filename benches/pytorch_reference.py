#!/usr/bin/env python3
"""The PyTorch-eager side of benches/side_by_side.sh: the same work as `flux-hpc bench`, printed
as the same JSON line.

    .venv/bin/python benches/pytorch_reference.py step CONFIG [--threads N] [--steps K] [--warmup W]
        [--lora-rank R]
    .venv/bin/torchrun --nproc-per-node 2 benches/pytorch_reference.py step CONFIG \
        [--sharding none|optimizer|gradients|full] ...
    .venv/bin/python benches/pytorch_reference.py forward CONFIG [...]
    .venv/bin/python benches/pytorch_reference.py read SHARD.h5 [...]

`step` is one training step as a PyTorch user would write it with diffusers'
FluxTransformer2DModel built from the run config's [model] table: fresh random latents, noise,
text and pooled vectors, logit-normal noise levels, the flow-matching target, MSE loss, backward,
gradient clipping and torch.optim.AdamW (its default implementation); with `--lora-rank R`, the
base frozen and PEFT LoRA adapters of rank R (α = R) on every nn.Linear, as diffusers' LoRA
training scripts set them up (`requires_grad_(False)`, `add_adapter`). Under torchrun the ranks
split the global batch over gloo as flux-hpc's `[parallelism] sharding` levels do: `none`,
DistributedDataParallel replicas; `optimizer`, DDP with AdamW wrapped in ZeroRedundancyOptimizer
(each rank keeps the state of its share of the parameters: ZeRO-1); `gradients`, FSDP2's
`fully_shard` on every transformer block and the root with `reshard_after_forward=False` (the
weights stay gathered from forward to backward; gradients and optimizer state are sharded:
ZeRO-2); `full`, the same with `reshard_after_forward=True` (ZeRO-3). `forward` is one forward
pass under torch.no_grad() on a fixed micro-batch. `read` reads every sample of latent shards
with h5py, decoding bf16/f16 to float32 as flux-hpc's reader does.
"""
import argparse
import json
import os
import resource
import statistics
import time
import tomllib

import torch


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def diffusers_model(m):
    """FluxTransformer2DModel with the shape of flux-hpc's [model] table (tokens packed p×p)."""
    from diffusers import FluxTransformer2DModel

    if m.get("mlp_ratio", 4.0) != 4.0 or m.get("model_channels", 256) != 256:
        raise SystemExit("diffusers' Flux fixes mlp_ratio = 4 and 256 timestep channels")
    p = m.get("patch_size", 1)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=m["in_channels"] * p * p,
        num_layers=m["num_joint_layers"],
        num_single_layers=m["num_single_layers"],
        attention_head_dim=m["hidden_size"] // m["num_attention_heads"],
        num_attention_heads=m["num_attention_heads"],
        joint_attention_dim=m["context_dim"],
        pooled_projection_dim=m["vec_in_dim"],
        guidance_embeds=m.get("guidance_embed", False),
        axes_dims_rope=tuple(m["axes_dim"]),
    )


def optimizer_state_mib(opt):
    """MiB of the optimizer state this rank holds (moments; ZeRO: its share only)."""
    inner = getattr(opt, "optim", opt)
    local = lambda v: v.to_local() if hasattr(v, "to_local") else v  # FSDP2's DTensors
    return sum(
        local(v).numel() * v.element_size()
        for state in inner.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.dim() > 0
    ) / 2**20


def model_state_mib(model, opt):
    """MiB of weights, gradients and optimizer state this rank holds (FSDP2: its shards)."""
    local = lambda v: v.to_local() if hasattr(v, "to_local") else v  # FSDP2's DTensors
    size = lambda t: local(t).numel() * t.element_size()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    return (sum(map(size, params)) + sum(map(size, grads))) / 2**20 + optimizer_state_mib(opt)


def timed(args):
    cfg = tomllib.loads(open(args.config).read())
    m, t, o = cfg["model"], cfg["training"], cfg.get("optimization", {})
    torch.manual_seed(t.get("seed", 0))
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.distributed.init_process_group("gloo")
    ranks = torch.distributed.get_world_size() if distributed else 1
    model = diffusers_model(m)
    p = m.get("patch_size", 1)
    rows, cols, text = t["latent_height"] // p, t["latent_width"] // p, t["text_len"]
    channels = m["in_channels"] * p * p
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(r), r, c], -1).reshape(rows * cols, 3).float()
    txt_ids = torch.zeros(text, 3)
    train = args.what == "step"
    samples = t["global_batch_size"] if train else t["micro_batch_size"]
    batch = samples // ranks
    guidance = (
        torch.full((batch,), float(m.get("guidance_scale", 3.5)))
        if m.get("guidance_embed", False)
        else None
    )

    def inputs(latents, sigma):
        return dict(
            hidden_states=latents,
            encoder_hidden_states=torch.randn(batch, text, m["context_dim"]),
            pooled_projections=torch.randn(batch, m["vec_in_dim"]),
            timestep=sigma,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )

    lora_rank = getattr(args, "lora_rank", None)
    if train and lora_rank:
        from peft import LoraConfig

        linears = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=linears))
    if train:
        model.train()
        trained = [p for p in model.parameters() if p.requires_grad]
        adamw = dict(
            lr=o.get("learning_rate", 1e-4),
            betas=(o.get("beta1", 0.9), o.get("beta2", 0.999)),
            eps=o.get("epsilon", 1e-8),
            weight_decay=o.get("weight_decay", 0.01),
        )
        sharding = getattr(args, "sharding", "none")
        if sharding in ("gradients", "full"):
            from torch.distributed.fsdp import fully_shard

            reshard = sharding == "full"
            for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
                fully_shard(block, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            trained = [p for p in model.parameters() if p.requires_grad]
            replica = model
        else:
            replica = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
        if sharding == "optimizer":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(trained, optimizer_class=torch.optim.AdamW, **adamw)
        else:
            opt = torch.optim.AdamW(trained, **adamw)
        clip = o.get("gradient_clip", 1.0)

        def work():
            x0 = torch.randn(batch, rows * cols, channels)
            noise = torch.randn_like(x0)
            sigma = torch.sigmoid(torch.randn(batch))
            s = sigma[:, None, None]
            pred = replica(**inputs((1 - s) * x0 + s * noise, sigma))[0]
            loss = torch.nn.functional.mse_loss(pred, noise - x0)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

    else:
        model.eval()
        fixed = inputs(torch.randn(batch, rows * cols, channels), torch.rand(batch))

        def work():
            with torch.no_grad():
                return model(**fixed)[0].sum().item()

    seconds = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        work()
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    if distributed and torch.distributed.get_rank() != 0:
        return
    print(
        json.dumps(
            {
                "impl": "pytorch",
                "what": args.what,
                "device": "Cpu",
                "precision": "fp32",
                "threads": torch.get_num_threads(),
                "ranks": ranks,
                "tp": 1,
                "samples": samples,
                "image_tokens": rows * cols,
                "text_tokens": text,
                "seconds": seconds,
                "median_s": median,
                "samples_per_s": samples / median,
                "peak_rss_mib": peak_rss_mib(),
                "lora_rank": lora_rank,
                "trained_params_per_rank": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "sharding": getattr(args, "sharding", "none"),
                # DDP always reduces its 25 MB buckets during backward, FSDP2 its blocks.
                "overlap_grad_reduce": distributed,
                "bucket_mib": 25.0,
                "optimizer_state_mib_per_rank": optimizer_state_mib(opt) if train else 0.0,
                "model_state_mib_per_rank": model_state_mib(model, opt) if train else 0.0,
            }
        )
    )


def read(args):
    import h5py
    import numpy as np

    def decode(raw):
        if raw.dtype == np.uint16:  # bfloat16 bits
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)

    files = [h5py.File(path, "r") for path in args.paths]
    columns = ["latents", "latents_logvar", "t5", "clip"]
    start = time.perf_counter()
    samples, stored, checksum = 0, 0, 0.0
    for f in files:
        present = [f[name] for name in columns if name in f]
        ids = f["ids"]
        for i in range(int(f.attrs["num_samples"])):
            values = [decode(ds[i]) for ds in present]
            _ = ids[i]
            checksum += float(values[0].flat[0])
            stored += sum(ds.dtype.itemsize * v.size for ds, v in zip(present, values))
            samples += 1
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "impl": "h5py",
                "what": "read",
                "samples": samples,
                "seconds": seconds,
                "samples_per_s": samples / seconds,
                "mib_per_s": stored / seconds / (1 << 20),
                "checksum": checksum,
            }
        )
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    for what in ("step", "forward"):
        s = sub.add_parser(what)
        s.add_argument("config")
        s.add_argument("--threads", type=int, default=None)
        s.add_argument("--steps", type=int, default=5)
        s.add_argument("--warmup", type=int, default=1)
        if what == "step":
            s.add_argument("--lora-rank", type=int, default=None)
            s.add_argument("--sharding", choices=["none", "optimizer", "gradients", "full"],
                           default="none",
                           help="under torchrun: DDP, DDP + ZeroRedundancyOptimizer (ZeRO-1), "
                                "FSDP2 keeping weights gathered (ZeRO-2) or resharding (ZeRO-3)")
    r = sub.add_parser("read")
    r.add_argument("paths", nargs="+")
    args = ap.parse_args()
    if args.what == "read":
        read(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    timed(args)


if __name__ == "__main__":
    main()
