"""The one argument parser every cnns command line is read with: an option is exactly what was typed, or refused.

argparse takes any unambiguous prefix of an option by default (``allow_abbrev=True``), so a spelling from another
tool becomes one of ours without a word: timm's ``--sched cosine`` was read as a prefix of the IPU-only
``--scheduling-algorithm`` and the run used the stepped schedule. `StrictParser` refuses every prefix and names
the nearest option instead ("did you mean --lr-schedule?"), with the spellings of timm's train.py that a timm user
types first mapped to ours. Every parser the package builds is one (tests/test_strict_options.py reads the source
for any other and tries a prefix of every option of every command)."""

from __future__ import annotations

import argparse
import difflib

# timm's train.py spellings (and a few of torchvision's reference scripts) that are not options here, with the
# option that does their job: named in the error, never taken silently.
OTHER_TOOLS_SPELLINGS = {
    "--sched": "--lr-schedule",
    "--lr": "--abs-learning-rate",
    "--opt": "--optimiser",
    "--smoothing": "--label-smoothing",
    "--mixup": "--mixup-alpha",
    "--cutmix": "--cutmix-lambda",
    "--model-ema": "--ema-decay",
    "--model-ema-decay": "--ema-decay",
    "--img-size": "--image-size",
    "--input-size": "--image-size",
    "--workers": "--pipeline-num-parallel",
    "-j": "--pipeline-num-parallel",
    "-b": "--micro-batch-size",
    "--output": "--log-dir",
    "--experiment": "--name-suffix",
    "--initial-checkpoint": "--init-path",
    "--resume": "--restore-path",
    "--warmup-lr": "--warmup-epochs",
    "--decay-rate": "--lr-decay-rate",
    "--min-lr": "--abs-end-learning-rate",
    "--log-wandb": "--wandb",
    "--num-gpu": "--replicas",
    "--amp": "--precision",
}


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that takes no abbreviation of an option (whatever the caller asks), says an unknown
    option's nearest spelling, and ends in one line and exit code 2, never a usage dump."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False  # the rule itself: no caller may turn prefixes back on
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        """"; did you mean --x?" for the first unknown option of an "unrecognized arguments" message, or ""."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        for token in message.removeprefix("unrecognized arguments: ").split():
            if token.startswith("-") and len(token) > 1:
                near = nearest_options(token.split("=", 1)[0], self.option_strings())
                if near:
                    return f"; did you mean {' or '.join(near)}?"
        return ""

    def option_strings(self) -> list[str]:
        return [spelling for action in self._actions for spelling in action.option_strings]


def nearest_options(typed: str, options: list[str]) -> list[str]:
    """The options a user who typed `typed` most likely meant: another tool's spelling of one of them, else the
    closest by spelling (difflib), else the options it is a prefix of (which argparse would have taken silently)."""
    mapped = OTHER_TOOLS_SPELLINGS.get(typed)
    if mapped in options:
        return [mapped]
    close = difflib.get_close_matches(typed, options, n=2, cutoff=0.75)
    if close:
        return close
    return sorted(option for option in options if option.startswith(typed) and option.startswith("--"))[:2]
