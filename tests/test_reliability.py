"""No lost work, no silent mistakes, errors that name the thing: the CLI under bad input and faults.

Each case checks the exit code, that the message names the file, key or value, and that nothing
that was there before was deleted or overwritten.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import idml.app.tasks.metric_learning as metric_learning_task
from idml.app import checkpoint
from idml.app.cli import main
from idml.app.config import load_config
from idml.app.run_folder import LOCK_FILE, claim_run_folder
from idml.app.training import Trainer
from idml.embeddings import Embeddings
from tiny_run import TINY


def _train_args(out: Path, config: Path, *extra: str) -> list[str]:
    args = ["train", str(config), "--out", str(out), "--no-progress"]
    for item in [*TINY, *extra]:
        args += ["--set", item]
    return args


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("name: tiny\n")
    return path


@pytest.fixture
def trained(tmp_path: Path, config: Path) -> Path:
    """A finished 2-epoch run."""
    out = tmp_path / "run"
    assert main(_train_args(out, config, "optim.epochs=2")) == 0
    return out


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- lost work
def test_training_into_a_run_needs_resume_or_overwrite(
    trained: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(trained)
    capsys.readouterr()
    assert main(_train_args(trained, config, "optim.epochs=2")) == 2
    err = capsys.readouterr().err
    assert str(trained) in err and "--resume" in err and "--overwrite" in err
    assert "epoch_0002" in err  # says what is there
    assert _snapshot(trained) == before


def test_overwrite_moves_the_old_run_aside(
    trained: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(trained)
    capsys.readouterr()
    assert main([*_train_args(trained, config, "optim.epochs=1"), "--overwrite"]) == 0
    out = capsys.readouterr().out
    aside = [p for p in trained.parent.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and str(aside[0]) in out
    assert _snapshot(aside[0]) == before  # every file of the old run, unchanged
    assert len((trained / "metrics.jsonl").read_text().splitlines()) == 1
    assert not (trained / LOCK_FILE).exists()


def test_resume_and_overwrite_together_are_refused(trained: Path, config: Path) -> None:
    before = _snapshot(trained)
    assert main([*_train_args(trained, config), "--resume", "--overwrite"]) == 2
    assert _snapshot(trained) == before


def test_a_second_writer_is_refused_naming_the_process(
    trained: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(trained)
    capsys.readouterr()
    # A live trainer (another process) holds the folder: a sleeping child stands in for it.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": child.pid, "host": os.uname().nodename, "started": 0.0}
        (trained / LOCK_FILE).write_text(json.dumps(lock))
        args = [*_train_args(trained, config, "optim.epochs=3"), "--resume"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"process {child.pid}" in err and str(trained) in err
        assert {k: v for k, v in _snapshot(trained).items() if k != LOCK_FILE} == before
    finally:
        child.kill()
        child.wait()
    # Its writer gone, the stale lock is taken over and the run continues.
    assert main([*_train_args(trained, config, "optim.epochs=3"), "--resume"]) == 0
    assert len((trained / "metrics.jsonl").read_text().splitlines()) == 3
    assert not (trained / LOCK_FILE).exists()


def test_two_trainers_on_one_folder_the_second_refused(tmp_path: Path, config: Path) -> None:
    out = tmp_path / "run"
    with claim_run_folder(out, resume=False, overwrite=False):  # the first trainer is writing
        assert main(_train_args(out, config)) == 2
        assert main([*_train_args(out, config), "--overwrite"]) == 2
    assert not (out / "metrics.jsonl").exists()
    assert main(_train_args(out, config)) == 0


def test_eval_select_is_checked_before_training(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_train_args(out, config, "eval.select=accuracy")) == 2
    err = capsys.readouterr().err
    assert "eval.select='accuracy'" in err and "recall@1" in err and "map@r" in err
    assert not out.exists() or not (out / "checkpoints").exists()  # no step was taken
    # nmi is only a metric when it is computed (TINY has eval.nmi=false).
    assert main(_train_args(out, config, "eval.select=nmi")) == 2
    assert main(_train_args(out, config, "eval.select=recall@2")) == 0


@pytest.mark.numerics
def test_resumed_cosine_run_with_more_epochs_follows_a_fresh_schedule(tmp_path: Path) -> None:
    common = [*TINY, "optim.scheduler=cosine", "optim.lr=0.001"]

    def lrs(run_dir: Path) -> list[float]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["lr/heads"] for line in lines]

    Trainer(load_config(None, [*common, "optim.epochs=4"]), tmp_path / "full", False).fit()
    Trainer(load_config(None, [*common, "optim.epochs=2"]), tmp_path / "part", False).fit()
    resumed = Trainer(load_config(None, [*common, "optim.epochs=4"]), tmp_path / "part", False)
    resumed.fit(resume=True)
    full, part = lrs(tmp_path / "full"), lrs(tmp_path / "part")
    # Epochs 1-2 ran under the 2-epoch schedule; epochs 3-4 run as in an uninterrupted 4-epoch
    # run. The same recursion on the same float64 base rates: equal, not close.
    assert part[:2] == [0.001, 0.0005]
    assert part[2:] == full[2:] and part[2] > 0
    assert resumed.scheduler is not None
    assert resumed.scheduler.state_dict()["T_max"] == 4


# --------------------------------------------------------------------------- silent mistakes
def test_a_diverging_run_stops_naming_the_step_and_writes_no_checkpoint(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "diverge"
    capsys.readouterr()
    # lr 1e30: the steps leave finite but huge weights; the test set's embeddings overflow.
    code = main(_train_args(out, config, "optim.lr=1e30"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "NaN or inf in the training batch's embeddings" in err and "learning rate" in err
    assert re.search(r"at epoch 1, step \d+; training stopped and no checkpoint was written", err)
    assert not (out / "checkpoints" / "latest").exists()  # no NaN weights were written
    # A rate whose AdamW step cannot even be represented in float32 is refused up front.
    assert main(_train_args(tmp_path / "other", config, "optim.lr=1e300")) == 2
    assert "optim.lr=1e+300" in capsys.readouterr().err


def test_divergence_after_a_good_epoch_leaves_that_epoch_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, [*TINY, "optim.epochs=2"])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    real = trainer.step

    def poisoned(*args, **kwargs):
        read = real(*args, **kwargs)
        if trainer.monitor.position == (1, 1):
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))
            trainer.check_finite_weights()
        return read

    monkeypatch.setattr(trainer, "step", poisoned)
    with pytest.raises(FloatingPointError, match=r"epoch 2, step 2.*epoch_0001\) stays latest"):
        trainer.fit()
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "epoch_0001"
    again = Trainer(cfg, tmp_path / "run", progress=False).fit(resume=True)
    assert len(again.history) == 2


def test_a_non_finite_test_set_embedding_names_the_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, [*TINY, "optim.epochs=2"])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    real = metric_learning_task.embed_dataset

    def overflowing(*args, **kwargs):
        emb, labels = real(*args, **kwargs)
        if trainer.monitor.position[0] == 1:  # the second epoch's evaluation
            semantic = emb.semantic.clone()
            semantic[3] = float("inf")
            return Embeddings(semantic, emb.uncertainty), labels
        return emb, labels

    monkeypatch.setattr(metric_learning_task, "embed_dataset", overflowing)
    with pytest.raises(FloatingPointError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "NaN or inf in the test-set embeddings" in message and "rows [3]" in message
    assert "after epoch 2; training stopped and the last good checkpoint (epoch_0001)" in message


def test_meaningless_settings_are_refused_or_warned(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_train_args(out, config, "data.resize_size=4")) == 2
    err = capsys.readouterr().err
    assert "data.resize_size=4" in err and "data.image_size=8" in err
    args = ["optim.head_lr_mult=0", "optim.backbone_lr_mult=0"]
    assert main(_train_args(out, config, *args)) == 2
    assert "nothing would train" in capsys.readouterr().err
    # A loss's own refusal (Contrastive's margins crossed) is a config error before the data loads.
    crossed = ["loss.name=contrastive", "loss.pos_margin=0.6"]
    assert main(_train_args(out, config, *crossed)) == 2
    err = capsys.readouterr().err
    assert "loss.name=contrastive" in err and "pos_margin 0.6 and neg_margin 0.5 cross" in err
    assert "Traceback" not in err
    with pytest.warns(UserWarning) as caught:
        assert main(_train_args(out, config, "optim.warmup_epochs=3", "data.resize_size=32")) == 0
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("optim.warmup_epochs=3 >= optim.epochs=1") for m in messages)
    assert any(m.startswith("data.resize_size=32 with data.image_size=8") for m in messages)
    assert any("central 6%" in m for m in messages)  # (8/32)² of the area


# --------------------------------------------------------------------------- errors name the thing
def test_checkpoint_write_failing_half_way_keeps_the_previous_checkpoint(
    trained: Path,
    config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real = checkpoint.write_new_files

    def disk_full(folder: Path, files: dict[str, bytes]) -> None:
        first = dict(list(files.items())[:1])
        real(folder, first)  # model.safetensors is written, training.safetensors hits a full disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "training.safetensors"))

    monkeypatch.setattr(checkpoint, "write_new_files", disk_full)
    capsys.readouterr()
    assert main([*_train_args(trained, config, "optim.epochs=3"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(trained / "checkpoints") in err
    assert re.search(
        r"\(\d[\d.]* (bytes|KiB|MiB) needed, .* free\)", err
    )  # the bytes the checkpoint needs
    assert "epoch_0002 stays latest" in err and "--resume" in err
    root = trained / "checkpoints"
    assert (root / "latest").read_text().strip() == "epoch_0002"
    assert not list(root.glob("*.tmp")) and not (root / "epoch_0003").exists()
    monkeypatch.setattr(checkpoint, "write_new_files", real)
    assert main([*_train_args(trained, config, "optim.epochs=3"), "--resume"]) == 0
    assert (root / "latest").read_text().strip() == "epoch_0003"


def test_non_finite_buffers_are_never_checkpointed(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lr 1e6: the loss and every weight stay finite but BatchNorm's running variances overflow;
    the checkpoint of that epoch is refused, naming the buffer, and the good one stays latest."""
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(_train_args(out, config, "optim.lr=1e6", "optim.epochs=2")) == 2
    err = capsys.readouterr().err
    assert re.search(r"NaN or inf in model\.backbone\.\S+\.running_var", err), err
    assert "after epoch 2" in err and "(epoch_0001) stays latest" in err and "optim.lr" in err
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "epoch_0001"
    assert not (root / "epoch_0002").exists() and not list(root.glob("*.tmp"))
    state = checkpoint.load_file(str(root / "epoch_0001" / checkpoint.MODEL_FILE))
    assert all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


@pytest.mark.parametrize("target", ["../../elsewhere", "/tmp", "..", ""])
def test_pointers_must_stay_inside_the_run(
    trained: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = trained.parent / "elsewhere"
    outside.mkdir(exist_ok=True)
    (outside / checkpoint.MODEL_FILE).write_bytes(b"")
    for which in ("latest", "best"):
        (trained / "checkpoints" / which).write_text(target + "\n")
        code = main(["evaluate", "--checkpoint", str(trained), "--which", which])
        err = capsys.readouterr().err
        assert code == 2 and f"checkpoint pointer {trained / 'checkpoints' / which}" in err


def test_a_pointer_through_a_link_out_of_the_run_is_refused(trained: Path) -> None:
    outside = trained.parent / "elsewhere"
    outside.mkdir()
    (trained / "checkpoints" / "epoch_9999").symlink_to(outside)
    (trained / "checkpoints" / "latest").write_text("epoch_9999\n")
    with pytest.raises(checkpoint.CheckpointPointerError, match="epoch_9999"):
        checkpoint.resolve_checkpoint(trained)


def test_state_without_config_and_out_below_a_file(
    trained: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = trained / "checkpoints" / "epoch_0002" / checkpoint.STATE_FILE
    data = json.loads(state.read_text())
    del data["config"]
    state.write_text(json.dumps(data))
    assert main(["evaluate", "--checkpoint", str(trained), "--which", "latest"]) == 2
    err = capsys.readouterr().err
    assert str(state) in err and "'config'" in err
    blocker = trained.parent / "a_file"
    blocker.write_text("x")
    assert main(_train_args(blocker / "run", config)) == 2
    assert f"{blocker} is a file" in capsys.readouterr().err


def test_binary_config_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)))
    assert main(["train", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not UTF-8" in err
    assert not (tmp_path / "run").exists()


def test_resume_names_a_corrupt_log_line_and_drops_a_cut_last_one(
    trained: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = trained / "metrics.jsonl"
    good = log.read_text()
    log.write_text(good + '{"epoch": 3, "ste')  # killed while logging an epoch never checkpointed
    assert main([*_train_args(trained, config, "optim.epochs=3"), "--resume"]) == 0
    assert [json.loads(x)["epoch"] for x in log.read_text().splitlines()] == [1, 2, 3]
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0][:10], *lines[1:]]) + "\n")
    capsys.readouterr()
    assert main([*_train_args(trained, config, "optim.epochs=4"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"line 1 of {log}" in err
    assert (trained / "checkpoints" / "latest").read_text().strip() == "epoch_0003"


def test_no_progress_prints_one_line_per_epoch(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_train_args(tmp_path / "run", config, "optim.epochs=2")) == 0
    out = capsys.readouterr().out.splitlines()
    epochs = [line for line in out if line.startswith("epoch ")]
    assert len(epochs) == 2 and epochs[0].startswith("epoch 1/2: loss ")
    assert "recall@1" in epochs[1] and "2 steps" in epochs[1]


def test_embed_honours_the_csv_split_and_gives_a_baseline_zero_uncertainty(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np
    from PIL import Image

    folder = trained.parent / "imgs"
    folder.mkdir()
    rows = []
    for i in range(5):
        Image.fromarray(np.full((12, 12, 3), 40 * i, np.uint8)).save(folder / f"{i}.png")
        rows.append(f"{i}.png,{i % 2},{'test' if i < 3 else 'train'}")
    index = folder / "index.csv"
    # A spreadsheet export: byte-order mark before the header.
    index.write_text("\ufeffpath,label,split\n" + "\n".join(rows) + "\n", encoding="utf-8")
    out = trained.parent / "emb.npz"
    args = ["embed", "--checkpoint", str(trained), "--images", str(index), "--out", str(out)]
    assert main([*args, "--split", "test"]) == 0  # TINY trains no uncertainty head
    data = np.load(out)
    assert data["embeddings"].shape == (3, 16) and (data["uncertainty"] == 0).all()
    assert [Path(p).name for p in data["paths"]] == ["0.png", "1.png", "2.png"]
    capsys.readouterr()
    assert main([*args, "--split", "val"]) == 2
    err = capsys.readouterr().err
    assert "'val'" in err and "splits: ['test', 'train']" in err
    assert main([*args, "--split", "test", "--images", str(folder)]) == 2


def test_csv_root_that_is_a_folder_is_named(tmp_path: Path, config: Path) -> None:
    from idml.data.loaders import load_csv

    with pytest.raises(FileNotFoundError, match=f"data.root {tmp_path} is a folder"):
        load_csv(tmp_path)


@pytest.mark.parametrize(
    ("mode", "value", "expected"),
    [
        ("I;16", 30000, round(30000 * 255 / 65535)),  # 16-bit grey: scaled, not clipped to 255
        ("I", 30000, round(30000 * 255 / 65535)),  # how Pillow opens 16-bit TIFFs and some PNGs
        ("F", 0.5, 128),  # float in [0, 1]
    ],
)
def test_wide_pixel_modes_keep_their_range(
    tmp_path: Path, mode: str, value: float, expected: int
) -> None:
    import numpy as np
    from PIL import Image

    from idml.data.datasets import decode_image_file

    dtype = {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]
    image = Image.fromarray(np.full((4, 5), value, dtype))
    if image.mode != mode:
        image = image.convert(mode)
    suffix = ".png" if mode == "I;16" else ".tif"  # PNG cannot store modes I and F
    path = tmp_path / f"grey{suffix}"
    image.save(path)
    with Image.open(path) as opened:
        assert opened.mode in ("I;16", "I", "F"), opened.mode  # the file really is wide
    pixels = decode_image_file(str(path), 3)
    assert pixels.shape == (3, 4, 5) and pixels.unique().tolist() == [expected]


@pytest.mark.parametrize("mode", ["P", "CMYK", "RGBA", "LA", "1"])
def test_other_pillow_modes_convert_as_pillow_does(tmp_path: Path, mode: str) -> None:
    import numpy as np
    from PIL import Image

    from idml.data.datasets import decode_image_file

    rgb = Image.fromarray(np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3) * 5)
    image = rgb.convert(mode)
    path = tmp_path / ("x.tif" if mode == "CMYK" else "x.png")
    image.save(path)
    with Image.open(path) as opened:
        expected = np.asarray(opened.convert("RGB")).transpose(2, 0, 1)
    assert np.array_equal(decode_image_file(str(path), 3).numpy(), expected)


def test_data_verify_skips_corrupt_images_counted_and_reported(
    tmp_path: Path,
    config: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import numpy as np
    from PIL import Image

    rows = ["path,label,split"]
    for c in range(6):
        for i in range(4):
            name = f"c{c}_{i}.png"
            Image.fromarray(np.full((10, 10, 3), 30 * c + i, np.uint8)).save(tmp_path / name)
            rows.append(f"{name},{c},{'train' if c < 3 else 'test'}")
    (tmp_path / "c0_1.png").write_bytes(b"not a png")
    index = tmp_path / "index.csv"
    index.write_text("\n".join(rows) + "\n")
    data = ["data.dataset=csv", f"data.root={index}", "sampler.classes_per_batch=2"]
    data += ["sampler.images_per_class=2", "data.samples_per_class=null"]
    out = tmp_path / "run"
    assert main(_train_args(out, config, *data, "data.verify=raise")) == 2
    err = capsys.readouterr().err
    assert "c0_1.png" in err and "data.verify=skip" in err
    with caplog.at_level("WARNING"):
        assert main(_train_args(out, config, *data, "data.verify=skip")) == 0
    assert "1 of 12 images cannot be read" in caplog.text and "c0_1.png" in caplog.text


def test_image_size_override_rescales_a_recipe_resize() -> None:
    preset = "configs/idml/cub_proxy_anchor_idml.yaml"  # image_size 224, resize_size 256
    assert load_config(preset, ["data.image_size=64"]).data.resize_size == 73
    assert load_config(preset, ["data.image_size=64", "data.resize_size=64"]).data.resize_size == 64
    # A resize that did not follow the recipe's ratio was chosen on purpose and stays.
    assert load_config(None, ["data.resize_size=300", "data.image_size=64"]).data.resize_size == 300


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("device=tpu", "device"),
        ("seed=-1", "seed"),
        ("data.image_size=1", "data.image_size=1"),
        ("optim.lr=1e300", "optim.lr"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(
    tmp_path: Path, config: Path, setting: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_train_args(tmp_path / "run", config, setting)) == 2
    err = capsys.readouterr().err
    assert err.startswith("idml train: error: ") and named in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_corrupt_image_in_a_loader_worker_is_one_line_naming_the_file(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np
    from PIL import Image

    rows = ["path,label,split"]
    for c in range(6):
        for i in range(4):
            Image.fromarray(np.full((10, 10, 3), 9 * c + i, np.uint8)).save(
                tmp_path / f"{c}{i}.png"
            )
            rows.append(f"{c}{i}.png,{c},{'train' if c < 3 else 'test'}")
    for i in range(4):  # every image of class 0: the first batch meets one
        (tmp_path / f"0{i}.png").write_bytes(b"\x89PNG broken")
    index = tmp_path / "index.csv"
    index.write_text("\n".join(rows) + "\n")
    data = ["data.dataset=csv", f"data.root={index}", "sampler.classes_per_batch=3"]
    data += ["sampler.images_per_class=2", "data.samples_per_class=null", "data.num_workers=1"]
    assert main(_train_args(tmp_path / "run", config, *data)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(r"cannot decode image \S+/0[0-3]\.png", err)
    assert "DataLoader worker" not in err and "data.verify=skip" in err


@pytest.mark.parametrize(
    ("name", "message"),
    [("labels.npy", "holds strings"), ("evil.pt", "refused to load"), ("g.safetensors", "not a")],
)
def test_unreadable_evaluation_inputs_are_one_line_errors(
    tmp_path: Path, name: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np

    emb = tmp_path / "e.npy"
    np.save(emb, np.random.default_rng(0).random((6, 4), dtype=np.float32))
    path = tmp_path / name
    if name == "labels.npy":
        np.save(path, np.array(["a", "b", "a", "b", "c", "c"]))
        args = ["--embeddings", str(emb), "--labels", str(path)]
    elif name == "evil.pt":
        torch.save({"embeddings": _Pickled()}, path)  # a class: weights_only refuses it
        args = ["--embeddings", str(path)]
    else:
        path.write_bytes(b"garbage" * 10)
        args = ["--embeddings", str(path)]
    assert main(["evaluate", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and message in err


class _Pickled:
    """An arbitrary Python object: a .pt file holding it must never be unpickled."""


def test_report_out_below_a_file_is_named(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = trained.parent / "not_a_folder"
    blocker.write_text("x")
    assert main(["report", str(trained), "--out", str(blocker / "rep"), "--no-test"]) == 2
    assert f"{blocker} is a file" in capsys.readouterr().err
