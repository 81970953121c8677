"""cnns benchmark (not built yet)."""

from cnns.errors import ConfigError


def benchmark_command(argv: list[str]) -> int:
    raise ConfigError("cnns benchmark is not supported yet")
