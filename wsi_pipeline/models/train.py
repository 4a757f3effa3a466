"""Train the demo detector on synthetic scenes and export it to ONNX with its card.

    python -m wsi_pipeline.models.train --kind pathology --out engines/ --force
    python -m wsi_pipeline.models.train --kind industrial --out engines/ --force

Seeded end to end (torch, numpy and the scene seeds), two CPU threads; the
committed ``engines/*.onnx`` files are what these commands write. Without
``--out`` the model goes to ``trained_models/``; an existing model or card
is replaced only with ``--force``. Training
scenes use seeds from ``TRAIN_SEEDS``; evaluation uses ``EVAL_SEEDS`` only.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..inference.card import card_path_for
from . import DEFAULT_TRAIN_OUT
from .data import (
    SCENE_SAMPLING,
    TRAIN_SEEDS,
    TileSample,
    augment,
    center_targets,
    region_targets,
    render_tiles,
)
from .net import IMAGENET_MEAN_RGB, IMAGENET_STD_RGB, OBJECT_STRIDE, REGION_STRIDE, CenterNetSmall


@dataclass(frozen=True)
class Preset:
    """What differs between the pathology and the industrial model."""

    name: str
    class_colors: tuple[str, ...]
    region_classes: tuple[str, ...]
    region_labels: tuple[tuple[int, ...], ...]  # scene region labels that make up each channel
    mpp: float | None
    top_k: int
    score_threshold: float = 0.3
    nms_iou: float | None = None  # class-aware NMS in the decoder (long objects raise several peaks)
    widths: tuple[int, int, int, int] = (16, 32, 64, 96)
    train_scenes: int = 120
    tiles_per_scene: int = 4
    steps: int = 4000
    batch: int = 12
    crop_px: int = 256
    lr: float = 3e-3
    # What the model was trained on and where it stops working (the card's "scope"; see
    # benchmarks/bench_object_size.py for the measurement).
    scope: dict = field(default_factory=dict)


PRESETS = {
    "pathology": Preset(
        name="nuclei_pathology",
        class_colors=("#7b2cbf",),
        region_classes=("tissue", "tumour"),
        region_labels=((1, 2), (2,)),
        mpp=0.25,
        top_k=512,
        steps=3000,
        scope={
            "trained_on": (
                "synthetic H&E-like scenes only (wsi_pipeline/synthetic/scene.py, seeds 1000-1119) "
                "at 0.25 um/px: nuclei 8-20 px across, denser and darker in tumour regions; no real slide"
            ),
            "works_for": (
                "nuclei 8-20 px across at 0.25 um/px in scenes like those: recall 0.96-1.00 at IoU 0.5; "
                "20-26 px: 0.54-0.96, lower the more the scene is enlarged"
            ),
            "stops_working": (
                "objects larger than about 26 px across: recall 0.28-0.41 at 26-32 px and 0.01 at 32-40 "
                "px, where it splits 81-100% of them into two or more detections. Real nuclei at 0.25 "
                "um/px are often 20-40 px across: expect missed and split nuclei on real slides. The "
                "tissue/tumour heatmap has seen only the synthetic stain and textures"
            ),
            "measured_with": (
                "python benchmarks/bench_object_size.py --kind pathology (held-out scenes rendered at "
                "0.25, 0.167 and 0.125 um/px)"
            ),
        },
    ),
    # Industrial scenes have no regions (one "surface" everywhere): no region head.
    # Defects are sparse, so most training tiles are placed on one.
    "industrial": Preset(
        name="defects_industrial",
        class_colors=("#e6a000", "#00aae6"),
        region_classes=(),
        region_labels=(),
        mpp=None,
        top_k=64,
        train_scenes=80,
        tiles_per_scene=6,
        nms_iou=0.3,
        scope={
            "trained_on": (
                "synthetic brushed-metal images only (seeds 1000-1079), no pixel size: spots (dark or "
                "bright discs 6-40 px across) and scratches (1-3 px wide, 30-200 px long)"
            ),
            "works_for": (
                "spots 6-40 px across: precision and recall 0.99; scratches: precision 0.91, recall 0.84 "
                "(IoU 0.5, held-out synthetic images)"
            ),
            "stops_working": (
                "faint or short scratches are missed, and a scratch box 1-2 px off across a thin scratch "
                "falls under IoU 0.5; larger defects, other surfaces, textures and lighting were never "
                "seen (not measured)"
            ),
            "measured_with": (
                "python -m wsi_pipeline.models.evaluate engines/defects_industrial.card.json --kind "
                "industrial; python benchmarks/bench_object_size.py --kind industrial"
            ),
        },
    ),
}


def focal_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CornerNet/CenterNet penalty-reduced focal loss, normalised by the number of centres."""
    p = torch.sigmoid(logits).clamp(1e-4, 1 - 1e-4)
    pos = target.eq(1).float()
    neg_weight = (1 - target).pow(4)
    pos_loss = torch.log(p) * (1 - p).pow(2) * pos
    neg_loss = torch.log(1 - p) * p.pow(2) * neg_weight * (1 - pos)
    return -(pos_loss.sum() + neg_loss.sum()) / pos.sum().clamp(min=1)


def dice_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    inter = (p * target).sum(dim=(0, 2, 3))
    denom = p.sum(dim=(0, 2, 3)) + target.sum(dim=(0, 2, 3))
    return (1 - (2 * inter + 1) / (denom + 1)).mean()


def make_batch(samples: list[TileSample], rng: np.random.Generator, preset: Preset, num_classes: int):
    """Augmented crops and their targets as torch tensors (image already normalised NCHW float)."""
    images, heats, sizes, offsets, masks, regions = [], [], [], [], [], []
    for idx in rng.integers(0, len(samples), preset.batch):
        s = augment(samples[int(idx)], rng, preset.crop_px, REGION_STRIDE)
        h, sz, off, m = center_targets(s.boxes, s.labels, num_classes, preset.crop_px, OBJECT_STRIDE)
        images.append(s.image)
        heats.append(h)
        sizes.append(sz)
        offsets.append(off)
        masks.append(m)
        if preset.region_labels:
            regions.append(region_targets(s.regions, preset.region_labels))
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    mean = torch.tensor(IMAGENET_MEAN_RGB).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD_RGB).view(1, 3, 1, 1)
    as_t = lambda a: torch.from_numpy(np.stack(a))  # noqa: E731
    return ((x - mean) / std, as_t(heats), as_t(sizes), as_t(offsets), as_t(masks), as_t(regions) if regions else None)


def batch_losses(
    net: torch.nn.Module,
    x: torch.Tensor,
    heat: torch.Tensor,
    size: torch.Tensor,
    offset: torch.Tensor,
    mask: torch.Tensor,
    regions: torch.Tensor | None,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch's losses (:func:`make_batch`'s targets): centre heatmap (focal), box size (L1 of
    the log, px), centre offset (L1) at the objects' centres, and regions (BCE + Dice; zero without)."""
    center_logits, size_px, off_pred, region_logits = net(x)
    n_pos = mask.sum().clamp(min=1)
    m = mask.unsqueeze(1)
    l_heat = focal_loss(center_logits, heat)
    l_size = (torch.abs(torch.log(size_px) - torch.log(size.clamp(min=1))) * m).sum() / n_pos
    l_off = (torch.abs(off_pred - offset) * m).sum() / n_pos
    l_reg = (
        F.binary_cross_entropy_with_logits(region_logits, regions) + dice_loss(region_logits, regions)
        if regions is not None
        else torch.zeros((), device=device)
    )
    return l_heat, l_size, l_off, l_reg


def warmup_cosine(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate over ``steps``: a linear warm-up over the first 5 %, then a cosine down to 2 %."""
    warmup = max(steps // 20, 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1))) * 0.98 + 0.02

    return torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def fit(
    net: torch.nn.Module,
    samples: list[TileSample],
    rng: np.random.Generator,
    preset: Preset,
    num_classes: int,
    steps: int,
    device: str = "cpu",
    log=print,
) -> None:
    """Train ``net`` for ``steps`` batches of ``samples`` (AdamW, :func:`warmup_cosine`), logging the
    mean losses every 100 steps."""
    opt = torch.optim.AdamW(net.parameters(), lr=preset.lr, weight_decay=1e-4)
    sched = warmup_cosine(opt, steps)
    net.train()
    t1 = time.perf_counter()
    running = np.zeros(4)
    for step in range(steps):
        batch = [None if t is None else t.to(device) for t in make_batch(samples, rng, preset, num_classes)]
        l_heat, l_size, l_off, l_reg = batch_losses(net, *batch, device=device)
        loss = l_heat + l_size + l_off + l_reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running += [l_heat.item(), l_size.item(), l_off.item(), l_reg.item()]
        if (step + 1) % 100 == 0 or step + 1 == steps:
            r = running / 100
            running[:] = 0
            log(
                f"step {step + 1}/{steps} heat {r[0]:.3f} size {r[1]:.3f} off {r[2]:.3f} "
                f"region {r[3]:.3f} lr {sched.get_last_lr()[0]:.5f} {time.perf_counter() - t1:.0f} s"
            )


def refuse_to_replace(kind: str, out_dir: Path, force: bool) -> None:
    """UsageError when ``out_dir`` already holds the ``kind`` model or its card and not ``force``."""
    model_path = Path(out_dir) / f"{PRESETS[kind].name}.onnx"
    existing = [str(p) for p in (model_path, card_path_for(model_path)) if p.exists()]
    if existing and not force:
        raise UsageError(
            f"{' and '.join(existing)} already exist; training would replace them: "
            "choose another --out, or pass --force (force=True) to replace them"
        )


def train(
    kind: str,
    out_dir: Path = DEFAULT_TRAIN_OUT,
    *,
    steps: int | None = None,
    train_scenes: int | None = None,
    seed: int = 0,
    threads: int = 2,
    device: str = "cpu",
    widths: tuple[int, ...] | None = None,
    force: bool = False,
    log=print,
) -> Path:
    """Train the ``kind`` preset, export ``out_dir/NAME.onnx`` + card; return the ONNX path.

    Refuses (UsageError, before training) to replace an existing model or card unless ``force``.
    """
    from ..synthetic import SyntheticScene
    from .export import export_with_card

    out_dir = Path(out_dir)
    refuse_to_replace(kind, out_dir, force)
    preset = PRESETS[kind]
    steps = steps or preset.steps
    n_scenes = train_scenes or preset.train_scenes
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    class_names = list(SyntheticScene(512, 512, 0, kind=kind).class_names)
    t0 = time.perf_counter()
    seeds = list(TRAIN_SEEDS)[:n_scenes]
    samples = render_tiles(kind, seeds, preset.tiles_per_scene, region_stride=REGION_STRIDE, **SCENE_SAMPLING[kind])
    log(f"rendered {len(samples)} tiles from {len(seeds)} scenes in {time.perf_counter() - t0:.0f} s")

    net = CenterNetSmall(len(class_names), len(preset.region_classes), widths or preset.widths).to(device)
    fit(net, samples, rng, preset, len(class_names), steps, device, log)
    net.eval().cpu()
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / f"{preset.name}.onnx"
    training = {
        "kind": kind,
        "seed": seed,
        "steps": steps,
        "train_scene_seeds": [seeds[0], seeds[-1]],
        "tiles": len(samples),
        "crop_px": preset.crop_px,
        "batch": preset.batch,
        "command": f"python -m wsi_pipeline.models.train --kind {kind}",
    }
    export_with_card(
        net,
        model_path,
        name=preset.name,
        version="1.0.0",
        class_names=class_names,
        class_colors=preset.class_colors,
        region_classes=preset.region_classes,
        top_k=preset.top_k,
        mpp=preset.mpp,
        score_threshold=preset.score_threshold,
        nms_iou=preset.nms_iou,
        extra={"training": training, "scope": preset.scope},
    )
    log(f"wrote {model_path} ({model_path.stat().st_size / 1e6:.2f} MB) in {time.perf_counter() - t0:.0f} s total")
    return model_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wsi_pipeline.models.train", description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", type=Path, default=DEFAULT_TRAIN_OUT, help="output folder (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace a model and card already in --out")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps (default: the preset's)")
    parser.add_argument("--train-scenes", type=int, default=None, help="training scenes (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of torch and numpy (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device (the shipped models are trained on cpu)")
    parser.add_argument("--widths", default=None, help="trunk channel widths, e.g. 16,32,64,96")
    args = parser.parse_args(argv)
    train(
        args.kind,
        args.out,
        steps=args.steps,
        train_scenes=args.train_scenes,
        seed=args.seed,
        threads=args.threads,
        device=args.device,
        force=args.force,
        widths=tuple(int(v) for v in args.widths.split(",")) if args.widths else None,
        log=lambda msg: print(msg, flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
