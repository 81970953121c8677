"""configs.yml read, and option values checked against the options table's types.

`load_named_config` reads one named configuration (its values are defaults the command line
overrides); `check_option_types` checks a configuration's or a run's arguments.json values against
the parsers' declared types, so a wrong value is named with its file and option.
"""

from __future__ import annotations

import argparse
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from cnns.bounded_reads import UnreadableFile, read_bounded
from cnns.config.table import IPU_ONLY_OPTIONS, build_parser, domain_of
from cnns.errors import ConfigError

# configs.yml is about 10 KB and a benchmark list a few; a YAML file a command reads is refused above these.
YAML_FILE_LIMIT = 1 << 20
# The values a YAML document may stand for once its aliases are expanded: a nested alias makes a 1 KB file stand for
# a billion values, which anything that walks or prints it (an error message's repr) would build.
YAML_EXPANDED_LIMIT = 100_000

REPO_CONFIGS = Path(__file__).resolve().parents[3] / "configs.yml"

# ----------------------------------------------------------------------------------------------
# YAML files: configs.yml and benchmark lists


def read_yaml(path: Path, what: str) -> Any:
    """The YAML document in `path` (a `what`, as messages name it), read bounded: ConfigError of one line when it is
    missing, not a regular file of at most YAML_FILE_LIMIT bytes, not UTF-8, not YAML, or when its aliases expand
    beyond YAML_EXPANDED_LIMIT values or refer to themselves."""
    if not path.exists():
        raise ConfigError(f"{what} not found: {path}")
    try:
        text = read_bounded(path, YAML_FILE_LIMIT).decode("utf-8")
    except UnreadableFile as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.reason}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        document = yaml.safe_load(text)
    # PyYAML raises YAMLError for most bad text, but ValueError, TypeError or RecursionError from its
    # constructors for some (an impossible date, a too deeply nested value): all mean "not valid YAML".
    except Exception as exc:  # noqa: BLE001
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{what} {path} is not valid YAML: {reason[:200]}") from None
    problem = _expansion_problem(document)
    if problem:
        raise ConfigError(f"{what} {path}: {problem}; not read")
    return document


class _SelfReference(Exception):
    pass


def _expansion_problem(document: Any) -> str | None:
    """Why the document is refused once its aliases are counted as copies, or None. Each distinct list or mapping is
    sized once (aliases share the object), so a billion-value document is sized in the time of its few nodes."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Any) -> int:
        if not isinstance(node, (list, dict)):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _SelfReference
        open_nodes.add(key)
        total = 1
        for child in (list(node.keys()) + list(node.values())) if isinstance(node, dict) else node:
            total = min(total + size(child), YAML_EXPANDED_LIMIT + 1)
        open_nodes.discard(key)
        sizes[key] = total
        return total

    try:
        if size(document) > YAML_EXPANDED_LIMIT:
            return (f"its aliases expand to more than {YAML_EXPANDED_LIMIT:,} values (nested aliases, "
                    "a 'billion laughs')")
    except _SelfReference:
        return "an alias refers to the value that holds it (a recursive document)"
    except RecursionError:
        return "its values are nested too deeply"
    return None



def default_configs_path() -> Path:
    """configs.yml beside the root scripts (the repository), else the current folder's."""
    if REPO_CONFIGS.exists():
        return REPO_CONFIGS
    return Path("configs.yml")


def load_named_config(name: str, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The options of configuration `name`, YAML merge keys resolved.

    ConfigError, naming the file, when it cannot be read, is not YAML, is not a mapping of
    configuration names to mappings of options, or gives an option a value of the wrong type."""
    path = Path(path) if path else default_configs_path()
    configs = read_yaml(path, "configuration file")
    if not isinstance(configs, dict):
        raise ConfigError(f"configuration file {path} does not map configuration names to options")
    if name not in configs:
        import difflib

        names = sorted(str(key) for key in configs)
        near = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
        if near:
            raise ConfigError(f"unknown config {name!r} in {path}; did you mean {' or '.join(map(repr, near))}?")
        raise ConfigError(f"unknown config {name!r} in {path}; available configs: {', '.join(names) or 'none'}")
    config = configs[name]
    where = f"config {name!r} in {path}"
    if not isinstance(config, dict) or not all(isinstance(key, str) for key in config):
        raise ConfigError(f"{where} is not a mapping of option names to values")
    for first, second in (("batch_size", "micro_batch_size"), ("epochs", "iterations"),
                          ("epochs_per_ckpt", "ckpts_per_epoch")):
        if config.get(first) is not None and config.get(second) is not None:
            raise ConfigError(f"{where} gives both {first} and {second}: keep one of them")
    check_known_keys(config, where)
    check_option_types(config, where, strings_are_parsed=True)
    return dict(config)


def check_known_keys(config: dict[str, Any], where: str) -> None:
    """ConfigError naming the key and the nearest option for a key that is no option of cnns nor of Graphcore's
    application (the table declares both, the IPU-only ones too): a typo is not an option to ignore."""
    import difflib

    known = set(_option_actions()) | set(_CONFIG_ALIASES) | set(_DERIVED_TYPES)
    for key in config:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=2, cutoff=0.6)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise ConfigError(f"{where}: {key} is not an option of cnns nor of Graphcore's application{hint}")


def command_line_over_config(parser: argparse.ArgumentParser, given: set[str], config: dict[str, Any]) -> dict[str, Any]:
    """The precedence, stated once: the command line over configs.yml over the defaults. `config`'s values are
    the parser's defaults, the command line's (`given`, the dests it named) replace them, and an option the command
    line gives also removes the config's value of every option that is its alternative (the other members of its
    mutually exclusive group): `--iterations 20` over a config's `epochs: 10` leaves no epochs behind, so nothing
    derived from them (the warm-up, the checkpoint cadence) survives either; `--group-norm` over `batch_norm: true`
    is group norm."""
    dropped: set[str] = set()
    for group in parser._mutually_exclusive_groups:
        dests = {action.dest for action in group._group_actions}
        if dests & given:
            dropped |= dests - given
    return {key: value for key, value in config.items() if key not in dropped}


def check_option_types(values: dict[str, Any], where: str, strings_are_parsed: bool) -> None:
    """ConfigError naming `where` and the option when a value has a type its option cannot take: an
    integer option given a list, a flag given a number, a value outside an option's choices.

    For configs.yml (`strings_are_parsed`), a string is left to the argument parser, which converts
    it as it would on the command line; in a run's arguments.json values are already typed. None
    (unset) is accepted everywhere; options the parsers do not declare are not checked, except the
    few values that resolution derives (global batch size, learning rate, seed, ...)."""
    actions = _option_actions()
    for key, value in values.items():
        if value is None:
            continue
        if key in _DERIVED_TYPES:
            kinds = _DERIVED_TYPES[key]
            if isinstance(value, bool) != (kinds == (bool,)) or not isinstance(value, kinds):
                raise ConfigError(f"{where}: {key} must be {_kind_name(kinds)}, got {_shown(value)}")
            continue
        action = actions.get(_CONFIG_ALIASES.get(key, key))
        if action is None:
            continue
        problem = _option_value_problem(action, value, strings_are_parsed)
        if problem:
            raise ConfigError(f"{where}: {key} must be {problem}, got {_shown(value)}")


# configs.yml keys that are another option's (Graphcore's application's deprecated spelling, see cnns.cli.parse_options).
_CONFIG_ALIASES = {"batch_size": "micro_batch_size"}
# Values that resolve() derives, as arguments.json holds them.
_DERIVED_TYPES: dict[str, tuple[type, ...]] = {
    "global_batch_size": (int,), "learning_rate": (int, float), "seed_specified": (bool,),
    "half_dtype_given": (bool,), "name": (str,), "command": (str,),
}


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    return " or ".join(dict.fromkeys(names.get(kind, kind.__name__) for kind in kinds))


def _shown(value: Any) -> str:
    """A value as a message shows it: a few items and levels at most, never the whole of a large value."""
    import reprlib

    shown = reprlib.Repr()  # attributes, not keywords: Python 3.10 and 3.11 take none
    shown.maxlevel, shown.maxlist, shown.maxdict, shown.maxtuple, shown.maxset = 2, 4, 4, 4, 4
    shown.maxstring = shown.maxother = 40
    text = shown.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _option_value_problem(action, value: Any, strings_are_parsed: bool) -> str | None:
    """What `value` should be for the parser action, or None when it fits."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return None if isinstance(value, bool) else "true or false"
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if not isinstance(value, list) and action.dest not in IPU_ONLY_OPTIONS:  # those are ignored anyway
            return "a list"
        items = value if isinstance(value, list) else [value]
        for item in items:
            problem = _scalar_problem(action, item, strings_are_parsed=False)
            if problem and problem.startswith(("a ", "an ")):  # a kind: "a list of integers"
                return f"a list of {problem.removeprefix('a ').removeprefix('an ')}s"
            if problem:  # a range: "a list of values each at least 1"
                return f"a list of values each {problem}"
        return None
    return _scalar_problem(action, value, strings_are_parsed)


def _scalar_problem(action, value: Any, strings_are_parsed: bool) -> str | None:
    if not isinstance(value, (str, int, float, bool)):
        return "a single value"
    parsed_string = isinstance(value, str) and strings_are_parsed
    domain = domain_of(action)
    if domain is not None:
        if parsed_string:  # converted as the command line converts it, then checked as every value is
            try:
                value = domain(value)
            except argparse.ArgumentTypeError as error:
                return f"{'an integer' if domain.kind is int else 'a number'} ({error})"
        problem = domain.problem(value)
        if problem:
            return problem.removeprefix("must be ")
    if action.choices is not None:
        candidate = value
        if parsed_string and callable(action.type):
            try:
                candidate = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                pass
        if isinstance(candidate, bool) or candidate not in action.choices:
            return "one of " + ", ".join(repr(choice) for choice in action.choices)
    return None


def check_domains(values: dict[str, Any]) -> None:
    """ConfigError naming the option when a value given to it lies outside the domain its entry in the options
    table declares (`cnns.config.table.Domain`): the one check of every numeric option, whoever read the value
    (the command line, configs.yml, a run's arguments.json), before anything uses it. None (unset) passes."""
    for key, action in _option_actions().items():
        _check_value(action, values.get(key))


def check_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`check_domains` for a tool's own parser (`cnns predict`, `cnns export`, `cnns benchmark`, `cnns profile`,
    `cnns bench-data`): every option it declares with a `Domain` holds its value to it, before the tool reads or
    writes anything."""
    for action in parser._actions:
        _check_value(action, getattr(args, action.dest, None))


def _check_value(action: argparse.Action, value: Any) -> None:
    """ConfigError naming the option where `value` (or an item of a list of them) lies outside its domain."""
    domain = domain_of(action)
    if domain is None or value is None:
        return
    for item in value if isinstance(value, list) else [value]:
        problem = domain.problem(item)
        if problem:
            raise ConfigError(f"{action.option_strings[0]} {problem}, got {_shown(item)}")


@lru_cache(maxsize=None)
def _option_actions() -> dict[str, Any]:
    """argparse actions by destination, over the scripts that take training options."""
    actions: dict[str, Any] = {}
    for script in ("train", "validate", "weight-avg", "infer"):
        for action in build_parser(script)._actions:
            if action.dest != "help":
                # The first action of a destination is the option's own (--stochastic-rounding ON|OFF),
                # whose type the parser uses for a default; later ones are its --no-... spellings.
                actions.setdefault(action.dest, action)
    return actions

