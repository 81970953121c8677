"""The one exception type that the command line turns into a single clear line and a non-zero exit."""


class CnnsError(Exception):
    """A problem with the user's input: options, data files, checkpoints, configurations.

    The command-line entry points catch it and print ``error: <message>`` with exit code 2, never a
    traceback. Raise it with a message that names the thing that is wrong (a file, an option, a value).
    """


class DataError(CnnsError):
    """Missing, truncated or malformed data files."""


class CheckpointError(CnnsError):
    """A checkpoint that cannot be read: missing, truncated, foreign."""


class ConfigError(CnnsError):
    """Unknown or contradictory options and configurations."""
