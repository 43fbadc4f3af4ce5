"""Export the retrieval model for deployment without this library: TorchScript and ONNX.

The exported graph is :class:`~idml.app.inference.RetrievalNet`: backbone + pooling + heads with the
input normalisation ``(x − mean) / std`` inside. One input, two outputs:

* ``images``: float32 ``(B, C, H, W)`` in ``[0, 1]``, ``H = W = image_size``, after the test-time
  preprocessing of the run (resize the shorter side to ``resize_size``, centre-crop ``image_size``);
* ``embedding``: ``(B, d)``, L2-normalised (cosine similarity = dot product);
* ``uncertainty``: ``(B,)``, the uncertainty level ``||u||`` (Wang et al. 2022, IDML §IV; 0 for a
  model without an uncertainty head).

The batch dimension is dynamic in both formats. ``export.json`` beside the files records the
input size, preprocessing, output names, the model's ``weights_sha256`` and the SHA-256 and size of
every model file, so an index built with the run can be searched with the export
(:meth:`idml.app.inference.Encoder.from_export`), and a file of another export is refused. The run's
``calibration.json`` (its calibrated confidence, :mod:`idml.app.calibration`) is copied beside
them when it was fitted for the exported weights, so a search with the export finds it.

An export folder holds one model. Exporting into a folder that is not empty is refused without
``overwrite``; with it, every file of the new export is written (to hidden temporary names) before
any old one is touched, then the old ``export.json`` is removed, the new files renamed into place,
the old export's other files removed, and the new ``export.json`` renamed in last. A failure while
writing (a full disk) leaves the previous export as it was; a kill during the renames leaves no
``export.json`` (not an export) or one whose hashes refuse a file of the other model, never a
folder that loads as a mixture. The models are serialized in memory first, so a full disk is an
:class:`~idml.app.storage.WriteError` naming the folder and the bytes needed, not an abort inside
libtorch.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from idml.app.calibration import CALIBRATION_FILE, mismatch
from idml.app.inference import EXPORT_INFO, Encoder, RetrievalNet
from idml.app.storage import (
    fsync_folder,
    remove_quietly,
    temporary_name,
    write_failure,
    write_new_files,
)

FORMATS = ("torchscript", "onnx")
TORCHSCRIPT_FILE = "model.pt"
ONNX_FILE = "model.onnx"
EXPORT_FILES = (EXPORT_INFO, TORCHSCRIPT_FILE, ONNX_FILE)
"""Every file an export writes (a copy of the run's calibration aside)."""
FOLDER_FILES = (*EXPORT_FILES, CALIBRATION_FILE)
"""Every file an export folder may hold."""
EXPORT_VERSION = 2
"""2: ``files`` records each model file's SHA-256 and size. 1 (still read): without them."""
INPUT_NAME = "images"
OUTPUT_NAMES = ("embedding", "uncertainty")


class ExportError(ValueError):
    """An export folder that cannot be written as asked, or whose files do not belong together."""


def export_model(
    encoder: Encoder,
    out: str | Path,
    formats: Sequence[str] = FORMATS,
    opset: int = 18,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the chosen ``formats`` of ``encoder``'s model and ``export.json`` into folder ``out``
    (module docstring: one model per folder; ``overwrite`` replaces the export in a folder that
    holds one).

    ``encoder`` must hold a PyTorch model (:meth:`~idml.app.inference.Encoder.from_run`). Returns the
    ``export.json`` content.
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"export formats must be among {FORMATS}, got {list(formats)}")
    if encoder.model is None:
        raise ValueError("export needs the PyTorch model; load it with Encoder.from_run(RUN)")
    out = Path(out)
    _check_folder(out, overwrite)
    info = encoder.info
    net = RetrievalNet(encoder.model).eval().cpu()
    example = torch.rand(2, info.channels, info.image_size, info.image_size)
    meta: dict[str, Any] = {
        "format": "idml-export",
        "version": EXPORT_VERSION,
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
    files: dict[str, bytes] = {}
    with torch.no_grad():
        if "torchscript" in formats:
            with warnings.catch_warnings():
                # Shape reads are traced as dynamic ops; the tracer's generic warning is noise.
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                # TorchScript is deprecated in favour of torch.export, but it is still what C++
                # (libtorch) and most serving stacks load without Python; the warning is not ours.
                warnings.simplefilter("ignore", FutureWarning)
                traced = torch.jit.trace(net, example, check_trace=False)
                buffer = io.BytesIO()  # in memory: libtorch aborts on a failed file write
                torch.jit.save(traced, buffer)
            files[TORCHSCRIPT_FILE] = buffer.getvalue()
            meta["torchscript"] = TORCHSCRIPT_FILE
        if "onnx" in formats:
            files[ONNX_FILE] = _export_onnx(net, example, opset)
            meta["onnx"] = ONNX_FILE
    meta["files"] = {
        name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        for name, data in files.items()
    }
    calibration = _run_calibration(encoder)
    if calibration is not None:
        files[CALIBRATION_FILE] = calibration
    files[EXPORT_INFO] = (json.dumps(meta, indent=2) + "\n").encode()
    _write_export(out, files)
    return meta


def _run_calibration(encoder: Encoder) -> bytes | None:
    """The bytes of the run's ``calibration.json`` when it was fitted for these weights."""
    from idml.evaluation.confidence import ConfidenceCalibration

    path = Path(encoder.info.source) / CALIBRATION_FILE
    if not path.is_file():
        return None
    data = path.read_bytes()
    calibration = ConfidenceCalibration.from_dict(json.loads(data), str(path))
    if mismatch(calibration, encoder.info.weights_sha256, "none") is not None:
        return None  # fitted for another checkpoint of the run, or under a re-ranking
    return data


def _check_folder(out: Path, overwrite: bool) -> None:
    """Refuse a file in the way, a non-empty folder without ``overwrite``, and a folder with
    files that are not an export's even with it (they are not ours to remove)."""
    from idml.app.run_folder import make_folder

    make_folder(out, "export folder")
    held = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    foreign = [name for name in held if name not in FOLDER_FILES]
    if foreign:
        raise ExportError(
            f"export folder {out} holds files that are not an export's ({', '.join(foreign[:3])}); "
            "an export folder holds one model and nothing else. Choose another --out"
        )
    if held and not overwrite:
        raise ExportError(
            f"export folder {out} already holds an export ({', '.join(held)}); pass --overwrite "
            "to replace it, or choose another --out"
        )


def _write_export(out: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into ``out`` in the order of the module docstring."""
    staged = {name: temporary_name(out / name) for name in files}
    needed = sum(len(data) for data in files.values())
    had_export = (out / EXPORT_INFO).is_file()
    try:
        write_new_files(out, {staged[name].name: data for name, data in files.items()})
    except OSError as err:
        for path in staged.values():
            remove_quietly(path)
        kept = "the previous export is unchanged" if had_export else "no export was written"
        raise write_failure(err, out, "the export", needed, kept) from err
    (out / EXPORT_INFO).unlink(missing_ok=True)  # from here until the end: not an export
    fsync_folder(out)
    for name, path in staged.items():
        if name != EXPORT_INFO:
            os.replace(path, out / name)
    for name in FOLDER_FILES:
        if name not in files:
            # The previous export's other format, or its calibration (of the previous model).
            (out / name).unlink(missing_ok=True)
    os.replace(staged[EXPORT_INFO], out / EXPORT_INFO)
    fsync_folder(out)
    for stray in out.glob(".*.tmp-*"):
        remove_quietly(stray)  # a killed export's staged files, never part of one


def verified_file(folder: Path, meta: dict[str, Any], key: str, meta_path: Path) -> bytes:
    """The bytes of the model file that ``export.json`` names under ``key`` (``"torchscript"``
    or ``"onnx"``): a plain file name inside ``folder`` (never a path out of it), whose SHA-256
    and size match those recorded (an export of version 1 recorded none)."""
    name = meta.get(key)
    if not isinstance(name, str) or name not in EXPORT_FILES[1:]:
        raise ExportError(
            f"{meta_path}: {key!r} names {str(name)[:80]!r}, not a model file of an export "
            f"({', '.join(EXPORT_FILES[1:])} in the same folder); export again"
        )
    path = folder / name
    if path.is_symlink() or not path.is_file():
        raise FileNotFoundError(
            f"{path}: the {key} file named in {meta_path} is missing; export again with "
            f"--format {key}"
        )
    data = path.read_bytes()
    recorded = meta.get("files")
    if meta.get("version", 1) >= 2:
        entry = recorded.get(name) if isinstance(recorded, dict) else None
        if not isinstance(entry, dict):
            raise ExportError(f"{meta_path}: records no checksum of {name}; export again")
        if len(data) != entry.get("bytes") or hashlib.sha256(data).hexdigest() != entry.get(
            "sha256"
        ):
            raise ExportError(
                f"{path} does not belong to the export {meta_path} describes (checksum "
                f"mismatch: {len(data)} bytes, {entry.get('bytes')} recorded): it is another "
                "model's file or was modified. Export again with --overwrite"
            )
    return data


def _export_onnx(net: RetrievalNet, example: torch.Tensor, opset: int) -> bytes:
    try:
        import onnx  # noqa: F401  (torch.onnx needs it; fail here with the fix)
    except ImportError as err:
        raise ValueError(
            "ONNX export needs the onnx package; `pip install idml[onnx]` (or --format torchscript)"
        ) from err
    batch = {0: "batch"}
    buffer = io.BytesIO()
    target: Any = buffer  # torch's stub lists file names only; export writes to a buffer too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (example,),
            target,
            input_names=[INPUT_NAME],
            output_names=list(OUTPUT_NAMES),
            dynamic_axes={INPUT_NAME: batch, OUTPUT_NAMES[0]: batch, OUTPUT_NAMES[1]: batch},
            opset_version=opset,
            dynamo=False,
        )
    return buffer.getvalue()
