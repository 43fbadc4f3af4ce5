"""End-to-end training on scikit-learn's digits: every loss plain and with IDML, resume, configs, CLI."""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from idml.app.checkpoint import CheckpointError
from idml.app.cli import main
from idml.app.config import Config, ConfigError, load_config
from idml.app.trained_run import load_trained_model
from idml.app.training import Trainer
from idml.app.training.epoch_log import TrainResult
from idml.losses import LOSSES as REGISTERED_LOSSES
from idml.models import UncertaintyHead
from idml.models.heads import BoundedUncertaintyHead
from tiny_run import IDML, TINY

REPO = Path(__file__).resolve().parents[1]

LOSSES = [name for name, spec in REGISTERED_LOSSES.items() if not spec.probabilistic]
"""Every registered loss that IDML's metric applies to (PEL models uncertainty itself: its own test)."""


def run(tmp_path: Path, *overrides: str, name: str = "run") -> tuple[Trainer, TrainResult]:
    cfg = load_config(None, [*TINY, *overrides])
    trainer = Trainer(cfg, tmp_path / name, progress=False)
    return trainer, trainer.fit()


def assert_finite_log(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines, "no epoch was logged"
    for line in lines:
        losses = {k: v for k, v in line.items() if k.startswith("loss/")}
        assert losses and all(math.isfinite(v) for v in losses.values()), line
    return lines


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("variant", ["plain", "idml"])
def test_every_loss_trains_plain_and_with_idml(tmp_path: Path, loss: str, variant: str) -> None:
    extra = IDML if variant == "idml" else []
    _, result = run(tmp_path, f"loss.name={loss}", *extra)
    lines = assert_finite_log(result.run_dir)
    assert 0.0 <= result.final_metrics["recall@1"] <= 1.0
    if variant == "idml":
        # The log tracks ||u|| of original and of mixed images (paper Fig. 7).
        assert {"uncertainty/original", "uncertainty/mixed"} <= set(lines[-1])


def test_the_uncertainty_log_keeps_original_mixed_and_degraded_rows_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``uncertainty/original`` averages the rows no augmentation changed: a degraded row counted
    there would pull the originals' level towards the degraded one it is compared with."""
    from idml.app.training.step_values import StepValues

    masks: list[dict[str, torch.Tensor]] = []
    add_masked_mean = StepValues.add_masked_mean

    def spy(self: StepValues, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        if name == "u_original":
            masks.append({})
        masks[-1][name] = mask.clone()
        add_masked_mean(self, name, values, mask)

    monkeypatch.setattr(StepValues, "add_masked_mean", spy)
    _, result = run(tmp_path, *IDML, "degradations.occlusion_fraction=0.5")
    assert len(masks) == 2  # TINY's two steps
    for step in masks:
        assert step.keys() == {"u_original", "u_mixed", "u_degraded"}
        original, mixed, degraded = step["u_original"], step["u_mixed"], step["u_degraded"]
        assert bool(mixed.any()) and bool(degraded.any()) and bool(original.any())
        assert not bool((original & (mixed | degraded)).any())
        assert bool((original | mixed | degraded).all())
    last = assert_finite_log(result.run_dir)[-1]
    assert {"uncertainty/original", "uncertainty/mixed", "uncertainty/degraded"} <= set(last)


def test_pel_baseline_trains(tmp_path: Path) -> None:
    _, result = run(tmp_path, "loss.name=pel")
    assert_finite_log(result.run_dir)


@pytest.mark.parametrize(
    "extra",
    [
        ["mixup.enabled=true", "mixup.mode=interpolate"],
        ["degradations.blur_fraction=0.5", "degradations.occlusion_fraction=0.25"],
        ["metric.variant=dissimilar", *IDML],
        ["metric.variant=strict", *IDML, "loss.name=triplet"],
        ["metric.proxy_uncertainty=true", *IDML, "loss.name=proxy_anchor"],
    ],
    ids=["interpolate", "degradations", "ism-dis", "strict", "proxy-uncertainty"],
)
def test_variants_train(tmp_path: Path, extra: list[str]) -> None:
    _, result = run(tmp_path, *extra)
    assert_finite_log(result.run_dir)


@pytest.mark.parametrize("idml", [False, True], ids=["ssr", "ssr+idml"])
@pytest.mark.parametrize("update", ["joint", "alternating"])
def test_ssr_trains_with_and_without_idml(tmp_path: Path, idml: bool, update: str) -> None:
    extra = [
        "ssr.enabled=true",
        "ssr.task.p_task=1.0",
        "ssr.task.num_images=4",
        f"ssr.task.update={update}",
        "loss.name=multi_similarity",
    ]
    trainer, result = run(tmp_path, *extra, *(IDML if idml else []))
    line = assert_finite_log(result.run_dir)[-1]
    assert {"loss/ranking", "loss/ranking_sort", "loss/ranking_pos"} <= set(line)
    # The exported retrieval model holds no ranking head.
    _, model = load_trained_model(result.run_dir)
    assert not any("ranking" in k or k.startswith("head.") for k in model.state_dict())
    assert trainer.ssr is not None


def test_ssr_can_rank_images_drawn_from_the_whole_training_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idml.app import build
    from idml.data import dataset_length

    drawn: list[tuple[int, int, tuple[int, ...]]] = []
    real = build.sample_images

    def recording(
        dataset: torch.utils.data.Dataset, count: int, generator: torch.Generator
    ) -> torch.Tensor:
        images = real(dataset, count, generator)
        drawn.append((dataset_length(dataset, "the test"), count, tuple(images.shape)))
        return images

    monkeypatch.setattr(build, "sample_images", recording)
    extra = ["ssr.enabled=true", "ssr.task.p_task=1.0", "ssr.task.num_images=4"]
    trainer, result = run(tmp_path, *extra, "ssr.task.source=separate")
    assert "loss/ranking" in assert_finite_log(result.run_dir)[-1]
    # One draw of four training images per step, from the training set rather than the batch.
    train = trainer.data.train
    assert drawn == [(len(train), 4, (4, *train[0][0].shape))] * 2


def test_alternating_ssr_updates_the_amp_scale_once_per_backward(tmp_path: Path) -> None:
    # GradScaler contract: unscale and step every optimizer of a backward, then update() once.
    extra = ["ssr.enabled=true", "ssr.task.p_task=1.0", "ssr.task.num_images=4"]
    cfg = load_config(None, [*TINY, *extra, "ssr.task.update=alternating"])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    calls: list[str] = []
    real = trainer.scaler

    class Recorder:
        def scale(self, loss: torch.Tensor) -> torch.Tensor:
            return real.scale(loss)

        def unscale_(self, opt: torch.optim.Optimizer) -> None:
            calls.append("unscale")
            real.unscale_(opt)

        def step(self, opt: torch.optim.Optimizer) -> None:
            calls.append("step")
            real.step(opt)

        def update(self) -> None:
            calls.append("update")
            real.update()

    trainer.scaler = Recorder()  # type: ignore[assignment]  # a recording stand-in for the scaler
    trainer.cfg.optim.max_steps_per_epoch = 1
    trainer.fit()
    # Metric step (one optimizer), then the ranking step (metric + ranking optimizers).
    assert calls == ["unscale", "step", "update", "unscale", "step", "unscale", "step", "update"]


@pytest.mark.numerics
def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    common = ["optim.epochs=3", "loss.name=proxy_anchor", *IDML, "optim.scheduler=step"]
    common += ["optim.step_size=1", "optim.warmup_epochs=1"]
    _, full = run(tmp_path, *common, name="full")
    # "Interrupt" after epoch 2 by training a 2-epoch run, then resume it to 3 epochs.
    cfg2 = load_config(None, [*TINY, *common])
    part = Trainer(cfg2, tmp_path / "part", progress=False)
    part.cfg.optim.epochs = 2
    part.fit()
    cfg3 = load_config(None, [*TINY, *common])
    resumed = Trainer(cfg3, tmp_path / "part", progress=False).fit(resume=True)
    assert resumed.final_metrics == full.final_metrics
    a = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    b = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    timings = ("seconds", "eval_seconds")  # wall times differ between any two runs
    strip = [{k: v for k, v in json.loads(x).items() if k not in timings} for x in a]
    strip_b = [{k: v for k, v in json.loads(x).items() if k not in timings} for x in b]
    assert strip == strip_b


def test_resume_with_another_config_is_refused(tmp_path: Path) -> None:
    run(tmp_path, name="r")
    cfg = load_config(None, [*TINY, "model.embedding_dim=8"])
    with pytest.raises(ValueError, match="embedding_dim"):
        Trainer(cfg, tmp_path / "r", progress=False).fit(resume=True)


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path: Path) -> None:
    from idml.app.checkpoint import load_model_weights, resolve_checkpoint

    _, result = run(tmp_path, name="a")
    other = load_config(None, [*TINY, "model.embedding_dim=8"])
    from idml.app.build import build_model

    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_model_weights(resolve_checkpoint(result.run_dir), build_model(other))


def test_checkpoints_are_atomic_and_pruned(tmp_path: Path) -> None:
    _, result = run(tmp_path, "optim.epochs=3")
    root = result.run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "epoch_0003"  # epochs numbered from 1
    assert not list(root.glob("*.tmp"))
    kept = sorted(p.name for p in root.glob("epoch_*"))
    assert "epoch_0003" in kept and len(kept) <= 2


def _number_epochs_from_zero(run_dir: Path) -> None:
    """Rewrite a run folder as idml wrote it when epochs were numbered from 0: the log's epochs,
    the checkpoint folders and pointers, and ``state.json`` without ``epoch_base``."""
    log = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    log.write_text("".join(json.dumps({**x, "epoch": x["epoch"] - 1}) + "\n" for x in lines))
    root = run_dir / "checkpoints"
    for folder in sorted(root.glob("epoch_*")):
        number = int(folder.name.removeprefix("epoch_"))
        state = json.loads((folder / "state.json").read_text())
        del state["epoch_base"]
        state["epoch"] -= 1
        state["best_epoch"] -= 1
        state["metrics"]["epoch"] -= 1
        (folder / "state.json").write_text(json.dumps(state))
        folder.rename(root / f"epoch_{number - 1:04d}")
    for pointer in ("latest", "best"):
        number = int((root / pointer).read_text().strip().removeprefix("epoch_"))
        (root / pointer).write_text(f"epoch_{number - 1:04d}\n")


def test_a_run_numbered_from_zero_resumes_and_reads_numbered_from_one(tmp_path: Path) -> None:
    """Epochs are numbered from 1 in the log, the checkpoints and on screen; a run written when
    they were numbered from 0 resumes where it stopped and reads in the new numbering."""
    from idml.app.checkpoint import read_state, resolve_checkpoint
    from idml.app.reports import read_run

    _, result = run(tmp_path, "optim.epochs=2")
    assert [line["epoch"] for line in result.history] == [1, 2]
    assert result.best_epoch in (1, 2)
    _number_epochs_from_zero(result.run_dir)
    state = read_state(resolve_checkpoint(result.run_dir))
    assert state["epoch"] == 2 and state["best_epoch"] == result.best_epoch
    assert [line["epoch"] for line in read_run(result.run_dir).history] == [1, 2]

    # Epoch 2 (folder epoch_0001 then) stays the best: its folder must survive the pruning.
    root = result.run_dir / "checkpoints"
    latest = root / (root / "latest").read_text().strip()
    state = json.loads((latest / "state.json").read_text())
    state.update(best_value=1e9, best_epoch=1)
    (latest / "state.json").write_text(json.dumps(state))
    (root / "best").write_text(latest.name + "\n")

    cfg = load_config(None, [*TINY, "optim.epochs=3"])
    resumed = Trainer(cfg, result.run_dir, progress=False).fit(resume=True)
    assert resumed.best_epoch == 2
    assert [line["epoch"] for line in resumed.history] == [1, 2, 3]
    logged = [json.loads(x)["epoch"] for x in (result.run_dir / "metrics.jsonl").open()]
    assert logged == [1, 2, 3]  # the whole log rewritten in one numbering
    assert (root / "latest").read_text().strip() == "epoch_0003"
    assert read_state(root / "epoch_0003")["epoch"] == 3
    assert read_state(resolve_checkpoint(result.run_dir, "best"))["epoch"] == 2


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["optim.learnig_rate=0.1"])
    text = str(err.value)
    assert "optim.learnig_rate" in text and "lr" in text and "weight_decay" in text
    with pytest.raises(ConfigError, match="valid keys here: margin, name"):
        load_config(None, ["loss.name=triplet", "loss.alpha=2"])
    with pytest.raises(ConfigError, match=r"optim\.epochs"):
        load_config(None, ["optim.epochs=many"])


def test_uncertainty_init_std_reaches_the_head_and_is_validated() -> None:
    from idml.app import build

    linear = [*TINY, *IDML, "model.uncertainty.form=linear"]
    cfg = load_config(None, [*linear, "model.uncertainty.init_std=0.0"])
    model = build.build_model(cfg)
    x = torch.rand(3, 3, 8, 8)
    u = model(x).uncertainty
    assert u is not None and torch.count_nonzero(u) == 0  # zero weights, zero bias: ISM = plain
    default = build.build_model(load_config(None, linear))
    assert torch.count_nonzero(default(x).uncertainty) > 0
    for bad in ("-0.1", "nan", "small"):
        with pytest.raises(ConfigError, match=r"model\.uncertainty\.init_std"):
            load_config(None, [*linear, f"model.uncertainty.init_std={bad}"])


def test_uncertainty_head_errors_name_the_config_keys() -> None:
    from idml.app import build

    pel = [*TINY, "loss.name=pel", "model.embedding_dim=16"]
    model = build.build_model(load_config(None, pel))
    assert model.uncertainty_kind.value == "pel" and model.uncertainty_dim == 16
    with pytest.raises(ConfigError, match=r"^model\.uncertainty\.dim=8: .*embedding_dim=16.*PEL"):
        build.build_model(load_config(None, [*pel, "model.uncertainty.dim=8"]))
    linear = [*pel, "model.uncertainty.form=linear", "model.uncertainty.normalize=true"]
    with pytest.raises(ConfigError, match=r"^model\.uncertainty\.normalize=true: the PEL head"):
        build.build_model(load_config(None, linear))
    without = [*TINY, "model.uncertainty.enabled=false", "model.uncertainty.dim=8"]
    with pytest.raises(
        ConfigError, match=r"model\.uncertainty\.dim=8 is set but .* no uncertainty"
    ):
        build.build_model(load_config(None, without))


def test_uncertainty_lr_mult_gives_the_uncertainty_head_its_own_group(tmp_path: Path) -> None:
    common = [*TINY, *IDML, "optim.lr=0.01", "optim.head_lr_mult=10"]
    cfg = load_config(None, [*common, "optim.uncertainty_lr_mult=0.5"])
    trainer = Trainer(cfg, tmp_path / "own", progress=False)
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    unc = {id(p) for p in trainer.model.uncertainty_head_parameters()}
    assert unc and {id(p) for p in groups["uncertainty"]["params"]} == unc
    assert not unc & {id(p) for p in groups["heads"]["params"]}
    # One float64 product of the configured values each (0.01·0.5, 0.01·10): ≤ ε/2 from the
    # decimal, rel 1e-12 (approx's default 1e-6 was loose).
    assert groups["uncertainty"]["lr"] == pytest.approx(0.005, rel=1e-12)
    assert groups["heads"]["lr"] == pytest.approx(0.1, rel=1e-12)
    # Unset: one heads group as before (so earlier checkpoints' optimizer state still loads).
    default = Trainer(load_config(None, common), tmp_path / "default", progress=False)
    names = [g["name"] for g in default.optimizer.param_groups]
    assert "uncertainty" not in names
    heads = next(g for g in default.optimizer.param_groups if g["name"] == "heads")
    default_unc = {id(p) for p in default.model.uncertainty_head_parameters()}
    assert default_unc and default_unc <= {id(p) for p in heads["params"]}
    with pytest.raises(ConfigError, match=r"optim\.uncertainty_lr_mult"):
        load_config(None, [*common, "optim.uncertainty_lr_mult=-1"])


def test_eval_options_come_from_the_config() -> None:
    from idml.app import build

    cfg = load_config(None, [*TINY, "eval.nmi=true", "eval.nmi_backend=knn", "eval.ks=[1, 3]"])
    options = build.evaluation_options(cfg)
    assert options == {
        "ks": (1, 3),
        "introspective_metric": None,
        "nmi": True,
        "nmi_backend": "knn",
    }
    # ISM at test time only for a run trained with it, whatever is asked.
    ism_cfg = load_config(None, [*TINY, *IDML, "eval.introspective=true"])
    assert build.evaluation_options(ism_cfg)["introspective_metric"] is not None
    assert build.evaluation_options(cfg, introspective=True)["introspective_metric"] is None
    with pytest.raises(ConfigError, match=r"eval\.nmi_backend"):
        load_config(None, [*TINY, "eval.nmi_backend=kmeans"])


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  backbone: resnet18\n  embeding_dim: 64\n")
    with pytest.raises(ConfigError, match=r"(?s)model.embeding_dim.*embedding_dim.*bad.yaml"):
        load_config(path)


@pytest.mark.parametrize(
    "path", sorted(glob.glob(str(REPO / "configs" / "**" / "*.yaml"), recursive=True))
)
def test_every_preset_validates(path: str) -> None:
    cfg = load_config(path)
    assert cfg.name


def test_cli_train_embed_and_evaluate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text("\n".join(f"# {x}" for x in ["tiny digits run"]) + "\n")
    args = ["train", str(cfg_path), "--out", str(tmp_path / "run"), "--no-progress"]
    for item in [*TINY, *IDML]:
        args += ["--set", item]
    assert main(args) == 0
    assert "recall@1" in capsys.readouterr().out
    images = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (images / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(
                images / cls / f"{i}.png"
            )
    out = tmp_path / "emb.npz"
    assert (
        main(
            [
                "embed",
                "--checkpoint",
                str(tmp_path / "run"),
                "--images",
                str(images),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = np.load(out)
    assert data["embeddings"].shape == (6, 16)
    assert data["uncertainty"].shape == (6,) and (data["uncertainty"] > 0).all()
    # float32 norms of normalised 16-dim rows: ≲ 10ε ≈ 1.2e-6 at worst, inside atol 1e-5.
    assert np.allclose(np.linalg.norm(data["embeddings"], axis=1), 1, atol=1e-5)
    # `idml evaluate --checkpoint` scores the run's test split and agrees with the training log.
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run"), "--json"]) == 0
    scored = json.loads(_last_json(capsys))
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    # recall@1 is a count over the test split divided by its size: the same ranking gives the same
    # fraction up to a float32 rounding (ε/2); approx's default rel 1e-6 covers that, while one
    # changed neighbour would move it by 1/N ≫ 1e-6 (also below).
    assert scored["metrics"]["recall@1"] == pytest.approx(logged["test/recall@1"])
    assert "nmi" not in scored["metrics"]  # the run's eval.nmi=false
    # Evaluation flags that apply to a run override its config; naming a backend asks for NMI.
    run_dir = str(tmp_path / "run")
    args = [
        "evaluate",
        "--checkpoint",
        run_dir,
        "--json",
        "--nmi-backend",
        "knn",
        "--per-class",
        "1",
    ]
    assert main(args) == 0
    scored_again = json.loads(_last_json(capsys))
    # --per-class reaches the JSON as for files, keyed by the dataset's class names: the unseen
    # digits 5–9 (their labels on the test side are 0–4, which would name the wrong digits).
    assert scored_again["per_class_keys"] == "class names"
    assert set(scored_again["per_class"]) == {"5", "6", "7", "8", "9"}
    assert set(scored_again["uncertainty"]["per_class_mean"]) == {"5", "6", "7", "8", "9"}
    # --no-full-ranking reaches a run's evaluation too: the lists' metrics, the same R@1.
    assert main(["evaluate", "--checkpoint", run_dir, "--json", "--no-full-ranking"]) == 0
    lists = json.loads(_last_json(capsys))
    assert lists["settings"]["full_ranking"] is False and "map" not in lists["metrics"]
    assert lists["metrics"]["recall@1"] == scored["metrics"]["recall@1"]
    assert main(["evaluate", "--checkpoint", run_dir, "--per-class", "5"]) == 0
    table = capsys.readouterr().out
    assert "classes with the lowest recall@1 (by class name):" in table
    worst = table.split("(by class name):\n")[1].splitlines()[:5]  # then "confidence: …"
    assert sorted(line.split(":")[0].strip() for line in worst) == ["5", "6", "7", "8", "9"]
    with_nmi = scored_again["metrics"]
    assert 0.0 <= with_nmi["nmi"] <= 1.0
    assert with_nmi["recall@1"] == pytest.approx(logged["test/recall@1"])
    # File-only options are refused rather than silently ignored.
    assert main(["evaluate", "--checkpoint", run_dir, "--metric", "euclidean", "--tau", "2"]) == 2
    err = capsys.readouterr().err
    assert "--metric, --tau" in err and "--embeddings" in err


def test_embed_refuses_an_unknown_output_format_before_any_work(tmp_path: Path) -> None:
    from idml.app.trained_run import embed_images

    cfg = load_config(None, TINY)
    # No model and no images are needed to know that .txt cannot be written.
    with pytest.raises(ValueError, match=r"e\.txt: use a \.npz, \.pt or \.safetensors"):
        embed_images(cfg, None, tmp_path / "missing", tmp_path / "e.txt")  # type: ignore[arg-type]  # no model


def _last_json(capsys: pytest.CaptureFixture[str]) -> str:
    out = capsys.readouterr().out
    return out[out.index("{") :]


def test_cli_reports_config_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: -1\n")
    assert main(["train", str(path), "--out", str(tmp_path / "x")]) == 2
    assert "optim.lr" in capsys.readouterr().err


def test_demo_runs_with_a_small_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--epochs", "1", "--seeds", "2", "--out", str(tmp_path), "--no-progress"]
    assert main([*args, "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "IDML" in out and "recall@1" in out and "map@r" in out
    assert (
        "±" in out
        and "over 2 seed(s)" in out
        and "Δ [95 % CI]" in out
        and "Digits 0-4 train, unseen digits 5-9" in out
    )
    assert (tmp_path / "seed1" / "idml" / "metrics.jsonl").is_file()
    drift = next(line for line in out.splitlines() if line.startswith("||u|| of training images"))
    ratios = drift.split(": ", 1)[1].split(" (", 1)[0].split(", ")
    assert len(ratios) == 2 and all(float(r) > 0 for r in ratios), drift


def test_the_demo_reports_the_level_drift_once_instead_of_a_warning_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run's drift warning is filtered while the demo trains, and the table gives every IDML
    seed's ratio in one line; other warnings still reach the user."""
    import warnings

    from idml.app import demo
    from idml.app.training.level_probe import LevelDriftWarning

    class WarningTrainer:
        def __init__(self, cfg: Config, run_dir: Path, progress: bool) -> None:
            self.run_dir, self.idml = run_dir, cfg.metric.introspective

        def fit(self, overwrite: bool) -> TrainResult:
            warnings.warn("drifted", LevelDriftWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
            line = (
                {"uncertainty/original": 0.04, "uncertainty/eval_train": 0.1} if self.idml else {}
            )
            return TrainResult(self.run_dir, {"recall@1": 0.5}, {}, 1, [line])

    monkeypatch.setattr(demo, "Trainer", WarningTrainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = demo.run_demo(tmp_path, epochs=1, seeds=2, progress=False)
    assert [str(w.message) for w in caught] == ["something else"] * 4
    assert result.level_drift() == [pytest.approx(2.5)] * 2
    assert "IDML's last epoch: 2.50, 2.50 (a ratio beyond 2 either way" in result.table()


@pytest.mark.slow
def test_the_demo_report_tables_every_seed_and_draws_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["demo", "--epochs", "1", "--seeds", "2", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    page = (tmp_path / "report" / "index.html").read_text()
    # The seed table groups both seeds of each arm; only the first seed's runs get a section.
    seeds_csv = (tmp_path / "report" / "seeds.csv").read_text().splitlines()
    assert len(seeds_csv) == 3 and all(",2," in row for row in seeds_csv[1:]), seeds_csv
    assert page.count("<summary>Run ") == 2
    assert f"Folder {tmp_path / 'baseline'};" in page and f"Folder {tmp_path / 'idml'};" in page
    assert "seed1" not in "".join(line for line in page.splitlines() if "<summary>Run " in line)


@pytest.mark.slow
def test_training_beats_the_untrained_network_on_unseen_digits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    common = ["data.samples_per_class=null", "optim.max_steps_per_epoch=null", "optim.epochs=4"]
    common += ["loss.name=multi_similarity", "sampler.images_per_class=8", "optim.lr=0.003"]
    _, result = run(tmp_path, *common, "data.image_size=16", "model.embedding_dim=32")
    # Untrained: the same architecture and seed, evaluated before any step.
    cfg = load_config(None, [*TINY, *common, "data.image_size=16", "model.embedding_dim=32"])
    untrained = Trainer(cfg, tmp_path / "untrained", progress=False).evaluate()["recall@1"]
    assert result.final_metrics["recall@1"] > untrained + 0.03, (untrained, result.final_metrics)


@pytest.mark.parametrize("preset", ["official", "idml"])
def test_uncertainty_head_gradient_official_preset_versus_default(preset: str) -> None:
    """The released code L2-normalises u, so its ISM-ProxyAnchor gives the u head no gradient."""
    from idml.app import build

    path = (
        REPO
        / "configs"
        / (
            "official/cub_proxy_anchor_official.yaml"
            if preset == "official"
            else "idml/cub_proxy_anchor_idml.yaml"
        )
    )
    small = ["model.backbone=small_cnn", "model.pretrained=false", "model.embedding_dim=16"]
    cfg = load_config(path, small)
    torch.manual_seed(0)
    model = build.build_model(cfg)
    loss = build.build_loss(cfg, num_classes=4)
    images, labels = torch.rand(8, 3, 16, 16), torch.arange(8) % 4
    loss(model(images), labels).backward()
    # Against zero-uncertainty proxies only ||u|| matters: the bounded head's level learns.
    head = model.uncertainty_head
    if preset == "official":
        assert isinstance(head, UncertaintyHead)
        u_layer = head.linear
    else:
        assert isinstance(head, BoundedUncertaintyHead)
        u_layer = head.level
    u_grad = u_layer.weight.grad
    s_grad = model.semantic_head.linear.weight.grad
    assert u_grad is not None and s_grad is not None
    if preset == "official":
        # 0 analytically (β = ||û|| ≡ 1); float32 rounding in normalize's backward leaves ~1e-8 of
        # the semantic gradient here (a d-term cancellation is ≲ d·ε of the u head's upstream);
        # 1e-6 is far above that and far below the default head's > 1e-3.
        assert u_grad.norm() < 1e-6 * s_grad.norm()
    else:
        assert u_grad.norm() > 1e-3 * s_grad.norm()
