import sys
from pathlib import Path

# Tests run against the checkout's sources whether or not the package is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
