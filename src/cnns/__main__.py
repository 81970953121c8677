"""`python -m cnns <command>`."""
import sys

from cnns.cli import main

sys.exit(main())
