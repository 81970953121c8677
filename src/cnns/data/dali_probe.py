"""Whether NVIDIA DALI can decode a run's JPEGs here, without importing it unless asked: what
--decode-device dali checks before anything is written, what auto weighs, and the run's header line.
`cnns.data.dali` is the pipeline itself."""

from __future__ import annotations

import functools

import torch

from cnns.errors import ConfigError, first_line

EXTRA = "dali"  # pyproject.toml's optional extra that installs DALI
DALI_PACKAGE = "nvidia-dali-cuda130==2.4.0"
INSTALL = f"install the optional extra `{EXTRA}`: pip install -e '.[{EXTRA}]' in cnns's checkout ({DALI_PACKAGE})"

# GPUs that carry hardware JPEG decoders (NVJPG engines), by compute capability: A100 and A30 (8.0), H100,
# H200 and GH200 (9.0), B200 (10.0). The other GPUs decode JPEGs on their compute units (nvJPEG's CUDA
# decoder), taking the model's time: there the CPU decoder or TorchCodec's nvJPEG is the choice.
HARDWARE_JPEG_CAPABILITIES = frozenset({(8, 0), (9, 0), (10, 0)})

# The share of each batch's JPEGs DALI's mixed decoder sends to the NVJPG engines; the rest are decoded by
# nvJPEG's CUDA decoder beside them. DALI's own default, not yet tuned on a GPU (issue 64, item 3).
HW_DECODER_LOAD = 0.65


@functools.cache
def dali_missing() -> str | None:
    """None where DALI imports here, else why not (one line). Cached: what is installed does not change."""
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.pytorch  # noqa: F401 - the copy into torch tensors
    except Exception as error:  # noqa: BLE001 - any failure to load means "not here", said in one line
        return first_line(error) or type(error).__name__
    return None


def check_dali_installed(option: str = "--decode-device dali") -> None:
    """ConfigError, one line naming the extra to install, where DALI does not load."""
    why = dali_missing()
    if why is not None:
        raise ConfigError(f"{option} needs NVIDIA DALI, which does not load here ({why}): {INSTALL}")


def has_hardware_jpeg_decoder(device: torch.device) -> bool:
    """Whether `device` is a GPU with NVJPG engines (HARDWARE_JPEG_CAPABILITIES)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) in HARDWARE_JPEG_CAPABILITIES


def dali_version() -> str:
    import nvidia.dali

    return nvidia.dali.__version__


def describe(device: torch.device) -> str:
    """How DALI decodes for a run on `device`, for the run's header."""
    if device.type == "cuda":
        engines = ("its hardware JPEG decoder" if has_hardware_jpeg_decoder(device)
                   else "nvJPEG's CUDA decoder (no hardware JPEG decoder on this GPU)")
        return (f"Images decoded by NVIDIA DALI {dali_version()} on {device} ({torch.cuda.get_device_name(device)}), "
                f"{engines}, the training crop's region only (hw_decoder_load {HW_DECODER_LOAD}), resized and "
                f"flipped there")
    return (f"Images decoded by NVIDIA DALI {dali_version()} on the CPU (its CPU backend), the training crop's "
            f"region only, resized and flipped there")
