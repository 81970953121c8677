import sys
from pathlib import Path

# Tests run against the checkout's sources whether or not the package is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import os

# pytest-xdist runs two workers on two cores: one torch thread each, and for the scripts the tests
# launch (they inherit the environment), avoids oversubscription, which makes small convolutions ~100x
# slower. Set for every test here, so no test module repeats it.
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)
