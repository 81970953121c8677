"""`cnns models [PATTERN]`: the names --model takes, as timm's `list_models(PATTERN)` lists them (an fnmatch
pattern, default every name): the model families by key, then every timm model by its timm name."""

from __future__ import annotations

import argparse

from cnns.config.strict_parser import StrictParser


def models_parser() -> argparse.ArgumentParser:
    parser = StrictParser(prog="cnns models", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("pattern", nargs="?", default="*",
                        help="An fnmatch pattern, as timm.list_models takes it: 'convnext*', 'regnet[xy]_00*' "
                             "(default: every name).")
    return parser


def models_main(argv: list[str]) -> int:
    from cnns.models import model_names

    args = models_parser().parse_args(argv)
    names = model_names(args.pattern)
    for name in names:
        print(name)
    if not names:
        print(f"no model name matches {args.pattern!r}")
        return 1
    return 0
