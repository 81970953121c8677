#!/usr/bin/env python3
"""inference_embedded.py with the command line of Graphcore's application (same as `cnns infer`).

`python inference_embedded.py --help` lists the options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # run from a checkout without installing

from cnns.cli import run_script  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_script("infer"))
