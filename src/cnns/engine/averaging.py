"""weight_avg.py: average a run's checkpoints (not built yet)."""

from cnns.errors import ConfigError


def weight_avg_command(argv: list[str]) -> int:
    raise ConfigError("weight_avg.py is not supported yet")
