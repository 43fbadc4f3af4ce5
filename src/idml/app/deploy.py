"""Export the retrieval model for deployment without this library: TorchScript and ONNX.

The exported graph is :class:`~idml.app.inference.RetrievalNet`: backbone + pooling + heads with the
input normalisation ``(x − mean) / std`` inside. One input, two outputs:

* ``images``: float32 ``(B, C, H, W)`` in ``[0, 1]``, ``H = W = image_size``, after the test-time
  preprocessing of the run (resize the shorter side to ``resize_size``, centre-crop ``image_size``);
* ``embedding``: ``(B, d)``, L2-normalised (cosine similarity = dot product);
* ``uncertainty``: ``(B,)``, the uncertainty level ``||u||`` (Wang et al. 2022, IDML §IV; 0 for a
  model without an uncertainty head).

The batch dimension is dynamic in both formats. ``export.json`` beside the files records the
input size, preprocessing, output names and the model's ``weights_sha256``, so an index built with
the run can be searched with the export (:meth:`idml.app.inference.Encoder.from_export`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from idml.app.inference import EXPORT_INFO, Encoder, RetrievalNet

FORMATS = ("torchscript", "onnx")
TORCHSCRIPT_FILE = "model.pt"
ONNX_FILE = "model.onnx"
INPUT_NAME = "images"
OUTPUT_NAMES = ("embedding", "uncertainty")


def export_model(
    encoder: Encoder, out: str | Path, formats: Sequence[str] = FORMATS, opset: int = 18
) -> dict[str, Any]:
    """Write the chosen ``formats`` of ``encoder``'s model and ``export.json`` into folder ``out``.

    ``encoder`` must hold a PyTorch model (:meth:`~idml.app.inference.Encoder.from_run`). Returns the
    ``export.json`` content.
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"export formats must be among {FORMATS}, got {list(formats)}")
    if encoder.model is None:
        raise ValueError("export needs the PyTorch model; load it with Encoder.from_run(RUN)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    info = encoder.info
    net = RetrievalNet(encoder.model).eval().cpu()
    example = torch.rand(2, info.channels, info.image_size, info.image_size)
    meta: dict[str, Any] = {
        "format": "idml-export",
        "version": 1,
        "model": info.to_dict(),
        "input": {
            "name": INPUT_NAME,
            "dtype": "float32",
            "shape": ["batch", info.channels, info.image_size, info.image_size],
            "range": [0.0, 1.0],
            "preprocessing": (
                f"decode as {'RGB' if info.channels == 3 else 'grayscale'}; resize the shorter "
                f"side to {info.resize_size} (bilinear, antialiased); centre-crop "
                f"{info.image_size}x{info.image_size}; scale to [0, 1]; channels first"
            ),
        },
        "outputs": {
            OUTPUT_NAMES[0]: "(batch, dim) L2-normalised semantic embedding",
            OUTPUT_NAMES[1]: "(batch,) uncertainty level ||u||",
        },
    }
    with torch.no_grad():
        if "torchscript" in formats:
            with warnings.catch_warnings():
                # Shape reads are traced as dynamic ops; the tracer's generic warning is noise.
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                # TorchScript is deprecated in favour of torch.export, but it is still what C++
                # (libtorch) and most serving stacks load without Python; the warning is not ours.
                warnings.simplefilter("ignore", FutureWarning)
                traced = torch.jit.trace(net, example, check_trace=False)
            traced.save(str(out / TORCHSCRIPT_FILE))
            meta["torchscript"] = TORCHSCRIPT_FILE
        if "onnx" in formats:
            _export_onnx(net, example, out / ONNX_FILE, opset)
            meta["onnx"] = ONNX_FILE
    (out / EXPORT_INFO).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _export_onnx(net: RetrievalNet, example: torch.Tensor, path: Path, opset: int) -> None:
    try:
        import onnx  # noqa: F401  (torch.onnx needs it; fail here with the fix)
    except ImportError as err:
        raise ValueError(
            "ONNX export needs the onnx package; `pip install idml[onnx]` (or --format torchscript)"
        ) from err
    batch = {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (example,),
            str(path),
            input_names=[INPUT_NAME],
            output_names=list(OUTPUT_NAMES),
            dynamic_axes={INPUT_NAME: batch, OUTPUT_NAMES[0]: batch, OUTPUT_NAMES[1]: batch},
            opset_version=opset,
            dynamo=False,
        )
