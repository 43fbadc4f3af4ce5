"""Inference: load a trained run or an exported model, and embed images with their uncertainty.

An :class:`Encoder` maps images to what retrieval needs, for each image ``i``:

* the L2-normalised semantic embedding ``ŝ_i = normalize(W f_i + b)`` (cosine similarity between
  two images is then ``ŝ_i · ŝ_j``), and
* its uncertainty level: ``||u_i||`` for an IDML model (Wang et al. 2022, "Introspective Deep Metric
  Learning", §IV: "the uncertainty level of an image is the L2-norm of its uncertainty embedding"),
  ``||σ_i|| = sqrt(Σ_k exp(log σ²_k))`` for a PEL model, and 0 for a model without an uncertainty
  head.

Images may be file paths, PIL images, ``C×H×W`` tensors or arrays (``uint8``, or floats in
``[0, 1]``), or a ``B×C×H×W`` batch; each one is resized and centre-cropped as the run's test split
was (``data.resize_size``, ``data.image_size``). The network itself is :class:`RetrievalNet`:
backbone, input normalisation and heads, with one tensor in and two out, which is also exactly what
:mod:`idml.app.deploy` exports to TorchScript and ONNX.

Example:
    >>> import torch
    >>> from idml.models import build_model
    >>> model = build_model("small_cnn", pretrained=False, embedding_dim=8, uncertainty=True)
    >>> encoder = Encoder.from_model(model.eval(), image_size=8, resize_size=8)
    >>> out = encoder.embed(torch.rand(3, 3, 8, 8))
    >>> tuple(out.embeddings.shape), tuple(out.uncertainty.shape)
    ((3, 8), (3,))
    >>> bool(torch.allclose(out.embeddings.norm(dim=1), torch.ones(3)))
    True
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn
from torch.utils.data import Dataset

from idml.data import build_transforms
from idml.data.datasets import decode_image_file
from idml.embeddings import Embeddings
from idml.models import EmbeddingModel, embed_dataset
from idml.models.model import UncertaintyKind, global_pool

ImageInput = str | Path | Image.Image | Tensor | np.ndarray
"""One image: a file path, a PIL image, or a ``C×H×W`` (``H×W×C`` for arrays) image."""

EXPORT_INFO = "export.json"
"""The file next to an exported model that says how to feed it and which weights it holds."""


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes, read in chunks (checkpoints and index files can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_json_file(
    path: Path, *, missing: Exception, redo: str, error: type[ValueError] = ValueError
) -> Any:
    """The JSON value stored in ``path`` (an export's or an index's description of itself).

    A missing file raises ``missing``, an error that says what the folder is not and how to make
    one; text that is not JSON raises ``error("{path}: not valid JSON (...); {redo}")``.
    """
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise missing from None
    except ValueError as err:
        raise error(f"{path}: not valid JSON ({err}); {redo}") from err


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 over a module's ``state_dict`` (names, dtypes, shapes and bytes), in key order."""
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        t = value.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # reshape(-1) first: a 0-d tensor (BatchNorm's step counter) cannot be viewed as bytes.
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelInfo:
    """What identifies a retrieval model and how to feed it.

    ``weights_sha256`` (:func:`weights_sha256` of the :class:`~idml.models.EmbeddingModel`) is what
    an index records and checks: embeddings of two different models are not comparable, even at
    the same dimension.
    """

    weights_sha256: str
    embedding_dim: int
    uncertainty: str  # "ism", "pel" or "none"
    channels: int
    image_size: int
    resize_size: int
    backbone: str
    source: str  # the run folder, checkpoint or export it was loaded from
    checkpoint: str | None = None  # the checkpoint folder of a run
    epoch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> ModelInfo:
        names = set(cls.__dataclass_fields__)
        missing = sorted(n for n in names if n not in data and n not in ("checkpoint", "epoch"))
        unknown = sorted(set(data) - names)
        if missing or unknown:
            raise ValueError(
                f"{source}: model description has missing keys {missing} / unknown keys "
                f"{unknown}; valid keys: {sorted(names)}. Export the model again"
            )
        return cls(**data)

    def same_model(self, other: ModelInfo) -> bool:
        return self.weights_sha256 == other.weights_sha256


class RetrievalNet(nn.Module):
    """``[0, 1]`` images ``(B, C, H, W)`` → ``(ŝ (B, d), uncertainty level (B,))``.

    Input normalisation ``(x − mean) / std``, backbone, pooling, the semantic head (L2-normalised)
    and the uncertainty level of :func:`idml.models.model.uncertainty_level`, with no input checks
    or Python containers in the way, so it traces to TorchScript and ONNX. It shares (not copies)
    the parameters of the :class:`~idml.models.EmbeddingModel` it wraps.
    """

    input_mean: Tensor
    input_std: Tensor

    def __init__(self, model: EmbeddingModel) -> None:
        super().__init__()
        self.backbone = model.backbone
        self.semantic_head = model.semantic_head
        self.uncertainty_head = model.uncertainty_head
        self.register_buffer("input_mean", model.input_mean.detach().clone())
        self.register_buffer("input_std", model.input_std.detach().clone())
        self.pooling = model.pooling
        self.kind = model.uncertainty_kind.value
        self.channels = int(model.backbone.in_channels)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        x = (images - self.input_mean) / self.input_std
        features = global_pool(self.backbone(x), self.pooling)
        semantic = self.semantic_head(features)
        if self.uncertainty_head is None:
            level = semantic.new_zeros(semantic.shape[0])
        elif self.kind == UncertaintyKind.PEL.value:
            level = self.uncertainty_head(features).exp().sum(dim=1).sqrt()
        else:
            level = self.uncertainty_head(features).norm(dim=1)
        return semantic, level


@dataclass
class EncodedImages:
    """Semantic embeddings ``(N, d)`` (unit norm) and uncertainty levels ``(N,)``, float32 on CPU."""

    embeddings: Tensor
    uncertainty: Tensor

    def __len__(self) -> int:
        return int(self.embeddings.shape[0])


class Encoder:
    """Images → :class:`EncodedImages`, batched, on any device (see the module docstring).

    Build one with :meth:`load` (a run folder, a checkpoint folder or an export folder),
    :meth:`from_run`, :meth:`from_export` or :meth:`from_model`.
    """

    def __init__(
        self,
        net: Callable[[Tensor], tuple[Tensor, Tensor]],
        info: ModelInfo,
        device: torch.device | str = "cpu",
        model: EmbeddingModel | None = None,
    ) -> None:
        self.net = net
        self.info = info
        self.device = torch.device(device)
        self.model = model  # the PyTorch model, when loaded from a run
        self.transform = build_transforms(False, info.image_size, info.resize_size)

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(
        cls, path: str | Path, which: str = "best", device: torch.device | str | None = None
    ) -> Encoder:
        """A run folder or checkpoint folder (:meth:`from_run`) or an export folder
        (:meth:`from_export`: it holds ``export.json``)."""
        path = Path(path)
        if (path / EXPORT_INFO).is_file():
            return cls.from_export(path, device=device)
        return cls.from_run(path, which=which, device=device)

    @classmethod
    def from_run(
        cls, path: str | Path, which: str = "best", device: torch.device | str | None = None
    ) -> Encoder:
        """The retrieval model of a run folder's ``which`` checkpoint (see
        :func:`idml.app.trained_run.load_trained_run`), in eval mode on ``device`` (default CPU)."""
        from idml.app.trained_run import load_trained_run

        run = load_trained_run(Path(path), which)
        resize = run.config.data.resize_size
        info = describe_model(
            run.model,
            image_size=run.config.data.image_size,
            resize_size=resize,
            source=str(Path(path).resolve()),  # searched later from any working directory
            checkpoint=str(run.checkpoint),
            epoch=run.state.get("epoch"),
        )
        return cls._of_model(run.model, info, device)

    @classmethod
    def from_model(
        cls,
        model: EmbeddingModel,
        image_size: int,
        resize_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> Encoder:
        """An in-memory :class:`~idml.models.EmbeddingModel` (put in eval mode here), fed images
        at ``image_size`` after a ``resize_size`` resize (:func:`describe_model`)."""
        info = describe_model(model, image_size, resize_size, source="<in memory>")
        return cls._of_model(model, info, device)

    @classmethod
    def _of_model(
        cls, model: EmbeddingModel, info: ModelInfo, device: torch.device | str | None
    ) -> Encoder:
        """The encoder of ``model`` (put in eval mode, on ``device``) that ``info`` describes."""
        dev = _device(device)
        model.eval().to(dev)
        return cls(RetrievalNet(model).eval(), info, dev, model)

    @classmethod
    def from_export(cls, folder: str | Path, device: torch.device | str | None = None) -> Encoder:
        """An export folder of :func:`idml.app.deploy.export_model`: ``model.pt`` (TorchScript) and
        ``export.json``; needs neither the run nor its config."""
        folder = Path(folder)
        meta_path = folder / EXPORT_INFO
        meta = read_json_file(
            meta_path,
            missing=FileNotFoundError(
                f"{meta_path}: not an export folder (no {EXPORT_INFO}); run `idml export` first"
            ),
            redo="export again",
        )
        if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
            raise ValueError(
                f"{meta_path}: not an export description (no 'model' object); export again"
            )
        info = ModelInfo.from_dict(meta["model"], str(meta_path))
        # The export is now where these weights live (the run it came from may be elsewhere).
        info = replace(info, source=str(folder.resolve()), checkpoint=None)
        from idml.app.deploy import verified_file

        # A plain file name inside the folder, whose hash export.json records: never a path out
        # of the folder, never another export's file.
        data = verified_file(folder, {"torchscript": "model.pt", **meta}, "torchscript", meta_path)
        script = folder / str(meta.get("torchscript", "model.pt"))
        dev = _device(device)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation notice
                net = torch.jit.load(io.BytesIO(data), map_location=dev)
        except RuntimeError as err:
            message = str(err).strip().splitlines()[0][:200] if str(err).strip() else "unreadable"
            raise ValueError(f"{script}: cannot load the TorchScript model ({message})") from None
        net.eval()
        return cls(net, info, dev)

    # ----------------------------------------------------------------- embedding
    def preprocess(self, image: ImageInput) -> Tensor:
        """One image → a float ``C×H×W`` tensor in ``[0, 1]`` at the model's input size."""
        if isinstance(image, (str, Path)):
            tensor = decode_image_file(str(image), 3 if self.info.channels == 3 else 1)
        elif isinstance(image, Image.Image):
            tensor = torch.from_numpy(
                np.array(image.convert("RGB" if self.info.channels == 3 else "L"), dtype=np.uint8)
            )
            tensor = tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1)
        elif isinstance(image, np.ndarray):
            if image.ndim not in (2, 3):
                raise ValueError(f"an image array must be H×W or H×W×C, got shape {image.shape}")
            tensor = torch.from_numpy(np.ascontiguousarray(image))
            tensor = tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1)
        elif isinstance(image, Tensor):
            if image.dim() != 3:
                raise ValueError(
                    f"an image tensor must be C×H×W, got shape {tuple(image.shape)}; pass a batch "
                    "as B×C×H×W to embed()"
                )
            tensor = image.detach().cpu()
            if tensor.dtype.is_floating_point and (tensor.min() < 0 or tensor.max() > 1):
                raise ValueError(
                    "float image tensors must hold values in [0, 1] (or pass uint8 in [0, 255])"
                )
        else:
            raise ValueError(
                f"cannot embed a {type(image).__name__}; pass file paths, PIL images, "
                "C×H×W tensors or H×W×C arrays"
            )
        if tensor.shape[0] not in (1, 3):
            raise ValueError(f"an image must have 1 or 3 channels, got {tensor.shape[0]}")
        if tensor.shape[0] != self.info.channels:
            tensor = tensor.expand(3, -1, -1) if tensor.shape[0] == 1 else tensor.mean(0, True)
        out = self.transform(tensor)
        return out.as_subclass(Tensor) if isinstance(out, Tensor) else torch.as_tensor(out)

    @torch.no_grad()
    def embed(
        self,
        images: Sequence[ImageInput] | Iterable[ImageInput] | Tensor,
        batch_size: int = 64,
        progress: bool = False,
    ) -> EncodedImages:
        """Embed images (see the module docstring for what they may be), ``batch_size`` at a time."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if isinstance(images, Tensor) and images.dim() == 4:
            items: list[ImageInput] = list(images.unbind(0))
        elif isinstance(images, (str, Path, Image.Image, Tensor, np.ndarray)):
            items = [images]
        else:
            items = list(images)
        if not items:
            return EncodedImages(torch.zeros(0, self.info.embedding_dim), torch.zeros(0))
        emb, _ = embed_dataset(
            _LevelAsUncertainty(self.net),
            _Preprocessed(items, self.preprocess),
            batch_size,
            self.device,
            progress=progress,
        )
        assert emb.uncertainty is not None
        return EncodedImages(emb.semantic, emb.uncertainty[:, 0])


class _Preprocessed(Dataset[tuple[Tensor, int, int]]):
    """Images given to :meth:`Encoder.embed`, preprocessed as they are loaded (no labels)."""

    def __init__(self, items: Sequence[ImageInput], preprocess: Callable[[ImageInput], Tensor]):
        self.items, self.preprocess = items, preprocess

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Tensor, int, int]:
        return self.preprocess(self.items[index]), 0, index


class _LevelAsUncertainty(nn.Module):
    """An encoder network (images → semantic, level) as :func:`~idml.models.embed_dataset` takes a
    model: the level ``(B,)`` rides along as a one-column uncertainty, read back unchanged."""

    def __init__(self, net: Callable[[Tensor], tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.net = net
        self.training = bool(getattr(net, "training", False))  # restored as it was after the pass

    def forward(self, images: Tensor) -> Embeddings:
        semantic, level = self.net(images)
        return Embeddings(semantic, level.unsqueeze(1))


def describe_model(
    model: EmbeddingModel,
    image_size: int,
    resize_size: int | None,
    source: str,
    checkpoint: str | None = None,
    epoch: int | None = None,
) -> ModelInfo:
    """The :class:`ModelInfo` of a model fed at ``image_size`` after a ``resize_size`` resize."""
    from idml.data.transforms import eval_resize_size

    return ModelInfo(
        weights_sha256=weights_sha256(model),
        embedding_dim=int(model.embedding_dim),
        uncertainty=model.uncertainty_kind.value,
        channels=int(model.backbone.in_channels),
        image_size=int(image_size),
        resize_size=int(eval_resize_size(image_size) if resize_size is None else resize_size),
        backbone=str(model.backbone.spec),
        source=source,
        checkpoint=checkpoint,
        epoch=epoch,
    )


def _device(device: str | torch.device | None) -> torch.device:
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r} requested but CUDA is not available; use 'cpu'")
    return dev


__all__ = [
    "EXPORT_INFO",
    "EncodedImages",
    "Encoder",
    "ImageInput",
    "ModelInfo",
    "RetrievalNet",
    "describe_model",
    "file_sha256",
    "weights_sha256",
]
