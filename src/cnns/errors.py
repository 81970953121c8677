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


class WriteError(CnnsError):
    """A file that could not be written whole (a full disk, a quota, an I/O error, a vanished folder); what
    the file held before is unchanged (`cnns.runfolder.files`)."""

    def __init__(self, path, cause: OSError):
        self.path, self.cause = path, cause
        super().__init__(f"cannot write {path}: {reason(cause)}")

    def __reduce__(self):  # rebuilt from its own arguments when a worker process sends it back
        return type(self), (self.path, self.cause)


def first_line(error: BaseException, limit: int = 300) -> str:
    """An exception as one line of an error message: its message's first line, cut at `limit` characters, or
    its type's name when it has no message (a library's error can span pages)."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def reason(cause: OSError) -> str:
    """An OSError in the words the system uses ("No space left on device"), without its errno prefix."""
    return cause.strerror or str(cause) or type(cause).__name__


# How to go on if a signal ends the command from here (SPEC §8: say how to continue), as the code running says it
# (`continue_with`); the command line adds it to the signal's one line (`cnns.cli.endings`).
CONTINUE_WITH: list[str] = []


def continue_with(line: str) -> None:
    """From now on a signal that ends the command says `line` after its own (the last call wins)."""
    CONTINUE_WITH[:] = [line]
