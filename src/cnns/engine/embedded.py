"""inference_embedded.py: ahead-of-time compiled inference (not built yet)."""

from cnns.errors import ConfigError


def infer_command(argv: list[str]) -> int:
    raise ConfigError("inference_embedded.py (ahead-of-time compiled inference) is not supported yet")
