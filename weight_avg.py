#!/usr/bin/env python3
"""The seed's weight_avg.py: `python weight_avg.py --help` lists the options (same as `cnns weight-avg`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # run from a checkout without installing

from cnns.cli import run_script  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_script("weight-avg"))
