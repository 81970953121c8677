"""--help tells the truth: every default it states is the value --print-config prints, for CIFAR, an ImageNet
ResNet and EfficientNet (issue 51), and a timm model on either (issue 69).

--help states defaults in one form (`cnns.config.defaults.stated_default`): " (default 32; 16 on CIFAR-sized data;
4 for EfficientNet)", parts separated by "; ", values for disjoint runs by ", ", a part "with SGD or LARS: ..."
only for those optimisers, and where several hold a run the last one says its default. The help is read here as
a user reads it, with this file's own reading of those words (not the code that wrote them), and each default
that applies is compared with --print-config's value: with each optimiser, with the schedules whose options the
default schedule leaves unused, and with float16, so that a default stated for those is compared too. An option
given on the family's command line is not compared (its value is the one given); one that the choices leave
unused prints null and is compared under the choice that uses it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

import scripts
from cnns.cli import COMMANDS, main
from cnns.config.defaults import family as family_of
from cnns.config.defaults import family_runs, optimiser_tables
from cnns.config.table import build_parser, byte_size, has_effect
from cnns.models.families import registered_families
from cnns.optim import OPTIMISERS

COMMAND_LINES = {
    "CIFAR": ("--dataset", "cifar-10"),
    "ImageNet ResNet": ("--dataset", "imagenet", "--model", "resnet", "--model-size", "50", "--synthetic-data"),
    "EfficientNet": ("--dataset", "imagenet", "--model", "efficientnet", "--model-size", "0", "--synthetic-data"),
    # timm's models by name: convnext_tiny's pretrained_cfg is not Graphcore's evaluation (bicubic, crop_pct 0.95).
    "timm on CIFAR": ("--dataset", "cifar-10", "--model", "convnext_atto"),
    "timm on ImageNet": ("--dataset", "imagenet", "--model", "convnext_tiny", "--synthetic-data"),
}
# The optimisers' families, ResNeXt's too.
FAMILIES_ARGV = (*COMMAND_LINES.values(), ("--dataset", "cifar-10", "--model", "efficientnet"),
                 ("--dataset", "imagenet", "--model", "resnext", "--synthetic-data"))
# A default each of a family's models gives itself ("pretrained_cfg for timm's models on ImageNet"), as this file reads
# the word: the model's timm pretrained_cfg entry of the option.
PRETRAINED_CFG = {"eval_interpolation": "interpolation", "eval_crop_pct": "crop_pct"}
# Each family again with every optimiser, with the schedules whose options stepped leaves unused, and with float16.
VARIANTS = ((), *(("--optimiser", name) for name in OPTIMISERS), ("--lr-schedule", "exponential"),
            ("--lr-schedule", "polynomial"), ("--half-dtype", "float16"))

CIFAR_LIKE = ("cifar-10", "cifar-100", "builtin")
MODELS = {family.display: family.key for family in registered_families()}  # how --help names each family
CONDITION = re.compile(r"(?:for (?P<models>.+?))?(?: ?on (?P<data>CIFAR-sized data|ImageNet))?"
                       r"(?: ?with (?P<options>--.+))?")
ACTIONS = {action.dest: action for action in reversed(build_parser("train")._actions)}  # each dest's first
ACTIONS_BY_FLAG = build_parser("train")._option_string_actions


@pytest.fixture(autouse=True)
def wide_help_and_no_data(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no word broken at a hyphen
    monkeypatch.setenv("DATA_DIR", "/nowhere/cifar-10")  # --print-config reads no data


def stated_defaults(help_text: str) -> dict[str, str]:
    """The default each option's help states, "(default ...)", by dest; a description of a default that depends on
    the machine or the data ("(default: the DATA_DIR environment variable)") is not a value to compare."""
    entries: list[list[str]] = []
    for line in help_text.splitlines():
        if re.match(r"  -", line):
            entries.append([line])
        elif entries and line.startswith("    "):  # the option's help, continued
            entries[-1].append(line)
        else:
            entries.append([])  # a group's title or description ends the option before it
    stated = {}
    for entry in filter(None, entries):
        text = " ".join(part.strip() for part in entry)
        found = re.findall(r"\(default ([^:()][^()]*)\)", text)
        assert len(found) <= 1, f"two defaults stated: {text}"
        if found:
            flag = re.match(r"-\S+?(?=[ ,]|$)", text).group()
            stated[ACTIONS_BY_FLAG[flag].dest] = found[0]
    return stated


def holds(condition: str, o: dict) -> bool:
    """Whether the runs `condition` names ("for EfficientNet-B1 on ImageNet", "with --half-dtype float16") hold
    the run whose printed options are `o`."""
    match = CONDITION.fullmatch(condition)
    assert match, f"a condition this test cannot read: {condition!r}"
    if match["models"]:
        models = []
        for name in match["models"].split(" and "):
            model, _, size = name.partition("-")
            models.append((MODELS[model], size or None))
        if not any(family_key(o["model"]) == model and size in (None, o["model_size"]) for model, size in models):
            return False
    if match["data"] and (o["dataset"] in CIFAR_LIKE) != (match["data"] == "CIFAR-sized data"):
        return False
    for option in match["options"].split(" and ") if match["options"] else ():
        flag, value = option.split(" ")
        if str(o[ACTIONS_BY_FLAG[flag].dest]) != value:
            return False
    return True


def applicable(stated: str, o: dict) -> str | None:
    """The value `stated` gives the run of the printed options `o`, or None where it states none for it."""
    value = None
    for part in stated.split("; "):
        if part.startswith("with ") and ": " in part:  # "with SGD or LARS: ..."
            scope, part = part.split(": ", 1)
            if o["optimiser"] not in scope.removeprefix("with ").split(" or "):
                continue
        for alternative in part.split(", "):
            token, _, condition = alternative.partition(" ")
            if not condition or holds(condition, o):
                value = token
    return value


def family_key(model: str) -> str:
    """The family of a --model value: its key, or the named family (timm's) that knows the name."""
    return next(family.key for family in registered_families()
                if (family.named and family.knows(model)) or (not family.named and family.key == model))


def same(token: str, printed, dest: str, o: dict) -> bool:
    if token == "pretrained_cfg":  # the run's model's own
        import timm

        token = str(getattr(timm.models.get_pretrained_cfg(o["model"]), PRETRAINED_CFG[dest]))
    if token in ("yes", "no"):  # a flag
        return bool(printed) == (token == "yes")
    if token in ("ON", "OFF"):
        return printed is (token == "ON")
    if ACTIONS[dest].type is byte_size:
        return printed == byte_size(token)
    if isinstance(printed, (int, float)) and not isinstance(printed, bool):
        return math.isclose(float(token), printed)
    return token == str(printed)


def disagreements(stated: dict[str, str], printed: dict[tuple[str, ...], dict], given: set[str]) -> tuple[list, set]:
    """(each stated default that --print-config contradicts, the dests compared) over the printed options of
    each variant's command line."""
    wrong, compared = [], set()
    for variant, o in printed.items():
        for dest, text in stated.items():
            if dest in given or dest in {ACTIONS_BY_FLAG[flag].dest for flag in variant if flag.startswith("--")}:
                continue
            token = applicable(text, o)
            if token is None or (o[dest] is None and not has_effect(dest, o)):
                continue  # no default for this run, or one its choices leave unused (printed null)
            compared.add(dest)
            if not same(token, o[dest], dest, o):
                wrong.append(f"{' '.join(variant) or 'as given'}: --help says {dest} {token} ({text}), "
                             f"--print-config {o[dest]!r}")
    return wrong, compared


def train_help(capfd) -> str:
    return scripts.run_here(capfd, "train.py", "--help").stdout


def printed_options(capfd, *argv: str) -> dict:
    return json.loads(scripts.run_here(capfd, "train.py", *argv, "--print-config").stdout)


@pytest.mark.parametrize("family", COMMAND_LINES)
def test_every_default_help_states_is_the_value_print_config_prints(family, capfd):
    argv = COMMAND_LINES[family]
    stated = stated_defaults(train_help(capfd))
    assert {"groups", "convolution_groups", "image_size", "lars_weight_decay", "learning_rate_schedule",
            "base_learning_rate_exponent", "weight_decay", "label_smoothing", "micro_batch_size"} <= set(stated)
    printed = {variant: printed_options(capfd, *argv, *variant) for variant in VARIANTS}
    given = {ACTIONS_BY_FLAG[flag].dest for flag in argv if flag.startswith("--")}
    wrong, compared = disagreements(stated, printed, given)
    assert not wrong, "\n".join(wrong)
    # Every default stated for this family was compared under some choice (none hid behind a null).
    for dest, text in stated.items():
        if dest not in given and any(applicable(text, o) is not None for o in printed.values()):
            assert dest in compared, f"{dest}: {text}"
    assert printed[()]["image_size"] == {"CIFAR": 32, "ImageNet ResNet": 224, "EfficientNet": 224, "timm on CIFAR": 32,
                                         "timm on ImageNet": 224}[family]


def test_the_comparison_finds_a_default_stated_wrongly(capfd):
    """The check above fails where --help and --print-config disagree: a doctored --help (EfficientNet's 4 groups
    said to be 8, the ImageNet ResNets' schedule said to be CIFAR's) is caught, per family."""
    stated = stated_defaults(train_help(capfd))
    doctored = {**stated, "groups": stated["groups"].replace("4 for EfficientNet", "8 for EfficientNet"),
                "learning_rate_schedule": "0.5,0.75"}
    for family, expected in (("EfficientNet", "groups"), ("ImageNet ResNet", "learning_rate_schedule")):
        argv = COMMAND_LINES[family]
        wrong, _ = disagreements(doctored, {(): printed_options(capfd, *argv)},
                                 {ACTIONS_BY_FLAG[flag].dest for flag in argv if flag.startswith("--")})
        assert [line.split(": --help says ")[1].split(" ")[0] for line in wrong] == [expected], wrong


@pytest.mark.parametrize("script", scripts.COMMANDS)
def test_no_help_states_argparses_none(script, capfd):
    """No option ends with argparse's "(default: None)" (or its placeholder for --help)."""
    text = scripts.run_here(capfd, script, "--help").stdout
    assert text.startswith("usage:")
    assert "(default: None)" not in text and "SUPPRESS" not in text and "(default: False)" not in text


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in scripts.COMMANDS.values()])
def test_no_cnns_command_help_states_argparses_none(command, capfd):
    """The same for the commands Graphcore's scripts do not have (`cnns bench-data` and its kin)."""
    with pytest.raises(SystemExit) as ended:
        main([command, "--help"])
    text = capfd.readouterr().out
    assert ended.value.code == 0 and "usage:" in text
    assert "(default: None)" not in text and "SUPPRESS" not in text and "(default: False)" not in text


def test_the_optimisers_families_are_said_as_the_runs_they_are(capfd):
    """--help names the optimisers' model families (CIFAR-sized data, and the model families' tables of their
    ImageNet defaults) by the runs `family_runs` says they are: each family's runs hold a run of it and no other
    family's do (a timm model's among them, on either data)."""
    assert set(family_runs()) == {"cifar", *optimiser_tables()}
    for argv in FAMILIES_ARGV:
        o = printed_options(capfd, *argv)
        assert [name for name, runs in family_runs().items() if runs.hold(o)] == [family_of(o)]


# The documentation's statements of defaults and figures (issue 65), each as its page says it and the value --print-config must
# print for the run it speaks of: (the page, words it holds, the run's command line, option, value the words state). The
# option reference (docs/options.md) states the defaults; the README's "Configurations" the figures of a named configuration.
CIFAR, IMAGENET = ("--dataset", "cifar-10"), ("--dataset", "imagenet", "--synthetic-data")
EFFICIENTNET = (*IMAGENET, "--model", "efficientnet")
RN50_16IPUS = ("--config", "resnet50_bn_16ipus", "--synthetic-data")
RN50_ON_8_GPUS = (*RN50_16IPUS, "--replicas", "8", "--shards", "1", "--gradient-accumulation-count", "128")
OPTIONS_PAGE, README = "docs/options.md", "README.md"
STATED_DEFAULTS = [
    (OPTIONS_PAGE, "| `--eight-bit-io` | works, and is on by default", CIFAR, "eight_bit_io", True),
    (OPTIONS_PAGE, "unless `--hostside-norm` is given without it", (*CIFAR, "--hostside-norm"), "eight_bit_io", False),
    (OPTIONS_PAGE, "| `--ckpts-per-epoch` | works (default 1;", CIFAR, "ckpts_per_epoch", 1),
    (OPTIONS_PAGE, "works (default 0.1 at 0.5,0.75 of the run;", CIFAR, "learning_rate_decay", 0.1),
    (OPTIONS_PAGE, "works (default 0.1 at 0.5,0.75 of the run;", CIFAR, "learning_rate_schedule", "0.5,0.75"),
    (OPTIONS_PAGE, "0.3,0.6,0.8,0.9 for ResNet and ResNeXt on ImageNet", IMAGENET, "learning_rate_schedule", "0.3,0.6,0.8,0.9"),
    (OPTIONS_PAGE, "| `--warmup-epochs` | works (default 5,", CIFAR, "warmup_epochs", 5),
    (OPTIONS_PAGE, "| `--groups` | works (default 32; 16 on CIFAR-sized data; 4 for EfficientNet)", IMAGENET, "groups", 32),
    (OPTIONS_PAGE, "| `--groups` | works (default 32; 16 on CIFAR-sized data; 4 for EfficientNet)", CIFAR, "groups", 16),
    (OPTIONS_PAGE, "| `--groups` | works (default 32; 16 on CIFAR-sized data; 4 for EfficientNet)", EFFICIENTNET, "groups", 4),
    (OPTIONS_PAGE, "ResNeXt: group width (default 4; 16 on CIFAR-sized data)", (*CIFAR, "--model", "resnext"), "group_dim", 16),
    (OPTIONS_PAGE, "ResNeXt: group width (default 4; 16 on CIFAR-sized data)", (*IMAGENET, "--model", "resnext"), "group_dim", 4),
    (OPTIONS_PAGE, "| `--expand-ratio` | works (default 6)", EFFICIENTNET, "expand_ratio", 6),
    (OPTIONS_PAGE, "works (default `SGD`; `AdamW` for timm's models on CIFAR-sized data", CIFAR, "optimiser", "SGD"),
    (OPTIONS_PAGE, "works (default `SGD`; `AdamW` for timm's models on CIFAR-sized data", (*CIFAR, "--model", "resnet18d"),
     "optimiser", "AdamW"),
    (OPTIONS_PAGE, "works (default `SGD`; `AdamW` for timm's models on CIFAR-sized data",
     (*IMAGENET, "--model", "resnet18d"), "optimiser", "SGD"),
    (OPTIONS_PAGE, "| `--momentum` | works (default 0.9)", (*CIFAR, "--optimiser", "momentum"), "momentum", 0.9),
    (OPTIONS_PAGE, "(default 0; 0.1 for EfficientNet on ImageNet)", CIFAR, "label_smoothing", 0),
    (OPTIONS_PAGE, "(default 0; 0.1 for EfficientNet on ImageNet)", EFFICIENTNET, "label_smoothing", 0.1),
    (OPTIONS_PAGE, "(default 128 with float16, 1 with bfloat16;", (*CIFAR, "--half-dtype", "float16"), "loss_scaling", 128),
    (OPTIONS_PAGE, "(default 128 with float16, 1 with bfloat16;", (*CIFAR, "--half-dtype", "bfloat16"), "loss_scaling", 1),
    (OPTIONS_PAGE, "| `--batch-norm` | works (the default for ResNet and ResNeXt on CIFAR-sized data)", CIFAR, "batch_norm", True),
    (OPTIONS_PAGE, "| `--group-norm` | works (the default on ImageNet and for EfficientNet)", IMAGENET, "group_norm", True),
    (OPTIONS_PAGE, "| `--group-norm` | works (the default on ImageNet and for EfficientNet)", EFFICIENTNET, "group_norm", True),
    (OPTIONS_PAGE, "off on a CPU; recorded in `arguments.json`", (*CIFAR, "--device", "cpu"), "compile", False),
    (OPTIONS_PAGE, "`auto` (the default) shares the usable cores out evenly", CIFAR, "threads_per_worker", "auto"),
    (OPTIONS_PAGE, "`auto` (the default) where they were measured faster", CIFAR, "fused_norm", "auto"),
    (OPTIONS_PAGE, "before the run ends in one line naming the rank (default 600)", CIFAR, "dist_timeout", 600),
    (OPTIONS_PAGE, "1024-based; default `1G`", CIFAR, "max_file_size", 2**30),
    (OPTIONS_PAGE, "gradients are summed over micro-batches in float32 by default", CIFAR, "gradient_accumulation_dtype", "float32"),
    # The figures of "Configurations": a named configuration as written, and fitted to 8 GPUs.
    (README, "(`resnet50_bn_16ipus`: 4 replicas x 4 stages,", RN50_16IPUS, "replicas", 4),
    (README, "(`resnet50_bn_16ipus`: 4 replicas x 4 stages,", RN50_16IPUS, "shards", 4),
    (README, "global batch 16384 at micro-batch 16, on 8 GPUs", RN50_16IPUS, "global_batch_size", 16384),
    (README, "global batch 16384 at micro-batch 16, on 8 GPUs", RN50_16IPUS, "micro_batch_size", 16),
    (README, "`--replicas 8 --shards 1 --gradient-accumulation-count 128`", RN50_ON_8_GPUS, "global_batch_size", 16384),
]


def test_the_documented_defaults_are_what_print_config_prints(capfd):
    """Each default a page states (its words found in it, so a reworded claim is checked again) is the value
    --print-config prints for the run it speaks of."""
    root = Path(__file__).resolve().parents[1]
    pages = {page: " ".join((root / page).read_text().split()) for page in (OPTIONS_PAGE, README)}
    printed: dict[tuple[str, ...], dict] = {}
    wrong = []
    for page, words, argv, key, value in STATED_DEFAULTS:
        assert words in pages[page], f"{page} no longer says: {words}"
        if argv not in printed:
            printed[argv] = printed_options(capfd, *argv)
        if printed[argv][key] != value:
            wrong.append(f"{words!r} ({' '.join(argv)}): --print-config {key} {printed[argv][key]!r}")
    assert not wrong, "\n".join(wrong)
