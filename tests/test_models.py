"""cnns.models: architectures, parameter counts, the names Graphcore's application uses and split points."""

import pytest
import timm
import torch
import torchvision
from torch import nn

from stage_checks import assert_stages_are_the_model

from cnns.errors import CnnsError
from cnns.models import (
    ModelError,
    ModelSpec,
    build_model,
    count_parameters,
    resolve_splits,
    run_name_prefix,
    split_points,
    valid_sizes,
)
from cnns.models.split_points import model_pieces, stage_cuts, stage_pieces
from cnns.models.cifar_resnet import ZeroPadShortcut
from cnns.models.norms import fitted_groups

CIFAR, IMAGENET = 32, 224


def build(arch, size, num_classes=10, image_size=CIFAR, **options):
    return build_model(ModelSpec(arch, size, num_classes, image_size, **options))


@pytest.mark.parametrize(
    "arch, size, num_classes, image_size, expected",
    [
        ("resnet", "20", 10, CIFAR, 269_722),
        ("resnet", "50", 1000, IMAGENET, 25_557_032),
        ("resnext", "101", 1000, IMAGENET, 44_177_704),
        ("efficientnet", "B0", 1000, IMAGENET, 5_288_548),
        ("efficientnet", "B4", 1000, IMAGENET, 19_341_616),
    ],
)
def test_reference_parameter_counts(arch, size, num_classes, image_size, expected):
    assert count_parameters(build(arch, size, num_classes, image_size)) == expected


@pytest.mark.parametrize("size, expected_millions", [("56", 0.85), ("110", 1.7)])
def test_deeper_cifar_resnets_have_the_papers_sizes(size, expected_millions):
    assert count_parameters(build("resnet", size)) / 1e6 == pytest.approx(expected_millions, abs=0.03)


@pytest.mark.parametrize(
    "arch, size, image_size, groups",
    [
        ("resnet", "20", CIFAR, 16),
        ("resnet", "50", IMAGENET, 32),
        ("resnext", "29", CIFAR, 32),
        ("efficientnet", "B0", IMAGENET, 32),  # 24- and 40-channel layers: fewer groups there
        ("efficientnet", "B4", IMAGENET, 4),
    ],
)
def test_group_norm_replaces_every_batch_norm_and_keeps_the_parameter_count(arch, size, image_size, groups):
    with_batch_norm = build(arch, size, 10, image_size)
    with_group_norm = build(arch, size, 10, image_size, norm="group", groups=groups)
    assert count_parameters(with_group_norm) == count_parameters(with_batch_norm)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in with_group_norm.modules())
    norms = [m for m in with_group_norm.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(m.num_channels % m.num_groups == 0 for m in norms)
    assert max(m.num_groups for m in norms) == groups


def test_group_norm_in_efficientnet_keeps_the_swish_activation():
    model = build("efficientnet", "B0", norm="group", groups=4)
    assert isinstance(model.bn1.act, nn.SiLU)
    assert isinstance(model.blocks[1][0].bn3.act, nn.Identity)  # the projection has no activation


def test_fitted_groups_divide_the_channels():
    assert fitted_groups(32, 256) == 32
    assert fitted_groups(32, 16) == 16
    assert fitted_groups(32, 24) == 24
    assert fitted_groups(32, 40) == 20


CIFAR_MODELS = [("resnet", size) for size in valid_sizes("resnet", cifar=True)] + [
    ("resnext", "29"),
    ("resnext", "11"),
    ("efficientnet", "cifar"),
]


@pytest.mark.parametrize("arch, size", CIFAR_MODELS)
def test_cifar_models_map_a_batch_to_logits(arch, size):
    torch.manual_seed(0)
    model = build(arch, size, num_classes=10).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)
    assert torch.isfinite(logits).all()


def test_cifar_resnet_option_a_shortcut_is_parameter_free_subsample_and_zero_pad():
    model = build("resnet", "20")
    shortcuts = [unit.shortcut for stage in (model.layer1, model.layer2, model.layer3) for unit in stage]
    assert sum(isinstance(s, ZeroPadShortcut) for s in shortcuts) == 2  # into stages 2 and 3
    assert all(sum(p.numel() for p in s.parameters()) == 0 for s in shortcuts)
    x = torch.randn(2, 16, 32, 32)
    out = model.layer2[0].shortcut(x)
    assert out.shape == (2, 32, 16, 16)
    assert torch.equal(out[:, :16], x[:, :, ::2, ::2])
    assert not out[:, 16:].any()


def test_cifar_resnet_is_the_papers_network():
    model = build("resnet", "20")
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert [len(stage) for stage in (model.layer1, model.layer2, model.layer3)] == [3, 3, 3]
    assert [stage[0].conv1.out_channels for stage in (model.layer1, model.layer2, model.layer3)] == [16, 32, 64]
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())


def test_cifar_bottleneck_resnets_have_9n_plus_2_layers():
    model = build("resnet", "29")  # 9 * 3 + 2
    assert [len(stage) for stage in (model.layer1, model.layer2, model.layer3)] == [3, 3, 3]
    assert model.fc.in_features == 256
    convs = [m for name, m in model.named_modules() if isinstance(m, nn.Conv2d) and "shortcut" not in name]
    assert len(convs) + 1 == 29  # weighted layers on the main path plus the classifier


def test_cifar_resnext_29_is_xie_et_al():
    model = build("resnext", "29", convolution_groups=8, group_width=64)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    assert [model.layer1[0].conv2.groups, model.layer1[0].conv2.out_channels] == [8, 512]
    assert model.fc.in_features == 1024
    assert count_parameters(model) / 1e6 == pytest.approx(34.4, abs=0.1)  # Xie et al., table 7


def test_imagenet_resnet_and_efficientnet_load_standard_weights():
    build("resnet", "50", 1000, IMAGENET).load_state_dict(torchvision.models.resnet50().state_dict())
    reference = timm.create_model("efficientnet_b0", pretrained=False).eval()
    ours = build("efficientnet", "B0", 1000, IMAGENET).eval()
    ours.load_state_dict(reference.state_dict())
    image = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(image), reference(image))


def test_efficientnet_group_dim_and_expand_ratio():
    model = build("efficientnet", "B4", 1000, IMAGENET, group_dim=16, expand_ratio=4)
    expanded = [block for stage in model.blocks[1:] for block in stage]
    assert all(b.conv_pw.out_channels == 4 * b.conv_pw.in_channels for b in expanded)
    grouped = [model.blocks[0][0].conv_dw, model.blocks[0][1].conv_dw] + [b.conv_dw for b in expanded]
    for conv in grouped:
        channels = conv.in_channels
        # Graphcore's rule: channels // 16 groups, at least one (B4's second 24-channel block: one group).
        assert conv.groups == max(channels // 16, 1)
    assert model.blocks[0][1].conv_dw.groups == 1
    assert all(conv.in_channels // conv.groups == 16 for conv in grouped if conv.in_channels % 16 == 0)
    # The point of Graphcore's group dim: about the parameters of the standard B4.
    assert count_parameters(model) / 1e6 == pytest.approx(19.3, abs=0.1)


def test_efficientnet_defaults_are_depthwise():
    model = build("efficientnet", "B0", 1000, IMAGENET)
    assert all(block.conv_dw.groups == block.conv_dw.in_channels for stage in model.blocks for block in stage)


def test_efficientnet_cifar_size_keeps_a_4x4_map_on_32x32_images():
    model = build("efficientnet", "cifar").eval()
    with torch.no_grad():
        features = model.forward_features(torch.randn(1, 3, 32, 32))
    assert features.shape[-2:] == (4, 4)


def test_group_dim_that_cannot_split_the_channels_is_a_model_error():
    with pytest.raises(ModelError, match="group dim 7 cannot split a 96-channel convolution"):
        build("efficientnet", "B0", 1000, IMAGENET, group_dim=7)


GRAPHCORE_SPLITS = [
    # configs.yml and the benchmark command lines of Graphcore's application
    (("resnet", "50"), ["stage1/unit3/relu", "stage2/unit4/relu", "stage3/unit4/relu"]),
    (("resnet", "50"), ["stage1/unit3/relu", "stage2/unit4/relu", "stage3/unit6/relu"]),
    (("resnet", "50"), ["stage1/unit1/relu", "stage1/unit3/relu", "stage2/unit1/relu", "stage2/unit3/relu",
                        "stage3/unit1/relu", "stage3/unit4/relu"]),
    (("resnet", "50"), ["b1/2/relu", "b2/3/relu", "b3/3/relu"]),
    (("resnext", "101"), ["stage3/unit4/relu"]),
    (("resnext", "101"), ["b3/3/relu"]),
    (("efficientnet", "B4"), ["block2b", "block4b", "block6c"]),
    (("efficientnet", "B4"), ["block4a"]),
    (("efficientnet", "B4"), ["block2c", "block4c", "block6a"]),
]


@pytest.mark.parametrize("model_name, names", GRAPHCORE_SPLITS)
def test_every_graphcore_split_resolves_to_a_module(model_name, names):
    spec = ModelSpec(*model_name, num_classes=1000, image_size=IMAGENET)
    model = build_model(spec)
    modules = resolve_splits(spec, model, names)
    assert len(modules) == len(names)
    for module in modules:
        model.get_submodule(module.split("@")[0])  # "<block>@<child>": a cut inside that block


def test_graphcore_split_names_old_and_new_name_the_same_cut():
    spec = ModelSpec("resnet", "50", 1000, IMAGENET)
    points = split_points(spec, build_model(spec))
    assert points["stage1/unit3/relu"] == points["b1/2/relu"] == points["layer1.2"] == "layer1.2"
    assert points["stage3/unit4/relu"] == points["b3/3/relu"] == "layer3.3"
    assert points["layer4"] == "layer4.2"
    assert len(set(points.values())) == 3 + 4 + 6 + 3


def test_efficientnet_split_names():
    spec = ModelSpec("efficientnet", "B4", 1000, IMAGENET)
    points = split_points(spec, build_model(spec))
    assert points["block0"] == "bn1"
    assert points["block1a"] == "blocks.0.0"  # depthwise separable: no expansion to cut after
    assert points["block1a/b"] == "blocks.0.0@se"
    assert points["block2c"] == "blocks.1.2"
    assert points["block7b"] == "blocks.6.1"  # B4 stages: 2, 4, 4, 6, 6, 8, 2 blocks
    assert list(points)[:4] == ["block0", "block1a/b", "block1a", "block1a/c"]
    # Graphcore's sub-block cuts of a block without a skip connection (each stage's first).
    assert points["block2a"] == "blocks.1.0@bn1"  # after the expansion
    assert points["block2a/b"] == "blocks.1.0@se"  # after depthwise + squeeze-excitation
    assert points["block2a/c"] == points["blocks.1.0"] == "blocks.1.0"  # after the projection
    assert "block2b/b" not in points  # a block with a skip connection is cut whole only


@pytest.mark.parametrize("model_name, image_size, names", [
    (("resnet", "20"), CIFAR, ["stage2/unit1/relu"]),
    (("resnext", "29"), CIFAR, ["stage1/unit3/relu", "stage3/unit1/relu"]),
    (("resnext", "14"), IMAGENET, ["stage2/unit1/relu"]),
    (("efficientnet", "B0"), IMAGENET, ["block1a/b", "block2a", "block2a/b", "block3b", "block4a/c"]),
])
def test_pieces_in_order_are_the_model(model_name, image_size, names):
    spec = ModelSpec(*model_name, num_classes=10, image_size=image_size)
    model = build_model(spec).eval()
    cuts = resolve_splits(spec, model, names)
    stages = stage_pieces(model_pieces(spec, model, cuts), cuts)
    assert len(stages) == len(names) + 1 and all(stages)
    assert [stage[-1].cut for stage in stages[:-1]] == cuts
    assert_stages_are_the_model(model, stages, torch.randn(2, 3, max(image_size, 32), max(image_size, 32)))


def test_cifar_resnet_splits_cover_three_stages():
    spec = ModelSpec("resnet", "20", 10, CIFAR)
    points = split_points(spec, build_model(spec))
    assert points["stage3/unit3/relu"] == "layer3.2"
    assert "stage4/unit1/relu" not in points


def test_unknown_split_lists_the_valid_names():
    spec = ModelSpec("resnet", "50", 1000, IMAGENET)
    with pytest.raises(ModelError, match="unknown pipeline split stage5/unit1/relu") as raised:
        resolve_splits(spec, build_model(spec), ["stage1/unit1/relu", "stage5/unit1/relu"])
    message = str(raised.value)
    assert "stage1/unit1/relu (b1/0/relu, layer1.0)" in message
    assert "stage4/unit3/relu" in message


def test_splits_out_of_order_are_rejected():
    spec = ModelSpec("resnet", "20", 10, CIFAR)
    with pytest.raises(ModelError, match="model's order"):
        resolve_splits(spec, build_model(spec), ["stage2/unit1/relu", "stage1/unit3/relu"])
    with pytest.raises(ModelError, match="model's order"):
        resolve_splits(spec, build_model(spec), ["stage1/unit3/relu", "b1/2/relu"])


def test_a_pipeline_of_n_stages_takes_n_minus_one_cuts():
    """The split count's one place (cnns.models.split_points.stage_cuts): the checks before a run and the stages ask it."""
    spec = ModelSpec("resnet", "20", 10, CIFAR)
    model = build_model(spec)
    assert stage_cuts(spec, model, ["stage1/unit3/relu", "stage2/unit3/relu"], 3) == ["layer1.2", "layer2.2"]
    assert stage_cuts(spec, model, ["layer1", "layer2"], 1) == ["layer1.2", "layer2.2"]  # one stage: recomputation
    with pytest.raises(ModelError) as raised:
        stage_cuts(spec, model, ["stage2/unit1/relu"], 3)
    assert str(raised.value).startswith("--shards 3 needs 2 --pipeline-splits, got 1 (stage2/unit1/relu); "
                                        "valid splits: stage1/unit1/relu (b1/0/relu, layer1.0), ")
    with pytest.raises(ModelError, match="--shards 2 needs 1 --pipeline-splits, got 0 \\(\\)"):
        stage_cuts(spec, model, [], 2)
    with pytest.raises(ModelError, match="unknown pipeline split stage9/unit1/relu"):  # names before their count
        stage_cuts(spec, model, ["stage9/unit1/relu"], 3)


@pytest.mark.parametrize(
    "arch, size, image_size, message",
    [
        ("resnet", "21", CIFAR, "unknown ResNet size 21 for CIFAR.*valid sizes: 8, 14, 20"),
        ("resnet", "18", CIFAR, "unknown ResNet size 18"),
        ("resnet", "20", IMAGENET, "valid sizes: 10, 14, 18, 26, 34, 50, 101, 152"),
        ("resnext", "50", CIFAR, "unknown ResNeXt size 50"),
        ("efficientnet", "B9", IMAGENET, "unknown EfficientNet size B9"),
        ("vgg", "16", IMAGENET, "unknown model 'vgg'"),
    ],
)
def test_bad_model_choice_is_a_model_error(arch, size, image_size, message):
    with pytest.raises(ModelError, match=message):
        ModelSpec(arch, size, 10, image_size)


@pytest.mark.parametrize("options", [{"norm": "layer"}, {"groups": 0}, {"num_classes": 0}])
def test_bad_model_options_are_model_errors(options):
    fields = {"arch": "resnet", "size": "20", "num_classes": 10, "image_size": CIFAR, **options}
    with pytest.raises(ModelError):
        ModelSpec(**fields)


def test_model_error_is_a_cnns_error():
    assert issubclass(ModelError, CnnsError)


@pytest.mark.parametrize("size", ["4", "b4", "B4", 4])
def test_efficientnet_sizes_are_normalised(size):
    assert ModelSpec("efficientnet", size, 1000, IMAGENET).size == "B4"


def test_efficientnet_cifar_size_is_normalised():
    assert ModelSpec("efficientnet", "CIFAR", 10, CIFAR).size == "cifar"


@pytest.mark.parametrize(
    "arch, size, image_size, prefix",
    [
        ("resnet", "20", CIFAR, "RN20"),
        ("resnet", "50", IMAGENET, "RN50"),
        ("resnext", "29", CIFAR, "RNX29"),
        ("resnext", "101", IMAGENET, "RNX101"),
        ("efficientnet", "0", IMAGENET, "EfficientNet-B0"),
        ("efficientnet", "cifar", CIFAR, "EfficientNet-CIFAR"),
    ],
)
def test_run_name_prefix(arch, size, image_size, prefix):
    assert run_name_prefix(ModelSpec(arch, size, 10, image_size)) == prefix


def test_valid_sizes():
    assert valid_sizes("resnet", cifar=True) == ["8", "14", "20", "32", "44", "56", "110", "11", "29", "38", "47", "65"]
    assert valid_sizes("resnet", cifar=False) == ["10", "14", "18", "26", "34", "50", "101", "152"]
    assert "29" in valid_sizes("resnext", cifar=True)
    assert valid_sizes("resnext", cifar=False) == ["14", "26", "50", "101", "152"]
    assert valid_sizes("efficientnet", cifar=False)[:8] == [f"B{i}" for i in range(8)]
    with pytest.raises(ModelError):
        valid_sizes("alexnet", cifar=False)


@pytest.mark.parametrize("arch, size, parameters", [
    ("resnext", "14", 9_411_880),  # Graphcore's pipelining tests print 9,415,016 (a 4th stem input channel)
    ("resnext", "26", 15_389_480),
    ("resnet", "10", 5_418_792),
    ("resnet", "14", 10_064_936),
    ("resnet", "26", 15_995_176),
])
def test_the_imagenet_depths_only_graphcore_has(arch, size, parameters):
    from cnns.models import ModelSpec, build_model, count_parameters

    spec = ModelSpec(arch=arch, size=size, num_classes=1000, image_size=224, norm="batch", groups=32,
                     convolution_groups=32, group_width=4)
    model = build_model(spec)
    assert count_parameters(model) == parameters
    # depth = 2 (stem, classifier) + convolutions per unit x units
    convs_per_unit = 2 if size == "10" else 3
    assert 2 + convs_per_unit * sum(len(getattr(model, f"layer{i}")) for i in range(1, 5)) == int(size)


def test_resnext_152_has_graphcores_units():
    from cnns.models import ModelSpec, build_model

    model = build_model(ModelSpec(arch="resnext", size="152", num_classes=10, image_size=224, norm="batch",
                                  groups=32, convolution_groups=32, group_width=4))
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 8, 36, 3]
