"""cnns bench-data (not built yet)."""

from cnns.errors import ConfigError


def bench_data_command(argv: list[str]) -> int:
    raise ConfigError("cnns bench-data is not supported yet")
