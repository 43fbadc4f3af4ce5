"""Classification task: introspective cosine classifier, CutMix, λ-weighted set labels, metrics,
data splits, config validation and a tiny training run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from idml.app.config import ConfigError, load_config
from idml.app.training import Trainer
from idml.augment import AugmentedBatch, CutMix, Mixup, cutmix_boxes
from idml.classification import BatchMixing, IntrospectiveClassifier, mixed_targets
from idml.data.classification import load_classification_split
from idml.embeddings import Embeddings
from idml.evaluation.classification import (
    classification_metrics,
    expected_calibration_error,
    topk_accuracy,
)
from idml.losses import NormalizedSoftmaxLoss
from idml.metrics import CosineSimilarity, IntrospectiveMetric
from tiny_run import CLASSIFICATION


def _pair(scale: float = 16.0, gamma: float = 0.0):
    torch.manual_seed(0)
    plain = NormalizedSoftmaxLoss(5, 8, CosineSimilarity(), temperature=1.0 / scale)
    ism = IntrospectiveClassifier(
        5, 8, IntrospectiveMetric(CosineSimilarity(), gamma=gamma, tau=5.0), scale=scale
    )
    ism.load_state_dict(plain.state_dict())
    return plain, ism


# --------------------------------------------------------------------------- classifier
@pytest.mark.parametrize("scale", [16.0, 30.0, 7.3])
def test_ism_logits_equal_normalised_softmax_at_zero_uncertainty(scale: float) -> None:
    plain, ism = _pair(scale)
    semantic = torch.randn(6, 8)
    emb = Embeddings(semantic, torch.zeros(6, 8))
    # γ = 0 and u = 0 give y = 0 and S_IN = C + (C − 1)·expm1(0) = C bit for bit.
    assert torch.equal(ism.logits(emb), plain.logits(Embeddings(semantic)))


def test_classifier_loss_is_pytorch_cross_entropy() -> None:
    _, ism = _pair()
    emb = Embeddings(torch.randn(6, 8), torch.zeros(6, 8))
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    logits = ism.logits(emb)
    expected = F.cross_entropy(logits, labels)
    # float32 log-softmax of |z| <= 16 then a mean of 6 terms: the two reductions may differ in
    # summation order, a few ulps of a value near 2 (2.4e-7 each).
    rtol, atol = 0, 2e-6
    torch.testing.assert_close(
        ism.soft_loss(emb, F.one_hot(labels, 5).float()), expected, rtol=rtol, atol=atol
    )
    torch.testing.assert_close(ism(emb, labels), expected, rtol=rtol, atol=atol)
    soft = torch.softmax(torch.randn(6, 5), dim=1)
    torch.testing.assert_close(
        ism.soft_loss(emb, soft), F.cross_entropy(logits, soft), rtol=rtol, atol=atol
    )


def test_uncertainty_flattens_logits_but_keeps_their_order() -> None:
    _, ism = _pair(gamma=0.5)
    semantic = torch.randn(6, 8)
    certain = ism.logits(Embeddings(semantic, torch.zeros(6, 8)))
    unsure = ism.logits(Embeddings(semantic, torch.randn(6, 8) * 3))
    spread = lambda z: z.max(dim=1).values - z.min(dim=1).values  # noqa: E731
    assert bool((spread(unsure) < spread(certain)).all())
    # S_IN is increasing in C for a fixed image uncertainty (proxies carry none): same ranking.
    assert torch.equal(unsure.argsort(dim=1), certain.argsort(dim=1))


def test_classifier_rejects_bad_targets_and_scale() -> None:
    _, ism = _pair()
    with pytest.raises(ValueError, match=r"targets must have shape \(2, 5\)"):
        ism.soft_loss(Embeddings(torch.randn(2, 8)), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="scale"):
        IntrospectiveClassifier(3, 8, scale=0.0)


# --------------------------------------------------------------------------- CutMix
def test_cutmix_box_hand_cases() -> None:
    lam = torch.tensor([0.75, 0.75, 0.0, 1.0])
    y1, y2, x1, x2, kept = cutmix_boxes(
        10, 10, lam, torch.tensor([5, 0, 5, 5]), torch.tensor([5, 0, 5, 5])
    )
    # side ⌊10·√0.25⌋ = 5, half 2: [3, 7) centred; clipped to [0, 2) at the corner; λ = 0 cuts the
    # whole image ([0, 10) around 5), λ = 1 nothing.
    assert y1.tolist() == [3, 0, 0, 5] and y2.tolist() == [7, 2, 10, 5]
    assert x1.tolist() == [3, 0, 0, 5] and x2.tolist() == [7, 2, 10, 5]
    assert kept.tolist() == [1 - 16 / 100, 1 - 4 / 100, 0.0, 1.0]


def test_cutmix_pastes_the_partner_and_reports_its_pixel_share() -> None:
    images = torch.stack([torch.full((3, 12, 9), v) for v in (0.0, 0.25, 0.5, 1.0)])
    labels = torch.tensor([0, 1, 2, 3])
    batch = CutMix()(images, labels, torch.Generator().manual_seed(3))
    info = batch.mixup
    assert info is not None and batch.images.shape[0] == 8 and int(batch.mixed.sum()) == 4
    for k, row in enumerate(batch.mixed.nonzero().flatten().tolist()):
        a, b = int(info.index_a[k]), int(info.index_b[k])
        mixed = batch.images[row]
        from_a = (mixed == images[a]).all(dim=0).double().mean()
        if a != b:
            # The pixel share is an exact count over 108 pixels (float64); λ' is the same fraction
            # rounded to float32, ≤ ε/2 ≈ 6e-8 away: abs 1e-6 (one pixel is 1/108 ≈ 9e-3).
            assert float(from_a) == pytest.approx(float(info.lam[k]), abs=1e-6)
            assert bool(((mixed == images[a]) | (mixed == images[b])).all())
        assert batch.labels.labels[row].tolist() == (
            [int(labels[a]), -1] if a == b else [int(labels[a]), int(labels[b])]
        )


# --------------------------------------------------------------------------- set-label targets
def test_mixed_targets_weight_both_classes_by_lambda() -> None:
    images = torch.rand(4, 3, 8, 8)
    labels = torch.tensor([0, 1, 2, 2])
    batch = Mixup()(images, labels, torch.Generator().manual_seed(0))
    targets = mixed_targets(batch, 3)
    info = batch.mixup
    assert info is not None
    # float32 λ + (1 − λ): two roundings, ≤ ε ≈ 1.2e-7, inside assert_close's float32 defaults.
    torch.testing.assert_close(targets.sum(dim=1), torch.ones(8))
    assert torch.equal(targets[:4], F.one_hot(labels, 3).float())
    for k in range(4):
        row = targets[4 + k]
        a, b, lam = int(info.labels_a[k]), int(info.labels_b[k]), float(info.lam[k])
        if a == b:
            assert row[a] == 1
        else:
            # float32 λ·1 is λ exactly; 1 − λ is rounded once (≤ ε/2 relative) on each side:
            # inside approx's default rel 1e-6.
            assert float(row[a]) == pytest.approx(lam) and float(row[b]) == pytest.approx(1 - lam)


def test_batch_mixing_replaces_appends_or_skips() -> None:
    images, labels = torch.rand(6, 3, 8, 8), torch.arange(6) % 3
    gen = torch.Generator().manual_seed(0)
    replaced = BatchMixing(CutMix())(images, labels, gen)
    assert replaced.images.shape[0] == 6 and bool(replaced.mixed.all())
    assert mixed_targets(replaced, 3).shape == (6, 3)
    appended = BatchMixing(Mixup(), keep_originals=True)(images, labels, gen)
    assert appended.images.shape[0] == 12 and int(appended.mixed.sum()) == 6
    skipped = BatchMixing(Mixup(), probability=0.0)(images, labels, gen)
    assert torch.equal(skipped.images, images) and skipped.mixup is None
    with pytest.raises(ValueError, match="probability"):
        BatchMixing(Mixup(), probability=1.5)


def test_mixed_targets_refuse_inconsistent_batches() -> None:
    batch = AugmentedBatch.unchanged(torch.rand(2, 3, 4, 4), torch.tensor([0, 1]))
    broken = AugmentedBatch(
        batch.images, batch.labels, torch.tensor([False, True]), batch.degraded, None
    )
    with pytest.raises(ValueError, match="1 mixed rows"):
        mixed_targets(broken, 2)


# --------------------------------------------------------------------------- metrics
def test_topk_and_ece_hand_cases() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 3.0, 2.0], [1.0, 2.0, 3.0], [3.0, 1.0, 2.0]])
    labels = torch.tensor([0, 2, 1, 1])
    assert topk_accuracy(logits, labels, (1, 2, 3)) == {1: 0.25, 2: 0.75, 3: 1.0}
    # Two classes, confidence 0.8 everywhere (logit gap log 4), 3 of 4 right: one bin,
    # |0.75 − 0.8| = 0.05; float64 softmax of log 4: rounding ~1e-16.
    gap = float(np.log(4.0))
    two = torch.tensor([[gap, 0.0]] * 4, dtype=torch.float64)
    assert expected_calibration_error(two, torch.tensor([0, 0, 0, 1])) == pytest.approx(
        0.05, abs=1e-12
    )
    metrics = classification_metrics(logits, labels)
    assert set(metrics) == {"top1", "ece", "nll"}  # top5 needs at least 5 classes
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.2"):
        topk_accuracy(logits, torch.tensor([0, 1, 2, 3]))


def test_classify_dataset_measures_what_its_settings_ask() -> None:
    from torch.utils.data import TensorDataset

    from idml.classification import ClassifierEvaluationSettings, classify_dataset
    from idml.models import build_model

    torch.manual_seed(0)
    model = build_model("small_cnn", pretrained=False, embedding_dim=8, uncertainty=True)
    classifier = IntrospectiveClassifier(3, 8, CosineSimilarity())
    n = 6
    data = TensorDataset(torch.rand(n, 3, 8, 8), torch.arange(n) % 3, torch.arange(n))

    def metrics(settings: ClassifierEvaluationSettings | None) -> dict[str, float]:
        outputs = classify_dataset(
            model, classifier, data, 4, torch.device("cpu"), introspective=True, settings=settings
        )
        s = settings or ClassifierEvaluationSettings()
        return outputs.metrics(s.ks, s.ece_bins)

    probes = {"u_clean", "u_mixup", "u_cutmix", "u_lowres"}
    assert set(metrics(None)) == {"top1", "ece", "nll"} | probes  # top5 needs 5 classes
    plain = ClassifierEvaluationSettings(ks=[1, 2], ece_bins=5, uncertainty_probes=False)
    assert plain.ks == (1, 2)
    assert set(metrics(plain)) == {"top1", "top2", "ece", "nll"}
    seeded = ClassifierEvaluationSettings(seed=3)
    assert metrics(seeded) == metrics(seeded)  # the probes repeat for one seed


# --------------------------------------------------------------------------- data
def _write_images(folder: Path, count: int, value: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.fromarray(np.full((6, 6, 3), value + i, dtype=np.uint8)).save(folder / f"{i}.png")


def test_folder_layouts_and_csv(tmp_path: Path) -> None:
    for side, n in (("train", 3), ("val", 2)):
        for c, name in enumerate(("n01", "n02")):
            _write_images(tmp_path / "imagenet" / side / name, n, 40 * c)
    split = load_classification_split("folder", tmp_path / "imagenet")
    assert (len(split.train), len(split.test), split.test.class_names) == (6, 4, ("n01", "n02"))
    for c, name in enumerate(("cat", "dog")):
        _write_images(tmp_path / "flat" / name, 5, 40 * c)
    flat = load_classification_split("folder", tmp_path / "flat", test_fraction=0.4)
    assert (len(flat.train), len(flat.test)) == (6, 4)
    rows = ["path,label,split"] + [
        f"flat/{name}/{i}.png,{name},{'test' if i == 0 else 'train'}"
        for name in ("cat", "dog")
        for i in range(5)
    ]
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    table = load_classification_split("csv", tmp_path / "list.csv")
    assert (len(table.train), len(table.test), table.num_classes) == (8, 2, 2)


def test_split_needs_every_class_on_both_sides(tmp_path: Path) -> None:
    _write_images(tmp_path / "train" / "a", 2, 0)
    _write_images(tmp_path / "train" / "b", 2, 9)
    _write_images(tmp_path / "val" / "a", 2, 0)
    with pytest.raises(ValueError, match=r"every class on both sides; only in train: b"):
        load_classification_split("folder", tmp_path)
    with pytest.raises(ValueError, match=r"data\.dataset='cub' has no classification split"):
        load_classification_split("cub", tmp_path)


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task.scale=8"], r"^unknown key 'task\.scale'"),
        (
            ["task=classification", "loss.name=multi_similarity"],
            r"^loss\.name: task classification does not read this key \(it reads no loss\.\* "
            r"key\); remove it or set task\.name to metric_learning",
        ),
        (["task=classification", "loss.alpha=8"], r"^loss\.alpha: task classification does not"),
        (["task=classification", "mixup.fraction=0.5"], r"^mixup\.fraction: .*mixup\.probability"),
        (["task=classification", "ssr.enabled=true"], r"^ssr\.enabled: task classification"),
        (["task=classification", "eval.nmi=false"], r"^eval\.nmi: task classification"),
        (["task=classification", "data.protocol=validation"], r"^data\.protocol: task class"),
        (
            ["task=classification", "data.validation_order=last_groups"],
            r"^data\.validation_order: task class",
        ),
        (["task=classification", "data.dataset=cub"], r"^data\.dataset=cub: a zero-shot"),
        (["mixup.probability=0.5"], r"^mixup\.probability: task metric_learning does not read"),
        (["task=classification", "task.scalee=3"], r"unknown key 'task\.scalee'"),
        (["task=classification", "mixup.kind=cutout"], r"^mixup\.kind: "),
        (["task=regression"], r"^task\.name: .*\n  valid task names: metric_learning, classif"),
        (["classification.mix=cutmix"], r"classification\.mix -> mixup\.enabled and mixup\.kind"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_classification_defaults_round_trip() -> None:
    from idml.app.config import config_to_dict, validate_config

    cfg = load_config(None, ["task=classification"])
    # The task's defaults fragment: random batches, top-1/top-5, the best epoch by top-1.
    assert (cfg.eval.select, cfg.sampler.kind, cfg.eval.ks) == ("top1", "random", [1, 5])
    assert cfg.task.name == "classification" and cfg.mixup.enabled is False
    stored = config_to_dict(cfg)
    assert "loss" not in stored and "ssr" not in stored and "fraction" not in stored["mixup"]
    assert validate_config(stored) == cfg  # a run's config.yaml reloads (resume)
    explicit = load_config(None, ["task=classification", "sampler.kind=balanced"])
    assert explicit.sampler.kind == "balanced"
    metric = load_config(None)
    assert (
        metric.task.name == "metric_learning" and validate_config(config_to_dict(metric)) == metric
    )
    assert "probability" not in config_to_dict(metric)["mixup"]


def test_a_run_stored_before_tasks_had_a_section_still_loads() -> None:
    """A config.yaml of the old schema wrote every key, the classification section included."""
    from idml.app.config import validate_config
    from idml.app.tasks.classification import ClassificationParams

    old = {
        "name": "old",
        "task": "classification",
        "data": {"dataset": "digits", "protocol": "test", "validation_classes": 0.25},
        "loss": {"name": "proxy_anchor", "alpha": 32.0, "margin": 0.1},
        "mixup": {"enabled": False, "alpha": 1.0, "fraction": 1.0, "mode": "set"},
        "ssr": {"enabled": False},
        "eval": {"ks": [1, 2, 4, 8], "nmi": True, "select": "top1", "batch_size": 64},
        "classification": {
            "scale": 20.0,
            "mix": "cutmix",
            "mix_alpha": 0.5,
            "mix_prob": 0.5,
            "keep_originals": True,
            "test_fraction": 0.3,
            "test_samples_per_class": None,
            "ks": [1, 3],
            "ece_bins": 10,
            "uncertainty_probes": False,
        },
    }
    cfg = validate_config(old)
    task = cfg.task
    assert isinstance(task, ClassificationParams)
    assert (task.name, task.scale, task.ece_bins) == ("classification", 20.0, 10)
    m = cfg.mixup
    assert (m.enabled, m.kind, m.alpha, m.probability, m.keep_originals) == (
        True,
        "cutmix",
        0.5,
        0.5,
        True,
    )
    assert (cfg.eval.ks, cfg.eval.batch_size) == ([1, 3], 64)
    metric = validate_config({"task": "metric_learning", "classification": None})
    assert metric.task.name == "metric_learning"


def test_method_fragments_mean_the_same_for_both_tasks() -> None:
    from idml.app.ablation import expand_grid, parse_grid
    from idml.app.config import fragment_overrides

    idml = fragment_overrides("method/idml")
    for task in ("metric_learning", "classification"):
        cfg = load_config(None, [f"task={task}", *idml])
        assert cfg.mixup.enabled and cfg.metric.introspective and cfg.model.uncertainty.enabled
    # An ablation's method axis on a classification config: SSR, which the task does not have,
    # is left alone rather than switched off.
    base = load_config(None, ["task=classification"])
    cells = expand_grid(parse_grid(["method=baseline,idml"]), base)
    for cell in cells:
        assert not any(o.startswith("ssr.") for o in cell.overrides)
        cfg = load_config(None, ["task=classification", *cell.overrides])
        is_idml = "idml" in cell.name.lower()
        assert cfg.metric.introspective == cfg.mixup.enabled == is_idml
    mixes = expand_grid(parse_grid(["metric=plain,ism", "mix=none,cutmix"]), base)
    kinds = {load_config(None, ["task=classification", *c.overrides]).mixup.kind for c in mixes}
    assert len(mixes) == 4 and "cutmix" in kinds


# --------------------------------------------------------------------------- training
TINY = [
    *CLASSIFICATION,
    "model.embedding_dim=32",
    "sampler.batch_size=64",
    "optim.lr=0.003",
    "optim.proxy_lr_mult=1",
]


@pytest.mark.slow
def test_tiny_run_beats_chance_on_digits(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, "optim.epochs=3", "mixup.enabled=true", "mixup.kind=cutmix"])
    result = Trainer(cfg, tmp_path / "run", progress=False).fit()
    # Chance is 10 % on the 10 balanced digit classes (359 test images: one chance-level run
    # reaches 15 % with probability < 1e-2). Three epochs of a small CNN reach far above 50 %.
    assert result.final_metrics["top1"] > 0.5, result.final_metrics
    assert 0 <= result.final_metrics["ece"] <= 1
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_ism_cutmix_run_resumes_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        *TINY,
        "data.samples_per_class=12",
        "optim.max_steps_per_epoch=2",
        "model.uncertainty.enabled=true",
        "model.uncertainty.form=linear",
        "model.uncertainty.init_std=0.001",
        "metric.introspective=true",
        "mixup.enabled=true",
        "mixup.kind=cutmix",
        "mixup.probability=0.5",
        "degradations.blur_fraction=0.25",
    ]
    whole = Trainer(load_config(None, [*base, "optim.epochs=2"]), tmp_path / "a", progress=False)
    expected = whole.fit()
    first = Trainer(load_config(None, [*base, "optim.epochs=1"]), tmp_path / "b", progress=False)
    first.fit()
    resumed = Trainer(load_config(None, [*base, "optim.epochs=2"]), tmp_path / "b", progress=False)
    result = resumed.fit(resume=True)
    assert result.final_metrics == expected.final_metrics
    assert {"u_clean", "u_mixup", "u_cutmix", "u_lowres", "top1", "top5"} <= set(
        result.final_metrics
    )
    assert expected.history[-1]["loss/metric"] == result.history[-1]["loss/metric"]

    # The CLI evaluates the run from its checkpoint alone: the same numbers as the trainer's.
    import json

    from idml.app.cli import main

    main(["evaluate", "--checkpoint", str(tmp_path / "b"), "--which", "latest", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result.final_metrics
    assert main(["evaluate", "--checkpoint", str(tmp_path / "b"), "--ks", "1,2"]) != 0
    assert "--ks do not apply to classification runs" in capsys.readouterr().err
    calibration = ["--rerank", "k-reciprocal", "--calibration", str(tmp_path / "c.json")]
    assert main(["evaluate", "--checkpoint", str(tmp_path / "b"), "--no-full-ranking"]) != 0
    assert "--no-full-ranking do not apply to classification runs" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", str(tmp_path / "b"), *calibration]) != 0
    assert "--rerank, --calibration do not apply to classification runs" in capsys.readouterr().err
    # A classifier's answers carry its softmax probability: training fitted no retrieval
    # calibration, and `idml calibrate` without labelled images says why.
    assert not (tmp_path / "b" / "calibration.json").exists()
    assert main(["calibrate", str(tmp_path / "b"), "--no-progress"]) != 0
    assert "does not read the calibration section" in capsys.readouterr().err


def test_presets_validate_and_pick_sgd_with_milestones() -> None:
    presets = sorted(Path(__file__).resolve().parents[1].glob("configs/classification/*.yaml"))
    assert len(presets) == 18
    for path in presets:
        cfg = load_config(path)
        assert cfg.task.name == "classification" and cfg.published
        assert "top1" in cfg.published.metrics
        assert "IDML authors' README" in cfg.published.source
        assert cfg.optim.optimizer == "sgd" and cfg.optim.scheduler == "multistep"
    with pytest.raises(ConfigError, match=r"optim\.scheduler=multistep needs optim\.milestones"):
        load_config(None, ["optim.scheduler=multistep"])


def test_presets_are_the_scripts_output_and_resolve_to_its_recipe() -> None:
    """The committed presets are what scripts/make_classification_presets.py writes: each a
    method fragment (method/idml means the same as for retrieval) plus the rest of its recipe."""
    import importlib.util

    import yaml

    from idml.app.config import validate_config

    repo = Path(__file__).resolve().parents[1]
    path = repo / "scripts" / "make_classification_presets.py"
    spec = importlib.util.spec_from_file_location("make_classification_presets", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for dataset in script.DATASETS:
        for method in script.METHODS:
            numbers = script.PUBLISHED.get((dataset, method))
            file = repo / "configs" / "classification" / f"{dataset}_{method}.yaml"
            assert yaml.safe_load(file.read_text()) == script.preset(dataset, method, numbers)
            assert load_config(file) == validate_config(script.recipe(dataset, method, numbers))


def test_trainer_builds_sgd_and_multistep(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            *TINY,
            "data.samples_per_class=4",
            "optim.optimizer=sgd",
            "optim.nesterov=true",
            "optim.scheduler=multistep",
            "optim.milestones=[2, 4]",
        ],
    )
    trainer = Trainer(cfg, tmp_path, progress=False)
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    assert trainer.optimizer.defaults["nesterov"] is True
    assert isinstance(trainer.scheduler, torch.optim.lr_scheduler.MultiStepLR)
    assert type(trainer.objective.module).__name__ == "IntrospectiveClassifier"


def test_cifar_conversion_needs_the_pickle_opt_in(tmp_path: Path) -> None:
    import pickle
    import subprocess
    import sys

    source = tmp_path / "cifar-10-batches-py"
    source.mkdir()
    names = [f"c{i}" for i in range(10)]
    (source / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), "labels": [0, 1]}
        (source / name).write_bytes(pickle.dumps(batch))
    script = Path(__file__).resolve().parents[1] / "scripts" / "cifar_to_png.py"
    out = tmp_path / "png"
    refused = subprocess.run([sys.executable, script, source, out], capture_output=True, text=True)
    assert refused.returncode == 2 and "--trust-pickle" in refused.stderr and not out.exists()
    done = subprocess.run(
        [sys.executable, script, source, out, "--trust-pickle"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    split = load_classification_split("folder", out)
    assert (len(split.train), len(split.test), split.num_classes) == (10, 2, 2)


def test_report_of_a_classification_run_with_and_without_the_test_analysis(
    tmp_path: Path, capsys
) -> None:
    from idml.app.cli import main

    cfg = load_config(
        None, [*TINY, "data.samples_per_class=8", "sampler.batch_size=16", "optim.epochs=1"]
    )
    Trainer(cfg, tmp_path / "run", progress=False).fit()
    args = ["report", str(tmp_path / "run"), "--no-progress", "--out"]
    assert main([*args, str(tmp_path / "rep")]) == 0, capsys.readouterr().err
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "<h3>Reliability" not in page and "<h3>Calibration</h3>" in page
    # No uncertainty head: the page says so instead of drawing −||u|| or the ||u|| probe.
    assert "no uncertainty head, so −||u|| is not a score here" in page
    assert main([*args, str(tmp_path / "logs"), "--no-test"]) == 0
    page = (tmp_path / "logs" / "index.html").read_text()
    assert "cosine classifier" in page and "top1 (%)" in page and "Confusion matrix" not in page
    assert "no confusion matrix, reliability diagram or mistakes" in page


def test_milestones_the_run_never_reaches_are_warned() -> None:
    from idml.app.preflight import check_run_config

    preset = Path(__file__).resolve().parents[1] / "configs/classification/cifar10_baseline.yaml"
    assert check_run_config(load_config(preset)) == []  # 300 epochs: [150, 225] both act
    (short,) = check_run_config(load_config(preset, ["optim.epochs=3"]))
    assert short.startswith("optim.milestones=[150, 225] with optim.epochs=3: the learning rate ")
    assert "never drops at [150, 225]" in short and "e.g. [2]" in short
    (partly,) = check_run_config(load_config(preset, ["optim.epochs=200"]))
    assert "never drops at [225]" in partly and "e.g. [100, 150]" in partly
    (one,) = check_run_config(load_config(preset, ["optim.epochs=1"]))
    assert one.endswith("set optim.scheduler=none")
