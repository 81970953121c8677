"""A torch.profiler trace read back: the events of the newest Chrome-format trace a profiler wrote into a folder
(what `cnns profile` reads on both sides, for CPU operators and GPU kernels alike)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_trace(folder: Path) -> list[dict[str, Any]]:
    traces = sorted(Path(folder).glob("*.pt.trace.json"))
    if not traces:
        raise FileNotFoundError(f"no profiler trace in {folder}")
    return json.loads(traces[-1].read_text())["traceEvents"]
