"""An input's cost is bounded before it is paid (issue 72, kind 2): every decoder path decodes an animated image's
first frame only, whatever its frame count, and every loop that retries has an end."""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from cnns.errors import ConfigError

SRC = Path(__file__).resolve().parents[1] / "src" / "cnns"


def animated(kind: str, canvas: int, frames: int) -> bytes:
    """A GIF or an animated WebP of `frames` frames on a `canvas` x `canvas` canvas, each frame a different pixel
    lit: a few kilobytes whatever the canvas."""
    buffer = io.BytesIO()
    if kind == "GIF":
        images = [Image.new("P", (canvas, canvas), 0) for _ in range(frames)]
        for i, image in enumerate(images):
            image.putpalette([0, 0, 0, 250, 40 + 8 * i, 9] + [0] * 762)
            image.putpixel((i, i), 1)
    else:
        images = [Image.new("RGB", (canvas, canvas), (0, 0, 0)) for _ in range(frames)]
        for i, image in enumerate(images):
            image.putpixel((i, i), (250, 40 + 8 * i, 9))
    images[0].save(buffer, kind, save_all=True, append_images=images[1:], duration=40, loop=0,
                   **({"lossless": True} if kind == "WEBP" else {"disposal": 1}))
    return buffer.getvalue()


def first_frame_png(data: bytes) -> bytes:
    """The first frame as PIL composes it, as a still PNG (the reference every decoder path must equal)."""
    buffer = io.BytesIO()
    with Image.open(io.BytesIO(data)) as image:
        image.convert("RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _decoder_paths():
    """Every path an image file's bytes take to pixels (the whole-image decoder under each): predict's preprocessing,
    the training and evaluation loaders' transform, and the folder dataset's default decode."""
    from cnns.commands.predict import evaluation_transform
    from cnns.data.image_loader import ImageNetTransform
    from cnns.data.imagefolder import _default_decode
    from types import SimpleNamespace

    imagenet = SimpleNamespace(model=SimpleNamespace(image_size=48), data=SimpleNamespace(
        dataset="imagenet", image_size=48, eval_crop_pct=0.875, eval_interpolation="bilinear"))
    return {
        "predict": lambda data: evaluation_transform(imagenet)(data, "x"),
        "training loader": lambda data: ImageNetTransform(True, 48, seed=3)(data, "x", (5, 1)),
        "evaluation loader": lambda data: ImageNetTransform(False, 48)(data, "x"),
        "folder dataset": lambda data: _default_decode(data, "x"),
    }


@pytest.mark.parametrize("kind", ["GIF", "WEBP"])
@pytest.mark.parametrize("path", sorted(_decoder_paths()))
def test_every_decoder_path_gives_an_animations_first_frame(kind, path):
    data = animated(kind, 64, 5)
    decode = _decoder_paths()[path]
    assert torch.equal(decode(data), decode(first_frame_png(data)))


MEASURE = """
import json, resource, sys
sys.path[:0] = {paths!r}
from cnns.data.imagefolder import decode_rgb
peaks = {{}}
for kind in ("GIF", "WEBP"):
    for frames in (2, 24):
        data = open(f"{{sys.argv[1]}}/{{kind}}{{frames}}", "rb").read()
        image = decode_rgb(data, kind)
        assert tuple(image.shape) == (3, 2000, 2000)
        del image
        peaks[f"{{kind}}{{frames}}"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(peaks))
"""


def test_an_animations_memory_does_not_grow_with_its_frames(tmp_path):
    """24 frames of a 2000 x 2000 canvas cost what 2 do (one canvas: 12 MB of RGB); decoded whole they would take
    22 canvases more, 264 MB past the 2-frame peak. Measured as the process's peak resident memory (in a process of
    its own, which decodes the 2-frame file first, so only growth with the frames raises the peak)."""
    for kind in ("GIF", "WEBP"):
        for frames in (2, 24):
            (tmp_path / f"{kind}{frames}").write_bytes(animated(kind, 2000, frames))
    script = MEASURE.format(paths=[str(SRC.parent)])
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    peaks = json.loads(done.stdout)
    canvas = 2000 * 2000 * 3
    for kind in ("GIF", "WEBP"):
        assert peaks[f"{kind}24"] - peaks[f"{kind}2"] < 4 * canvas, peaks  # 22 more canvases would be 22 * canvas


# ----------------------------------------------------------------------------------------------
# Every retry loop has an end


def test_a_log_dir_whose_run_names_are_all_taken_ends_in_one_line(tmp_path):
    from cnns.runfolder.log import RUN_SUFFIX_ALPHABET, new_run_folder
    import itertools

    names = ["".join(letters) for letters in itertools.product(RUN_SUFFIX_ALPHABET, repeat=3)]
    for suffix in names[:-1]:
        (tmp_path / f"RN8_{suffix}").mkdir()
    assert new_run_folder(tmp_path, "RN8") == tmp_path / f"RN8_{names[-1]}"  # the last free name is found
    with pytest.raises(ConfigError, match="all 46,656 run folders RN8_XXX exist in .*--name-suffix"):
        new_run_folder(tmp_path, "RN8")
    assert len(list(tmp_path.iterdir())) == 46_656


# Every loop of the package that could run for ever (`while True`, `for ... in itertools.count()`), by module and
# function, with what ends it. A new one fails this test until its end is written here.
ENDLESS_LOOPS_AND_THEIR_ENDS = {
    ("cnns/data/tfrecord_reader.py", "_read_varint"): "the buffer's end, or ten bytes",
    ("cnns/data/tfrecord_reader.py", "_varint"): "the value shifts to 0 in at most ten bytes",
    ("cnns/data/image_loader.py", "_batches"): "the loader's StopIteration",
    ("cnns/runfolder/lock.py", "_holder"): "a monotonic deadline (_HOLDER_WAIT_S)",
    ("cnns/bench/baseline.py", "make_batches"): "a generator: the benchmark takes as many batches as it times",
    ("cnns/bench/data.py", "endless"): "a generator: time_pipeline takes the batches it times",
    ("cnns/engine/loop.py", "micro_batch_stream"): "a generator: the loop takes the run's length of micro-batches",
}


def _endless_loops() -> set[tuple[str, str]]:
    """(module, innermost function) of every loop with no end of its own."""
    found = set()

    def visit(node: ast.AST, module: str, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        endless = (isinstance(node, ast.While) and isinstance(node.test, ast.Constant) and node.test.value) or (
            isinstance(node, ast.For) and isinstance(node.iter, ast.Call)
            and getattr(node.iter.func, "attr", getattr(node.iter.func, "id", "")) in ("count", "cycle", "repeat"))
        if endless:
            found.add((module, function))
        for child in ast.iter_child_nodes(node):
            visit(child, module, function)

    for path in sorted(SRC.rglob("*.py")):
        visit(ast.parse(path.read_text(), str(path)), str(path.relative_to(SRC.parent)), "<module>")
    return found


def test_every_loop_that_could_run_for_ever_has_its_end_named():
    assert _endless_loops() == set(ENDLESS_LOOPS_AND_THEIR_ENDS)
