"""timm's models on CIFAR-sized data train with the timm family's own optimiser defaults (issue 69), declared in its
registry entry and chosen by measurement (docs/models.md, "The timm family's optimiser defaults"): with them a timm
model learns the digits, where the CIFAR ResNets' SGD at 0.5 leaves it at chance."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import scripts
from digit_records import write_digits_cifar10

from cnns.config.defaults import resolve
from cnns.config.table import option_defaults


def resolved(model: str, dataset: str, **given) -> dict:
    extra = {"synthetic_data": True} if dataset == "imagenet" else {"data_dir": "/nowhere/cifar-10"}
    return resolve({**option_defaults("train"), "dataset": dataset, "model": model, "seed": 1, **extra, **given})


def test_the_timm_familys_defaults_apply_to_its_models_on_cifar_sized_data_only():
    from cnns.models.timm_family import TIMM

    o = resolved("convnext_atto", "cifar-10")
    table = TIMM.cifar_optimiser_defaults
    assert o["optimiser"] == "AdamW"
    assert o["base_learning_rate_exponent"] == table.value("base_learning_rate_exponent", "AdamW")
    assert o["learning_rate"] == 2.0 ** o["base_learning_rate_exponent"] * o["global_batch_size"]
    # An option given wins; another optimiser takes the table's value for it, or the optimisers' own on CIFAR.
    assert resolved("convnext_atto", "cifar-10", optimiser="SGD")["base_learning_rate_exponent"] == -6.0
    assert resolved("convnext_atto", "cifar-10", base_learning_rate_exponent=-10.0)["learning_rate"] == 2.0 ** -10 * 32
    # The seed families keep Graphcore's on CIFAR-sized data, and timm's models on ImageNet-sized data theirs.
    cifar_resnet = resolved("resnet", "cifar-10")
    assert (cifar_resnet["optimiser"], cifar_resnet["base_learning_rate_exponent"]) == ("SGD", -6.0)
    imagenet = resolved("convnext_atto", "imagenet")
    assert (imagenet["optimiser"], imagenet["base_learning_rate_exponent"]) == ("SGD", -8.0)


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return write_digits_cifar10(tmp_path_factory.mktemp("digits-cifar"))


@pytest.mark.slow
def test_a_timm_model_learns_the_digits_with_the_familys_defaults(digits, tmp_path, capfd):
    """MEASURED below."""
