"""One model of each kind the model registry builds (issue 69), for the engine's tests that enumerate them: the
seed's CIFAR ResNet-8 (the option-A network written in cnns.models), and a timm image classifier named by its
timm name, which trains on the engine's generic path (`cnns.models.timm_family`).

The timm model is MobileNetV3-Small at width 0.5 (578,474 parameters, 1.4 s for 16 updates of 16 images on
one core): timm's own norm + activation layers (BatchNormAct2d), squeeze-excitation, hard-swish and depthwise
convolutions, each a pattern the engine meets in its own code (fused passes, cross-replica batch norm, the
bfloat16 depthwise backward), at a fraction of the cost of the models tests/test_timm_models.py trains. A timm
model without batch norm (ConvNeXt: layer norm) is the one that --BN-span and --group-norm refuse.

Each entry is the train.py options that choose the model, keyed by the test id it gives.
"""

from __future__ import annotations

SEED = {"resnet-8": ("--model", "resnet", "--model-size", "8")}
TIMM_BATCH_NORM = "mobilenetv3_small_050"
TIMM = {TIMM_BATCH_NORM: ("--model", TIMM_BATCH_NORM)}
TIMM_WITHOUT_BATCH_NORM = "convnext_atto"
MODELS = {**SEED, **TIMM}  # every kind, with its batch norm
