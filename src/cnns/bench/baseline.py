"""The plain PyTorch loop that `cnns benchmark` compares against: what a user writes by hand.

A Dataset + DataLoader (2 worker processes on the CPU) + torchvision v2 transforms per image, the model (from
`cnns.models.build_model`: the same network as cnns's) in channels_last, bfloat16 autocast where the device
computes it (`autocast_dtype`), float32 weights and `torch.optim.SGD` with momentum. Data: ``synthetic`` (one
random batch made once on the device), ``generated`` (random uint8 images through a DataLoader with v2
ToDtype/Normalize) or ``cifar`` (the CIFAR-10 binary files, per-image RandomCrop(32, padding 4) + flip).
With ``compile`` the model is ``torch.compile(model)``d as a user writes it (the default mode; the optimiser
step eager), compiling in the first interval, which the runner drops.

Every ``log_freq`` iterations (every inference pass) it prints a line and, given a ``log_dir``, appends the
interval's ``img_per_sec`` to ``training.csv`` (``validation.csv``) there, as a cnns run folder has it, so the
runner reads both loops alike. Run as ``python -m cnns.bench.baseline '<json>'`` (`BaselineSpec`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cnns import profiling
from cnns.safe_writes import append

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class BaselineSpec:
    mode: str  # "train" | "infer"
    model: dict  # cnns.models.ModelSpec's fields: the network cnns builds
    batch_size: int  # the micro-batch
    data: str  # "synthetic" | "generated" | "cifar"
    iterations: int  # training iterations (weight updates), or batches per inference pass
    grad_accum: int = 1  # micro-batches summed into each update (training)
    log_freq: int = 1
    repeat: int = 1  # inference passes
    data_dir: str | None = None
    workers: int = 2
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-4
    device: str = "cpu"
    seed: int = 0
    profile_dir: str | None = None  # `cnns profile`: a profiler trace of the training loop goes there
    compile: bool = False  # torch.compile(model), default mode
    log_dir: str | None = None  # where training.csv / validation.csv get each interval's images/s

    @classmethod
    def from_json(cls, text: str) -> "BaselineSpec":
        return cls(**json.loads(text))

    def record(self, seconds: float, images: int) -> None:
        """One interval: a printed line, and a row of the log folder's file (the name a cnns run folder uses)."""
        rate = images / seconds
        print(f"plain loop: {images} images in {seconds:.6f} s, throughput: {rate:.2f} samples/sec", flush=True)
        if self.log_dir is None:
            return
        path = Path(self.log_dir) / ("training.csv" if self.mode == "train" else "validation.csv")
        rows = io.StringIO()  # the header (for a new file) and the row, appended whole or not at all
        writer = csv.writer(rows)
        if not path.exists():
            writer.writerow(["img_per_sec", "seconds", "images"])
        writer.writerow([rate, seconds, images])
        append(path, rows.getvalue())


def prepared_model(spec: BaselineSpec, device: torch.device, training: bool) -> torch.nn.Module:
    """The plain model on the device in channels_last, in training or eval mode, ``torch.compile``d when the
    spec says so."""
    from cnns.models import ModelSpec, build_model

    model = build_model(ModelSpec(**spec.model)).to(device, memory_format=torch.channels_last).train(training)
    print(f"Total Parameters:{sum(p.numel() for p in model.parameters())}", flush=True)
    if spec.compile:
        print("plain loop: torch.compile(model), default mode", flush=True)
        return torch.compile(model)
    return model


class Images(torch.utils.data.Dataset):
    """uint8 CHW images and their labels, each transformed on its own, as torchvision's datasets do."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform):
        self.images, self.labels, self.transform = images, labels, transform

    @classmethod
    def cifar_binary(cls, folder: str, transform) -> "Images":
        """The CIFAR-10 binary records (label byte + 3x32x32 planes)."""
        files = sorted(Path(folder).glob("data_batch_*.bin")) or sorted(Path(folder).glob("*/data_batch_*.bin"))
        if not files:
            raise FileNotFoundError(f"no data_batch_*.bin files in {folder}")
        records = np.concatenate([np.fromfile(f, dtype=np.uint8).reshape(-1, 3073) for f in files])
        return cls(torch.from_numpy(records[:, 1:].reshape(-1, 3, 32, 32).copy()),
                   torch.from_numpy(records[:, 0].astype(np.int64)), transform)

    @classmethod
    def random(cls, count: int, image_size: int, num_classes: int, transform, seed: int) -> "Images":
        """A pool of random images (the generated-data case)."""
        generator = torch.Generator().manual_seed(seed)
        images = torch.randint(0, 256, (count, 3, image_size, image_size), dtype=torch.uint8, generator=generator)
        return cls(images, torch.randint(0, num_classes, (count,), generator=generator), transform)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        from torchvision import tv_tensors

        return self.transform(tv_tensors.Image(self.images[index])), self.labels[index]


def make_batches(spec: BaselineSpec, device: torch.device, train: bool):
    """An endless iterator of (float images, labels) on the device."""
    from torchvision.transforms import v2

    size, classes = spec.model["image_size"], spec.model["num_classes"]
    if spec.data == "synthetic":
        generator = torch.Generator().manual_seed(spec.seed)
        images = torch.randn(spec.batch_size, 3, size, size, generator=generator)
        labels = torch.randint(0, classes, (spec.batch_size,), generator=generator)
        batch = images.to(device).contiguous(memory_format=torch.channels_last), labels.to(device)
        while True:
            yield batch
    if spec.data == "cifar":
        steps = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if train else []
        transform = v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR_MEAN, CIFAR_STD)])
        dataset = Images.cifar_binary(spec.data_dir, transform)
    else:
        transform = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        dataset = Images.random(max(4 * spec.batch_size, 64), size, classes, transform, spec.seed)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=spec.batch_size, shuffle=train, drop_last=True, num_workers=spec.workers,
        persistent_workers=spec.workers > 0, pin_memory=device.type == "cuda")
    while True:
        for images, labels in loader:
            yield (images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last),
                   labels.to(device, non_blocking=True))


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """bfloat16 on a CPU or GPU that computes it; float16 on a GPU without bfloat16 arithmetic (Volta,
    Turing: the GradScaler comes with it); None (float32) on a CPU that would emulate bfloat16.

    A CPU without bfloat16 arithmetic emulates bfloat16 autocast many times slower than float32: nobody writing
    the plain loop by hand would keep it there, and cnns runs float32 on such a CPU too. On an Ampere or
    later GPU bfloat16 needs no loss scaling (no GradScaler, whose step reads its inf check on the host
    every update), as a hand-written reference loop runs it, and cnns's 16.x computes bfloat16 there too.
    """
    from cnns.precision import cpu_half_is_emulated, gpu_computes_bfloat16

    if device.type == "cuda":
        return torch.bfloat16 if gpu_computes_bfloat16(device) else torch.float16
    return None if cpu_half_is_emulated(device, torch.bfloat16) else torch.bfloat16


def train(spec: BaselineSpec) -> None:
    device = torch.device(spec.device)
    torch.manual_seed(spec.seed)
    model = prepared_model(spec, device, training=True)
    optimiser = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum,
                                weight_decay=spec.weight_decay)
    half = autocast_dtype(device)
    scaler = torch.amp.GradScaler(device.type, enabled=half == torch.float16 and device.type == "cuda")
    batches = make_batches(spec, device, train=True)
    interval_start = time.perf_counter()
    with profiled(spec.profile_dir, device):
        for iteration in range(1, spec.iterations + 1):
            with profiling.marked(profiling.UPDATE):
                optimiser.zero_grad(set_to_none=True)
                for _ in range(spec.grad_accum):  # the usual accumulation: float32 .grad sums the micro-batches
                    with profiling.marked(profiling.DATA):
                        images, labels = next(batches)
                    with torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None):
                        loss = F.cross_entropy(model(images), labels) / spec.grad_accum
                    scaler.scale(loss).backward()
                with profiling.marked(profiling.OPTIMISER):
                    scaler.step(optimiser)
                    scaler.update()
            if iteration % spec.log_freq == 0 or iteration == spec.iterations:
                loss.item()  # the host synchronisation, once per logging interval
                done = spec.log_freq if iteration % spec.log_freq == 0 else iteration % spec.log_freq
                spec.record(time.perf_counter() - interval_start, done * spec.batch_size * spec.grad_accum)
                interval_start = time.perf_counter()


def profiled(folder: str | None, device: torch.device):
    """A profiler writing a trace into ``folder`` as train.py's --profile does (the GPU's kernels too when the
    loop runs on one), or nothing."""
    if folder is None:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, on_trace_ready=tensorboard_trace_handler(folder))


@torch.inference_mode()
def infer(spec: BaselineSpec) -> None:
    device = torch.device(spec.device)
    torch.manual_seed(spec.seed)
    model = prepared_model(spec, device, training=False)
    batches = make_batches(spec, device, train=False)
    half = autocast_dtype(device)
    for _ in range(spec.repeat):
        count, correct = 0, torch.zeros((), dtype=torch.int64, device=device)
        start = time.perf_counter()
        for _ in range(spec.iterations):
            images, labels = next(batches)
            with torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None):
                logits = model(images)
            correct += (logits.argmax(1) == labels).sum()
            count += labels.shape[0]
        correct.item()  # the host synchronisation, once per pass
        spec.record(time.perf_counter() - start, count)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = BaselineSpec.from_json(argv[0])
    (train if spec.mode == "train" else infer)(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
