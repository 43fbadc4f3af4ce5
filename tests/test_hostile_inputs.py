"""Every command against bad and hostile input and injected faults: index, search, export, serve,
embed, report, train, evaluate, ablate, demo.

Each case checks the exit code (or HTTP status), that the message names the file, key or value and
what to do, and that nothing valid was deleted or overwritten. Faults are injected in-process:
a kill is the folder as it is at a step boundary (a snapshot taken there is what a killed process
leaves), a full disk is ``OSError(ENOSPC)`` raised half-way through a file write; one test uses a
real tiny filesystem where the machine lets it mount one. ``benchmarks/RESULTS.md`` ("Faults
injected") lists the cases and their outcomes.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from PIL import Image

from idml.app import storage
from idml.app.cli import main
from idml.app.inference import Encoder
from idml.app.retrieval import Index, IndexFormatError, index_folder
from idml.app.run_folder import LOCK_FILE
from tiny_run import CLASSIFICATION, TINY, train_tiny, write_images

SRC = Path(__file__).resolve().parents[1] / "src"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny trained run, a 12-image gallery, 6 more images (other names) beside it, and an
    index of the gallery whose root holds both folders."""
    root = tmp_path_factory.mktemp("hostile")
    run = train_tiny(root)
    gallery = write_images(root / "gallery", classes=3, per_class=4)
    more = write_images(root / "more", classes=2, per_class=3, seed=5)
    for path in more.rglob("*.png"):
        path.rename(path.with_name("m" + path.name))
    index = root / "index"
    args = ["index", str(gallery), "--out", str(index), "--checkpoint", str(run)]
    assert main([*args, "--root", str(root)]) == 0
    return {"root": root, "run": run, "gallery": gallery, "more": more, "index": index}


@pytest.fixture
def index_copy(world: dict[str, Path], tmp_path: Path) -> Path:
    """A fresh copy of the 12-item index (each test may break its own)."""
    return Path(shutil.copytree(world["index"], tmp_path / "index"))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def _version(index_dir: Path) -> Path:
    return index_dir / (index_dir / "current").read_text().strip()


def _rehash(version: Path) -> None:
    """Rewrite the manifest's checksums after an edit: what a tamperer does to get past them."""
    manifest = json.loads((version / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (version / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (version / "manifest.json").write_text(json.dumps(manifest))


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _disk_full_after(monkeypatch: pytest.MonkeyPatch, fail_at: int = 1) -> list[str]:
    """Make the ``fail_at``-th file write of :mod:`idml.app.storage` (every writer's) hit a full
    disk half-way through its bytes; returns the names of the files it was writing."""
    real_open = open
    written: list[str] = []

    class HalfWritten:
        def __init__(self, fh, name: str) -> None:
            self.fh, self.name = fh, name

        def write(self, data: bytes) -> int:
            self.fh.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()

    def opener(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        if "w" in mode:
            written.append(Path(path).name)
            if len(written) >= fail_at:
                return HalfWritten(fh, str(path))
        return fh

    monkeypatch.setattr(storage, "open", opener, raising=False)
    return written


def _no_temporaries(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if ".tmp" in p.name]


# --------------------------------------------------------------------------- index: kills, writers
@pytest.mark.parametrize("first_format", [False, True])
def test_a_kill_at_every_step_of_index_add_leaves_a_valid_index(
    world: dict[str, Path],
    index_copy: Path,
    tmp_path: Path,
    first_format: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if first_format:  # an index of the first format (files in the folder, absolute paths)
        _to_first_format(index_copy)
    snapshots: list[tuple[str, Path]] = []

    def killed_here(step: str) -> None:
        snap = tmp_path / f"killed-{len(snapshots)}"
        shutil.copytree(index_copy, snap)
        snapshots.append((step, snap))

    monkeypatch.setattr(index_folder, "_crash_point", killed_here)
    killed_here("before")
    assert main(["index", str(world["more"]), "--out", str(index_copy), "--add"]) == 0
    steps = [s for s, _ in snapshots]
    assert steps == [
        "before",
        "version written",
        "version in place",
        "current switched",
        "old versions removed",
    ]
    monkeypatch.undo()
    for step, snap in snapshots:
        index = Index.load(snap)  # never a half state: the old index or the new one
        expected = 18 if step in ("current switched", "old versions removed") else 12
        assert len(index) == expected, step
        capsys.readouterr()
        assert main(["search", str(snap), str(world["gallery"] / "a" / "0.png"), "-k", "3"]) == 0
        assert "a/0.png" in capsys.readouterr().out
        # A dead writer's lock is taken over (and said), its half version cleaned up.
        (snap / LOCK_FILE).write_text(
            json.dumps({"pid": _dead_pid(), "host": socket.gethostname()})
        )
        if expected == 12:
            assert main(["index", str(world["more"]), "--out", str(snap), "--add"]) == 0
            assert "took over the lock" in capsys.readouterr().out
            assert len(Index.load(snap)) == 18 and _no_temporaries(snap)
    final = Index.load(index_copy)
    assert len(final) == 18 and not (index_copy / "manifest.json").exists()


def _to_first_format(folder: Path) -> None:
    version = _version(folder)
    for entry in version.iterdir():
        shutil.move(str(entry), folder / entry.name)
    shutil.rmtree(version)
    (folder / "current").unlink()
    manifest = json.loads((folder / "manifest.json").read_text())
    root = Path(manifest.pop("root"))
    del manifest["allow_outside_root"]
    manifest["version"] = 1
    items = json.loads((folder / "items.json").read_text())
    items["paths"] = [str(root / p) for p in items["paths"]]
    (folder / "items.json").write_text(json.dumps(items))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _rehash(folder)


def test_a_second_writer_is_refused_naming_the_first(
    world: dict[str, Path], index_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(index_copy)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from idml.app.run_folder import acquire_lock; "
            "acquire_lock(sys.argv[1], 'index'); print('locked', flush=True); time.sleep(120)",
            str(index_copy),
        ],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        capsys.readouterr()
        assert main(["index", str(world["more"]), "--out", str(index_copy), "--add"]) == 2
        err = _error(capsys)
        assert f"process {holder.pid} on {socket.gethostname()}" in err
        assert f"rm {index_copy / LOCK_FILE}" in err
        assert _snapshot(index_copy) == before
    finally:
        holder.kill()
        holder.wait()
    assert main(["index", str(world["more"]), "--out", str(index_copy), "--add"]) == 0
    assert "took over the lock" in capsys.readouterr().out and len(Index.load(index_copy)) == 18
    # A lock of another host cannot be checked: refused, with the command that clears it.
    lock = index_copy / LOCK_FILE
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0}))
    assert main(["index", str(world["gallery"]), "--out", str(index_copy), "--add"]) == 2
    assert "on elsewhere" in _error(capsys) and lock.exists()


@pytest.mark.slow
def test_two_concurrent_adds_never_lose_items(world: dict[str, Path], tmp_path: Path) -> None:
    """Two `idml index --add` processes at once: each either adds its 6 items or is refused
    naming the other; the index holds 12 + 6 × (the number that succeeded) items."""
    index_dir = Path(shutil.copytree(world["index"], tmp_path / "index"))
    second = Path(shutil.copytree(world["more"], world["root"] / f"more-{tmp_path.name}"))
    for path in second.rglob("*.png"):  # other ids, under the index's root
        path.rename(path.with_name("x" + path.name))
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "idml", "index", str(g), "--out", str(index_dir), "--add"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for g in (world["more"], second)
    ]
    outcomes = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]
    shutil.rmtree(second)
    done = sum(code == 0 for code, _ in outcomes)
    assert done >= 1 and len(Index.load(index_dir)) == 12 + 6 * done
    for code, err in outcomes:
        assert code == 0 or ("is being written by process" in err and "Traceback" not in err)


# --------------------------------------------------------------------------- full disks
def test_index_on_a_full_disk_keeps_the_previous_version(
    world: dict[str, Path],
    index_copy: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = _snapshot(index_copy)
    _disk_full_after(monkeypatch)
    capsys.readouterr()
    assert main(["index", str(world["more"]), "--out", str(index_copy), "--add"]) == 2
    err = _error(capsys)
    assert f"into {index_copy}: No space left on device" in err
    assert re.search(r"\(\d[\d.]* (bytes|KiB) needed, .* free\)", err)
    assert "stays at its current version v000001 (12 items)" in err and "Free disk space" in err
    assert _snapshot(index_copy) == before and _no_temporaries(index_copy)
    assert not (index_copy / LOCK_FILE).exists()
    # A new index on a full disk: nothing is left behind, not even the folder.
    new = index_copy.parent / "new-index"
    assert (
        main(["index", str(world["more"]), "--out", str(new), "--checkpoint", str(world["run"])])
        == 2
    )
    assert "no index was written" in _error(capsys) and not new.exists()


def test_export_on_a_full_disk_keeps_the_previous_export(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "export"
    args = [
        "export",
        "--checkpoint",
        str(world["run"]),
        "--out",
        str(out),
        "--format",
        "torchscript",
    ]
    assert main(args) == 0
    before = _snapshot(out)
    _disk_full_after(monkeypatch)
    capsys.readouterr()
    assert main([*args, "--overwrite"]) == 2  # no abort inside libtorch: one line, exit 2
    err = _error(capsys)
    assert f"cannot write the export into {out}: No space left on device" in err
    assert "needed" in err and "the previous export is unchanged" in err
    assert _snapshot(out) == before and not [p for p in out.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    assert Encoder.load(out).info.image_size == 8


@pytest.mark.parametrize("suffix", [".npz", ".pt", ".safetensors"])
def test_embed_on_a_full_disk_leaves_the_previous_file(
    world: dict[str, Path], tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / f"emb{suffix}"
    out.write_bytes(b"the previous file")
    _disk_full_after(monkeypatch)
    args = ["embed", "--checkpoint", str(world["run"]), "--images", str(world["gallery"])]
    capsys.readouterr()
    assert main([*args, "--out", str(out), "--no-progress"]) == 2
    err = _error(capsys)
    assert f"cannot write embeddings {out.name} into {tmp_path}: No space left" in err
    assert "the previous" in err and out.read_bytes() == b"the previous file"
    assert _no_temporaries(tmp_path)


def test_report_on_a_full_disk_keeps_the_previous_page(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "report"
    args = ["report", str(world["run"]), "--out", str(out), "--no-test", "--no-progress"]
    assert main(args) == 0
    page = (out / "index.html").read_bytes()
    _disk_full_after(monkeypatch)
    capsys.readouterr()
    assert main(args) == 2
    err = _error(capsys)
    assert "No space left on device" in err and str(out) in err and "needed" in err
    assert (out / "index.html").read_bytes() == page and _no_temporaries(out)


@pytest.fixture
def tiny_filesystem(tmp_path: Path):
    """A real 256 KiB tmpfs (needs root and mount rights; skipped where the machine refuses)."""
    mount = tmp_path / "tiny-fs"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tiny filesystem needs root and mount(8)")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_real_full_filesystem(
    world: dict[str, Path], tiny_filesystem: Path, tmp_path: Path, capsys
) -> None:
    """Index and export on a 256 KiB filesystem: 2000 × 64 float32 embeddings (512 KiB) cannot
    fit; the error names the folder and the bytes, and nothing is left on the disk."""
    emb = tmp_path / "big.npz"
    rng = np.random.default_rng(0)
    paths = np.array([f"/gallery/big{i}.png" for i in range(2000)])
    np.savez(emb, embeddings=rng.random((2000, 64), dtype=np.float32), paths=paths)
    out = tiny_filesystem / "index"
    capsys.readouterr()
    assert main(["index", str(emb), "--out", str(out)]) == 2
    err = _error(capsys)
    assert f"into {out}: No space left on device" in err and "KiB needed" in err
    assert list(tiny_filesystem.iterdir()) == []
    small = tmp_path / "small.npz"
    np.savez(small, embeddings=np.random.default_rng(0).random((10, 64), dtype=np.float32))
    assert main(["index", str(small), "--out", str(out)]) == 0
    before = _snapshot(out)
    assert main(["index", str(emb), "--out", str(out), "--add"]) == 2
    assert "stays at its current version v000001 (10 items)" in _error(capsys)
    assert _snapshot(out) == before and _no_temporaries(out) and len(Index.load(out)) == 10


# --------------------------------------------------------------------------- index files
def test_a_tampered_index_is_refused_in_one_line(
    world: dict[str, Path], index_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = _version(index_copy)
    query = str(world["gallery"] / "a" / "0.png")
    pristine = {p.name: p.read_bytes() for p in version.iterdir()}

    def refused(expected: str) -> None:
        capsys.readouterr()
        assert main(["search", str(index_copy), query]) == 2
        err = _error(capsys)
        assert err.count("\n") == 1 and expected in err, err
        for name, data in pristine.items():
            (version / name).write_bytes(data)

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(version / "embeddings.safetensors"))
    save_file(
        {**tensors, "embeddings": tensors["embeddings"] * 3},
        str(version / "embeddings.safetensors"),
    )
    _rehash(version)
    refused("are not unit vectors")
    items = json.loads((version / "items.json").read_text())
    (version / "items.json").write_text(json.dumps({**items, "labels": [7] * 12}))
    _rehash(version)
    refused("'labels' must hold strings or null; entry 0 is 7")
    (version / "embeddings.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}" * 8)
    _rehash(version)
    refused("embeddings.safetensors: not a readable safetensors file")
    manifest = json.loads((version / "manifest.json").read_text())
    manifest["files"]["../../escape.json"] = manifest["files"].pop("items.json")
    (version / "manifest.json").write_text(json.dumps(manifest))
    refused("lists files ['../../escape.json'] that are not index files")
    manifest = json.loads(pristine["manifest.json"])
    manifest["model"]["embedding_dim"] = 99
    (version / "manifest.json").write_text(json.dumps(manifest))
    refused("the model embeds in 99 dimensions but the embeddings have 16")
    (index_copy / "current").write_text("../index\n")
    refused("names '../index', which is not a version folder of this index")
    (index_copy / "current").write_text(version.name + "\n")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        # A string where a flag belongs would read as true: paths could leave the gallery root.
        ({"allow_outside_root": "no"}, "'allow_outside_root' must be true or false, got 'no'"),
        ({"vectors": "yes"}, "'vectors' must be true or false, got 'yes'"),
        ({"count": -1}, "'count' must be a non-negative integer, got -1"),
        ({"dim": True}, "'dim' must be a non-negative integer, got True"),
        ({"backend": "annoy"}, "unknown backend 'annoy' (valid: exact, faiss)"),
        ({"metric": "euclidean"}, "'metric' is 'euclidean'; an index searches by 'cosine'"),
        ({"faiss_factory": 32}, "'faiss_factory' must be a string or null, got 32"),
        ({"model": ["run"]}, "'model' must be an object or null, got ['run']"),
        ({"root": "gallery"}, "'root' must be an absolute folder path or null, got 'gallery'"),
        ({"normalize": True}, "unknown keys ['normalize'] (valid: allow_outside_root, backend,"),
        ({"dim": None, "drop": "dim"}, "manifest lacks 'dim'"),
    ],
)
def test_every_manifest_key_is_checked_when_an_index_is_read(
    tmp_path: Path, edit: dict[str, object], expected: str
) -> None:
    folder = Index.create(torch.eye(3), ids=["a", "b", "c"], root=tmp_path).save(tmp_path / "i")
    path = _version(folder) / "manifest.json"
    manifest = {**json.loads(path.read_text()), **edit}
    if "drop" in edit:
        del manifest[str(manifest.pop("drop"))]
    path.write_text(json.dumps(manifest))
    with pytest.raises(IndexFormatError) as refused:
        Index.load(folder)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and expected in message, message
    assert message.endswith("; rebuild the index") and "\n" not in message


def test_an_index_labelled_with_another_model_is_refused(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Embeddings of one model, a manifest naming another run (checksums and all): the images'
    embeddings cannot be rewritten, and a few are compared before any query is answered."""
    other = train_tiny(tmp_path, ["seed=7"])
    index_dir = tmp_path / "index"
    emb = tmp_path / "other.npz"
    assert (
        main(
            [
                "embed",
                "--checkpoint",
                str(other),
                "--images",
                str(world["gallery"]),
                "--out",
                str(emb),
                "--no-progress",
            ]
        )
        == 0
    )
    assert main(["index", str(emb), "--out", str(index_dir)]) == 0
    version = _version(index_dir)
    manifest = json.loads((version / "manifest.json").read_text())
    manifest["model"] = Encoder.from_run(world["run"]).info.to_dict()  # the wrong run's label
    (version / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["search", str(index_dir), str(world["gallery"] / "a" / "0.png")]) == 2
    err = _error(capsys)
    assert "is not what model" in err and "built with another model, or edited" in err


def test_a_faiss_file_that_is_not_one_is_named(index_copy: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("faiss")
    index = Index.create(torch.randn(20, 8), backend="faiss", faiss_factory="Flat")
    folder = index.save(tmp_path / "faiss-index")
    version = _version(folder)
    (version / "faiss.index").write_bytes(b"garbage" * 50)
    _rehash(version)
    with pytest.raises(IndexFormatError, match=r"faiss\.index: not a faiss index faiss can read"):
        Index.load(folder)


@pytest.mark.parametrize(
    ("k", "message"),
    [
        ("10000000000000", "must be between 1 and 1000"),
        ("0", "between 1 and"),
        ("1e13", "invalid int"),
    ],
)
def test_search_k_is_checked_before_anything_is_allocated(
    index_copy: Path, world: dict[str, Path], k: str, message: str, capsys
) -> None:
    with pytest.raises(SystemExit) if k == "1e13" else _nothing():
        code = main(["search", str(index_copy), str(world["gallery"]), "-k", k])
        assert code == 2
    assert message in _error(capsys)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


def test_zero_and_non_finite_queries_are_refused(index_copy: Path, tmp_path: Path, capsys) -> None:
    for values, message in (
        (np.zeros((2, 16)), "are all zero"),
        (np.full((1, 16), np.nan), "finite"),
    ):
        path = tmp_path / "q.npz"
        np.savez(path, embeddings=values.astype(np.float32))
        capsys.readouterr()
        assert main(["search", str(index_copy), str(path)]) == 2
        assert message in _error(capsys)


# --------------------------------------------------------------------------- paths and the root
def test_items_outside_the_gallery_root_need_an_opt_in(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listing = tmp_path / "lists" / "gallery.csv"
    listing.parent.mkdir()
    outside = world["gallery"] / "a" / "0.png"
    shutil.copy(outside, listing.parent / "inside.png")
    listing.write_text(f"inside.png,a\n{os.path.relpath(outside, listing.parent)},a\n")
    out = tmp_path / "index"
    args = ["index", str(listing), "--out", str(out), "--checkpoint", str(world["run"])]
    capsys.readouterr()
    assert main(args) == 2
    err = _error(capsys)
    assert "is outside the gallery root" in err and "--allow-outside-root" in err
    assert not out.exists()  # refused before the embedding pass, and no folder left behind
    assert main([*args, "--allow-outside-root"]) == 0
    index = Index.load(out)
    assert index.paths[0] == "inside.png"
    assert index.paths[1] is not None and index.paths[1].startswith("../")
    assert not any(Path(i).is_absolute() for i in index.ids)
    # --root declares a wider root: the same items are then inside it, no opt-in needed.
    wide = tmp_path / "wide"
    common = os.path.commonpath([listing, outside])
    assert main([*args, "--out", str(wide), "--root", common]) == 0
    assert not any(p is None or p.startswith("..") for p in Index.load(wide).paths)


def test_paths_leading_out_of_the_root_are_never_opened_or_shown(
    index_copy: Path, world: dict[str, Path]
) -> None:
    version = _version(index_copy)
    items = json.loads((version / "items.json").read_text())
    secret = world["root"] / "secret.png"
    shutil.copy(world["gallery"] / "a" / "0.png", secret)
    items["paths"][0] = "../secret.png"  # a tampered items.json, re-hashed
    (version / "items.json").write_text(json.dumps(items))
    _rehash(version)
    index = Index.load(index_copy)
    assert index.item_file(0) is None and index.item_file(1) is not None
    from idml.app.retrieval.output import result_records

    assert index.embeddings is not None  # an exact index keeps its vectors
    result = index.search(index.embeddings[:1], k=2)
    for style in ("absolute", "relative"):
        record = result_records(result, index, ["q"], item_paths=style)[0]
        assert record["neighbors"][0]["id"] == items["ids"][0]
        assert record["neighbors"][0]["path"] is None


# --------------------------------------------------------------------------- export
def test_an_export_folder_holds_one_model(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "other").mkdir()
    other = train_tiny(tmp_path / "other", ["seed=3"])
    a, b = tmp_path / "a", tmp_path / "b"
    base = ["export", "--format", "torchscript", "--checkpoint"]
    assert main([*base, str(world["run"]), "--out", str(a)]) == 0
    assert main([*base, str(other), "--out", str(b)]) == 0
    before = _snapshot(a)
    capsys.readouterr()
    assert main([*base, str(other), "--out", str(a)]) == 2  # not empty, no --overwrite
    err = _error(capsys)
    assert "already holds an export (export.json, model.pt)" in err and "--overwrite" in err
    assert _snapshot(a) == before
    # Another model's file copied in: refused on load, naming it.
    shutil.copy(b / "model.pt", a / "model.pt")
    with pytest.raises(ValueError, match=r"model\.pt does not belong to the export"):
        Encoder.load(a)
    # export.json naming a file outside the folder: never followed.
    meta = json.loads((a / "export.json").read_text())
    for name in ("../b/model.pt", str(b / "model.pt")):
        (a / "export.json").write_text(json.dumps({**meta, "torchscript": name}))
        with pytest.raises(ValueError, match="not a model file of an export"):
            Encoder.load(a)
    # --overwrite with one format removes the previous export's other files.
    (a / "model.onnx").write_bytes(b"an older export's ONNX")
    assert main([*base, str(other), "--out", str(a), "--overwrite"]) == 0
    assert sorted(p.name for p in a.iterdir()) == ["export.json", "model.pt"]
    assert Encoder.load(a).info.same_model(Encoder.load(b).info)
    # A folder holding anything else is not the export's to replace.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    assert main([*base, str(other), "--out", str(tmp_path / "c"), "--overwrite"]) == 2
    assert "holds files that are not an export's (notes.txt)" in _error(capsys)


def test_a_first_version_export_still_loads(world: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert (
        main(
            [
                "export",
                "--format",
                "torchscript",
                "--checkpoint",
                str(world["run"]),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    meta = json.loads((out / "export.json").read_text())
    del meta["files"]
    meta["version"] = 1
    (out / "export.json").write_text(json.dumps(meta))
    assert Encoder.load(out).info.embedding_dim == 16


# --------------------------------------------------------------------------- serve
def _served(app):
    """``app`` on an ephemeral loopback port, and an HTTP client of it."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("multipart")
    from idml.app.retrieval.server import BackgroundServer

    server = BackgroundServer(app)
    with server, httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(world: dict[str, Path]):
    pytest.importorskip("fastapi")
    from idml.app.retrieval.server import create_app

    index = Index.load(world["index"])
    app = create_app(index, Encoder.from_run(world["run"]), max_k=8, max_pixels=10_000)
    yield from _served(app)


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"embedding": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "nested 50001 levels"),
        (b'{"embedding": [0.1, 0.2], "k": 1e400}', 422, "'k' must be an integer"),
        (b'{"embedding": [0.1], "k": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),
        (b'{"embedding": [0.1], "k": ' + b"9" * 50 + b"}", 422, "a 50-digit number"),
        (b'{"embedding": [0.1], "k": true}', 422, "'k' must be an integer"),
        (b'{"embedding": [0.1], "k": 2.5}', 422, "'k' must be an integer"),
        (b'{"embedding": [' + b"0, " * 15 + b"0]}", 422, "not all zero"),
        (b'{"embedding": [' + b"1e400, " * 15 + b"1]}", 422, "finite"),
    ],
    ids=["depth", "k-inf", "k-5000-digits", "k-50-digits", "k-bool", "k-float", "zero", "inf"],
)
def test_hostile_json_requests(client, body: bytes, status: int, message: str) -> None:
    response = client.post("/search", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_an_image_above_the_pixel_limit_is_refused_from_its_header(client) -> None:
    bomb = _png(2000, 2000)  # 4 Mpx of zeros: a few KiB of PNG
    assert len(bomb) < 20_000
    response = client.post("/search", files={"image": ("bomb.png", bomb, "image/png")})
    assert response.status_code == 413
    assert "too large: 2000×2000 = 4000000 pixels, the limit is 10000" in response.json()["error"]
    ok = client.post("/search", files={"image": ("ok.png", _png(50, 50), "image/png")})
    assert ok.status_code == 200


def test_answers_and_info_reveal_no_server_path(client, world: dict[str, Path]) -> None:
    info = client.get("/info").json()
    text = json.dumps(info)
    assert str(world["root"]) not in text and "source" not in info["model"]
    assert info["paths"] == "relative" and info["max_pixels"] == 10_000
    vectors = Index.load(world["index"]).embeddings
    assert vectors is not None  # an exact index keeps its vectors
    emb = vectors[0].tolist()
    answer = client.post("/search", json={"embedding": emb, "k": 3}).json()
    assert str(world["root"]) not in json.dumps(answer)
    assert answer["results"][0]["neighbors"][0]["path"] == "gallery/a/0.png"


def test_ids_only_service(world: dict[str, Path]) -> None:
    pytest.importorskip("fastapi")
    from idml.app.retrieval.server import create_app

    index = Index.load(world["index"])
    assert index.embeddings is not None  # an exact index keeps its vectors
    for c in _served(create_app(index, None, paths="none")):
        answer = c.post("/search", json={"embedding": index.embeddings[0].tolist()}).json()
    assert {n["path"] for n in answer["results"][0]["neighbors"]} == {None}
    with pytest.raises(ValueError, match="max_k must be a positive integer"):
        create_app(index, None, max_k=0)


# --------------------------------------------------------------------------- report, training
def test_report_says_what_it_skipped_and_strict_fails(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Path(shutil.copytree(world["run"], tmp_path / "run"))
    model = run / "checkpoints" / "epoch_0001" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])  # truncated
    args = ["report", str(run), "--out", str(tmp_path / "rep"), "--no-progress"]
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "idml report: warning: skipped run: no test-set analysis" in err
    assert str(model) in err
    assert main([*args, "--strict"]) == 1
    assert "1 part(s) of the report were skipped (--strict)" in capsys.readouterr().err


def test_classification_ks_above_the_classes_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("name: c\n")
    args = ["train", str(config), "--out", str(tmp_path / "run"), "--no-progress"]
    for item in [*CLASSIFICATION, "eval.ks=[1, 20]", "eval.select=top20"]:
        args += ["--set", item]
    capsys.readouterr()
    assert main(args) == 2
    err = _error(capsys)
    assert "eval.ks=[1, 20] asks for top-20 accuracy but digits has 10 classes" in err
    assert "eval.select='top20'" in err and "eval.ks=[1]" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


# --------------------------------------------------------------------------- the sweep
def _sweep_cases(w: dict[str, Path], tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, what the one-line error must say) for every command."""
    cfg = tmp / "c.yaml"
    cfg.write_text("name: c\n")
    cycle_a, cycle_b = tmp / "a.yaml", tmp / "b.yaml"
    cycle_a.write_text(f"include: {cycle_b}\n")
    cycle_b.write_text(f"include: {cycle_a}\n")
    missing_fragment = tmp / "m.yaml"
    missing_fragment.write_text("include: method/nonexistent\n")
    blocker = tmp / "a_file"
    blocker.write_text("x")
    garbage = tmp / "garbage.npz"
    garbage.write_bytes(os.urandom(200))
    tiny = [x for item in TINY for x in ("--set", item)]
    index = str(w["index"])
    query = str(w["gallery"] / "a" / "0.png")
    return [
        (["train", str(cycle_a), "--out", str(tmp / "r1")], "include cycle"),
        (["train", str(missing_fragment), "--out", str(tmp / "r2")], "method/nonexistent"),
        (
            [
                "train",
                str(cfg),
                "--out",
                str(tmp / "r3"),
                *tiny,
                "--set",
                "data.dataset=omniglot",
                "--set",
                f"data.root={tmp / 'nowhere'}",
            ],
            str(tmp / "nowhere"),
        ),
        (
            ["train", str(cfg), "--out", str(tmp / "r4"), *tiny, "--set", "data.verify=maybe"],
            "data.verify",
        ),
        (["train", str(cfg), "--out", str(blocker / "run"), *tiny], f"{blocker} is a file"),
        (["evaluate", "--embeddings", str(garbage)], str(garbage)),
        (["evaluate", "--checkpoint", str(tmp / "no-run")], str(tmp / "no-run")),
        (
            [
                "embed",
                "--checkpoint",
                str(w["run"]),
                "--images",
                str(tmp / "none"),
                "--out",
                str(tmp / "e.npz"),
            ],
            f"{tmp / 'none'} does not exist",
        ),
        (
            [
                "embed",
                "--checkpoint",
                str(w["run"]),
                "--images",
                str(w["gallery"]),
                "--out",
                str(tmp / "e.txt"),
            ],
            "use a .npz, .pt or .safetensors",
        ),
        (
            ["index", str(w["gallery"]), "--out", index, "--checkpoint", str(w["run"])],
            "already holds an index; pass --add",
        ),
        (
            ["index", str(w["gallery"]), "--out", str(tmp / "nothing-here"), "--add"],
            "no such index folder",
        ),
        (
            ["index", str(w["gallery"]), "--out", str(blocker), "--checkpoint", str(w["run"])],
            f"{blocker} is a file",
        ),
        (
            ["search", index, str(tmp / "missing.png")],
            f"{tmp / 'missing.png'} does not exist",
        ),
        (["search", str(tmp), query], f"{tmp}: not an index"),
        (["search", index, query, "--out", str(tmp / "r.txt")], "use a .json or .csv"),
        (
            ["export", "--checkpoint", str(tmp / "no-run"), "--out", str(tmp / "x")],
            str(tmp / "no-run"),
        ),
        (
            [
                "export",
                "--checkpoint",
                str(w["run"]),
                "--out",
                str(tmp / "x"),
                "--format",
                "tflite",
            ],
            "export formats must be among",
        ),
        (["serve", str(tmp / "no-index")], "no such index folder"),
        (["serve", index, "--embeddings-only", "--max-k", "0"], "max_k must be a positive integer"),
        (["report", str(tmp / "no-run"), "--no-test"], str(tmp / "no-run")),
        (
            ["ablate", str(cfg), "--grid", "optim.nonsense=1,2", "--out", str(tmp / "ab")],
            "optim.nonsense",
        ),
        (["demo", "--out", str(blocker / "demo"), "--epochs", "1", "--no-report"], str(blocker)),
    ]


def test_every_command_gives_a_one_line_error_for_bad_input(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failures = []
    for argv, expected in _sweep_cases(world, tmp_path):
        capsys.readouterr()
        code = main(argv)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        ok = (
            code == 2
            and expected in err
            and "Traceback" not in err
            and lines
            and lines[0].startswith(f"idml {argv[0]}: error: ")
        )
        if not ok:
            failures.append(f"{' '.join(argv[:2])}: exit {code}: {err.strip()[-300:]}")
    assert not failures, "\n".join(failures)
    assert _snapshot(world["index"])  # the shared index is intact
    assert len(Index.load(world["index"])) == 12
