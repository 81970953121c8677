"""The one exception type that the command line turns into a single clear line and a non-zero exit."""


class CnnsError(Exception):
    """A problem with the user's input: options, data files, checkpoints, configurations.

    The command-line entry points catch it and print ``error: <message>`` with exit code 2, never a
    traceback. Raise it with a message that names the thing that is wrong (a file, an option, a value).
    """

    def __reduce__(self):
        """Pickled as its class, its one line and its attributes, whatever its constructor takes (UnreadableFile's
        path and reason, WriteError's cause): an error sent from another process is the same error there."""
        return _rebuilt, (type(self), str(self), dict(self.__dict__))


def _rebuilt(kind: type, message: str, state: dict) -> CnnsError:
    error = kind.__new__(kind)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class HandedBack:
    """A CnnsError raised in a DataLoader worker, handed back as the worker's result instead of raised there.
    torch's worker hand-back re-raises an exception as its class called with torch's own message (the worker's
    traceback), or as a RuntimeError where the class takes other arguments: the user's one line would be lost and
    the error seen as a bug. Pickled whole, it is raised again where the batch is received (`handed_back`)."""

    def __init__(self, error: CnnsError):
        self.error = error


def handed_back(item):
    """`item`, or the error it hands back raised here, as the worker raised it."""
    if isinstance(item, HandedBack):
        raise item.error
    return item


class DataError(CnnsError):
    """Missing, truncated or malformed data files."""


class CheckpointError(CnnsError):
    """A checkpoint that cannot be read: missing, truncated, foreign."""


class ConfigError(CnnsError):
    """Unknown or contradictory options and configurations."""


class WriteError(CnnsError):
    """A file that could not be written whole (a full disk, a quota, an I/O error, a vanished folder); what
    the file held before is unchanged (`cnns.safe_writes`)."""

    def __init__(self, path, cause: OSError):
        self.path, self.cause = path, cause
        super().__init__(f"cannot write {path}: {reason(cause)}")


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


def continue_with_nothing() -> None:
    """The command has ended: its line to continue with goes with it (`cnns.cli.run_script`)."""
    CONTINUE_WITH.clear()
