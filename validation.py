#!/usr/bin/env python3
"""The seed's validation.py: `python validation.py --help` lists the options (same as `cnns validate`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # run from a checkout without installing

from cnns.cli import run_script  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_script("validate"))
