"""The built-in dataset: ten classes of procedurally drawn shapes, 32x32 RGB, in CIFAR-10 format.

It lets every command run, and a short training run show real learning, with no download. Each
image is one shape (the class) at a random position and size, in a random foreground colour on a
random background colour, plus pixel noise: no single pixel or colour gives the class away, but a
small CNN learns it within a few epochs.

Generation is deterministic across machines, not only across runs: the random numbers come from
a seeded CPU generator (torch.rand, an exact integer-to-float mapping), and the drawing uses only
+, -, *, /, floor and comparisons, which IEEE arithmetic rounds identically whatever the SIMD
width. (No sin, sqrt or randn, whose vectorised kernels may differ in the last bit.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

from cnns.data.cifar_records import CIFAR10_FILES, IMAGE_SIZE, cifar10_file_contents, record_size
from cnns.safe_writes import write_atomically, write_once

BUILTIN_CLASSES = [
    "circle",
    "square",
    "triangle",
    "cross",
    "horizontal-stripes",
    "vertical-stripes",
    "ring",
    "diagonal",
    "checker",
    "dot-grid",
]

TRAIN_IMAGES = 5000
TEST_IMAGES = 1000
TRAIN_FILES = len(CIFAR10_FILES["train"])
TRAIN_SEED = 20240601
TEST_SEED = 20240602

# Difficulty: tuned so that a CIFAR ResNet-8 learns the classes in a short run yet does not
# solve them in the first epoch (noise and close colours keep the task from being trivial).
NOISE_AMPLITUDE = 0.35  # uniform pixel noise in [-a, a], on a 0..1 scale
DARK_MAX = 0.65  # dark colours in [0, DARK_MAX], light ones in [1 - DARK_MAX, 1]: they may be close
HALF_SIZE_RANGE = (4.0, 11.0)  # pixels from the shape's centre to the edge of its box


def ensure_builtin_dataset(folder: str | Path) -> Path:
    """Make sure `folder` holds the built-in dataset as CIFAR-10 binary files; return `folder`.

    Files already present with the right sizes are kept (generation is deterministic, so they can only be what we
    would write). A missing file is written once (`write_once`): several commands starting together each write
    it under a temporary name and the first to link it into place wins, the others keep its identical bytes, so
    none sees a partial file or is refused another's. A file of another size is replaced, as any write replaces
    a file: within a command only one that command made.
    """
    folder = Path(folder)
    sizes = {name: _size(folder / name) for name in _expected_sizes()}
    to_write = [name for name, expected in _expected_sizes().items() if sizes[name] != expected]
    if not to_write:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    contents = cifar10_file_contents(draw_shapes(TRAIN_IMAGES, TRAIN_SEED), draw_shapes(TEST_IMAGES, TEST_SEED),
                                     TRAIN_FILES)
    for name in to_write:
        if sizes[name] is None:  # missing when looked at: another command may have written it since
            write_once(folder / name, contents[name])
        else:
            write_atomically(folder / name, contents[name])
    return folder


def _size(path: Path) -> int | None:
    """The size of the regular file at `path`; -1 for anything else there (a link, a folder); None where nothing
    is."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else -1


def _expected_sizes() -> dict[str, int]:
    record = record_size("cifar-10")
    expected = {name: TRAIN_IMAGES // TRAIN_FILES * record for name in CIFAR10_FILES["train"]}
    expected[CIFAR10_FILES["test"][0]] = TEST_IMAGES * record
    return expected


def draw_shapes(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` images (uint8 [count, 32, 32, 3]) with balanced labels (int64 [count]) in shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.arange(count) % len(BUILTIN_CLASSES))[torch.randperm(count, generator=generator)]
    shapes = _random_shape_frames(count, generator)
    masks = torch.empty(count, IMAGE_SIZE, IMAGE_SIZE)
    # One vectorised drawing per class over all images of that class: ten steps, not one per image.
    for label, draw in enumerate(_DRAWERS):
        chosen = labels == label
        masks[chosen] = draw(shapes["dx"][chosen], shapes["dy"][chosen]).float()
    images = _paint(masks, count, generator)
    return images, labels


def _random_shape_frames(count: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Per image, every pixel's coordinates in the shape's own frame: (0, 0) at the shape's centre,
    +-1 at its half-size. Shapes are then just inequalities on (dx, dy)."""
    centre_x = _uniform(count, 9.0, 23.0, generator)
    centre_y = _uniform(count, 9.0, 23.0, generator)
    half_size = _uniform(count, *HALF_SIZE_RANGE, generator)
    pixel = torch.arange(IMAGE_SIZE, dtype=torch.float32) + 0.5  # pixel centres
    dx = (pixel.view(1, 1, -1) - centre_x.view(-1, 1, 1)) / half_size.view(-1, 1, 1)
    dy = (pixel.view(1, -1, 1) - centre_y.view(-1, 1, 1)) / half_size.view(-1, 1, 1)
    size = (count, IMAGE_SIZE, IMAGE_SIZE)
    return {"dx": dx.expand(size), "dy": dy.expand(size)}


def _paint(masks: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """Colour the masks: one of foreground and background dark, the other light (chosen at random),
    from overlapping ranges so that contrast varies from stark to faint, then add noise."""
    light_background = (torch.rand(count, 1, generator=generator) < 0.5).float()
    background = _uniform((count, 3), 0.0, DARK_MAX, generator) + (1.0 - DARK_MAX) * light_background
    foreground = _uniform((count, 3), 0.0, DARK_MAX, generator) + (1.0 - DARK_MAX) * (1.0 - light_background)
    mask = masks.unsqueeze(-1)  # [N, H, W, 1]
    colour = background.view(count, 1, 1, 3) * (1.0 - mask) + foreground.view(count, 1, 1, 3) * mask
    noise = _uniform((count, IMAGE_SIZE, IMAGE_SIZE, 3), -NOISE_AMPLITUDE, NOISE_AMPLITUDE, generator)
    return ((colour + noise).clamp(0.0, 1.0) * 255.0 + 0.5).floor().to(torch.uint8)


def _uniform(size, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(size, generator=generator)


# Shape masks in the shape's frame (see _random_shape_frames), as boolean [n, H, W].


def _inside_box(dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return (dx.abs() <= 1.0) & (dy.abs() <= 1.0)


def _circle(dx, dy):
    return dx * dx + dy * dy <= 1.0


def _square(dx, dy):
    return (dx.abs() <= 0.8) & (dy.abs() <= 0.8)


def _triangle(dx, dy):  # pointing up: apex at dy = -1, base at dy = 0.8
    return (dy <= 0.8) & (dx.abs() * 2.0 <= dy + 1.0)


def _cross(dx, dy):
    bar_x = (dx.abs() <= 1.0) & (dy.abs() <= 0.25)
    bar_y = (dy.abs() <= 1.0) & (dx.abs() <= 0.25)
    return bar_x | bar_y


def _horizontal_stripes(dx, dy):
    return _inside_box(dx, dy) & _is_even(dy * 2.5)


def _vertical_stripes(dx, dy):
    return _inside_box(dx, dy) & _is_even(dx * 2.5)


def _ring(dx, dy):
    distance_squared = dx * dx + dy * dy
    return (distance_squared <= 1.0) & (distance_squared >= 0.55 * 0.55)


def _diagonal(dx, dy):  # a bar from top-left to bottom-right
    return _inside_box(dx, dy) & ((dx - dy).abs() <= 0.35)


def _checker(dx, dy):
    return _inside_box(dx, dy) & _is_even(torch.floor(dx * 2.0) + torch.floor(dy * 2.0))


def _dot_grid(dx, dy):
    # Dots at the centres of a 4x4 grid of cells over the box, radius 0.3 of a cell.
    cell_x = dx * 2.0 - torch.floor(dx * 2.0) - 0.5
    cell_y = dy * 2.0 - torch.floor(dy * 2.0) - 0.5
    return _inside_box(dx, dy) & (cell_x * cell_x + cell_y * cell_y <= 0.3 * 0.3)


def _is_even(values: torch.Tensor) -> torch.Tensor:
    return torch.floor(values) % 2 == 0


_DRAWERS = [
    _circle,
    _square,
    _triangle,
    _cross,
    _horizontal_stripes,
    _vertical_stripes,
    _ring,
    _diagonal,
    _checker,
    _dot_grid,
]
assert len(_DRAWERS) == len(BUILTIN_CLASSES)
