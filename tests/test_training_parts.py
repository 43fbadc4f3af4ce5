"""The trainer's parts, each through its own interface: :class:`Checkpointing` (with
:class:`BestEpoch`), :class:`EpochLog`, :class:`LearningMonitor` and the restored schedule; the
trainer composes them (tests/test_training.py runs them together)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from idml.app.checkpoint import EPOCH_BASE
from idml.app.config import config_to_dict, load_config
from idml.app.distributed import DistributedContext
from idml.app.training.checkpoints import BestEpoch, Checkpointing, TrainingWeights
from idml.app.training.epoch_log import EpochLog, EpochRecord
from idml.app.training.monitoring import LearningMonitor, NonFiniteError
from idml.app.training.optim import build_scheduler, restore_schedule
from idml.metrics import CosineSimilarity, IntrospectiveMetric

ONE = DistributedContext()


def _weights(seed: int) -> TrainingWeights:
    torch.manual_seed(seed)
    model, head = nn.Linear(3, 2), nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # optimizer state to save
    return TrainingWeights(model, {"loss": head}, {"optim_main": optimizer})


def _linear(module: nn.Module) -> nn.Linear:
    """One of :func:`_weights`' modules, as the ``nn.Linear`` it is."""
    assert isinstance(module, nn.Linear)
    return module


# --------------------------------------------------------------------------- checkpointing
def test_checkpoints_round_trip_point_at_the_best_and_prune(tmp_path: Path) -> None:
    cfg = load_config(None)
    parts = Checkpointing(tmp_path, ONE)
    saved = _weights(0)
    # Epochs are numbered from 1 (the trainer writes epoch_base 1; a state without it is an old
    # run numbered from 0, which read_state renumbers).
    for epoch, best in ((1, 1), (2, 1), (3, 3)):
        state = {"epoch": epoch, EPOCH_BASE: 1, "config": config_to_dict(cfg)}
        parts.save(epoch, saved, state, best)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("epoch_*")) == ["epoch_0003"]
    assert (root / "best").read_text().strip() == "epoch_0003"

    fresh = _weights(1)
    assert not torch.equal(_linear(fresh.model).weight, _linear(saved.model).weight)
    parts.save(4, saved, {"epoch": 4, EPOCH_BASE: 1, "config": config_to_dict(cfg)}, 3)
    restored = parts.restore(cfg, fresh)
    assert restored.epoch == 4 and not restored.epochs_changed
    assert torch.equal(_linear(fresh.model).weight, _linear(saved.model).weight)
    assert torch.equal(_linear(fresh.modules["loss"]).weight, _linear(saved.modules["loss"]).weight)
    key = next(iter(saved.optimizers["optim_main"].state_dict()["state"]))
    assert torch.equal(
        fresh.optimizers["optim_main"].state_dict()["state"][key]["exp_avg"],
        saved.optimizers["optim_main"].state_dict()["state"][key]["exp_avg"],
    )
    longer = load_config(None, ["optim.epochs=70"])
    assert parts.restore(longer, fresh).epochs_changed  # more epochs may resume
    with pytest.raises(ValueError, match=r"cannot resume .*optim\.lr: 0\.0001 -> 0\.5"):
        parts.restore(load_config(None, ["optim.lr=0.5"]), fresh)


def test_best_epoch_needs_the_selected_metric() -> None:
    best = BestEpoch()
    with pytest.raises(ValueError, match=r"eval\.select='top1' is not among the metrics"):
        best.update(0, {"recall@1": 0.5}, "top1")
    assert best.update(3, {"top1": 0.2}, "top1")
    assert BestEpoch.from_state(best.to_state()) == best
    assert BestEpoch.from_state({}) == BestEpoch(-math.inf, 0, {})  # 0: none evaluated yet


# --------------------------------------------------------------------------- epoch log
def test_epoch_log_writes_echoes_and_keeps_only_checkpointed_epochs(tmp_path: Path) -> None:
    lines: list[str] = []
    log = EpochLog(tmp_path, ONE, echo=lines.append)
    log.start()
    for epoch in (1, 2, 3):  # numbered from 1
        record = EpochRecord(epoch, {"total": 1.0 / epoch}, {"heads": 0.1}, {}, steps=2)
        record.metrics = {"recall@1": 0.25 * (epoch - 1)}
        log.write(record, epochs=3)
    assert lines[0].startswith("epoch 1/3: loss 1.0000, recall@1 0.0000, 2 steps")
    assert log.last_test_metrics() == {"recall@1": 0.5}
    (tmp_path / "metrics.jsonl").open("a").write('{"epoch": 4, "cut')  # a crash mid-line
    again = EpochLog(tmp_path, ONE)
    again.restore(2)  # the checkpoint is of epoch 2: later lines go
    assert [line["epoch"] for line in again.history] == [1, 2]
    stored = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in stored] == [1, 2]
    with pytest.raises(ValueError, match="has 2 epoch lines but the checkpoint is of epoch 5"):
        again.restore(5)


# --------------------------------------------------------------------------- learning monitor
def test_monitor_ramps_ism_in_and_summarises_the_epoch(tmp_path: Path) -> None:
    ism = IntrospectiveMetric(CosineSimilarity())
    monitor = LearningMonitor(ism, warmup_epochs=2.0, run_dir=tmp_path, lr=1e-3)
    monitor.start_epoch(0)
    monitor.step(0, 1, steps_per_epoch=4)  # half an epoch done after this step
    assert ism.strength == pytest.approx(0.25) and monitor.position == (0, 1)
    monitor.record_grad_norm(torch.tensor(1.0))
    monitor.record_grad_norm(torch.tensor(3.0))
    summary = monitor.summary()
    assert (summary["grad_norm"], summary["grad_norm_max"], summary["strength"]) == (2.0, 3.0, 0.25)
    monitor.step(5, 0, steps_per_epoch=4)
    assert ism.strength == 1.0
    plain = LearningMonitor(None, warmup_epochs=0.0, run_dir=tmp_path, lr=1e-3)
    plain.start_epoch(0)
    assert plain.summary() == {}


def test_monitor_warns_once_when_nothing_learns(tmp_path: Path) -> None:
    monitor = LearningMonitor(None, 0.0, tmp_path, lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.check(0, {"grad_norm_max": 0.0})
        monitor.check(1, {"grad_norm_max": 0.0})
    assert len(caught) == 1 and "exactly zero gradient" in str(caught[0].message)
    silent = LearningMonitor(None, 0.0, tmp_path, lr=1e-3, warns=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        silent.check(0, {"grad_norm_max": 0.0})  # another rank: rank 0 warns


HEAD_ON = {"enabled": True}


@pytest.mark.parametrize(
    ("raw", "says", "not_says"),
    [
        (
            {"model": {"uncertainty": {"enabled": False}}, "metric": {"gamma": 0.5}},
            "uniform-weakening control",
            "init_level",
        ),
        (
            {"model": {"uncertainty": HEAD_ON}, "optim": {"uncertainty_lr_mult": 0.0}},
            "frozen (optim.uncertainty_lr_mult=0)",
            "init_level",
        ),
        (
            {"model": {"uncertainty": HEAD_ON}, "optim": {"head_lr_mult": 0.0}},
            "frozen (optim.head_lr_mult=0)",
            "init_level",
        ),
        ({"model": {"uncertainty": HEAD_ON}}, "model.uncertainty.init_level is 0.02", "frozen"),
        (
            {"model": {"uncertainty": {**HEAD_ON, "init_level": 0.25}}},
            "optim.uncertainty_lr_mult",
            "init_level is",
        ),
        (
            {"model": {"uncertainty": {**HEAD_ON, "level_input": "direction"}}},
            "model.uncertainty.level_input=standardized",
            "frozen",
        ),
        (
            {"model": {"uncertainty": {**HEAD_ON, "form": "linear"}}},
            "form=bounded",
            "init_level",
        ),
    ],
)
def test_the_identity_warning_advises_what_this_run_can_change(
    tmp_path: Path, raw: dict, says: str, not_says: str
) -> None:
    """A control that is the identity on purpose (frozen head, no head) is told so; a training
    head is told which of its own keys keep u from moving, not a generic list."""
    from idml.app.config import Config
    from idml.app.training.monitoring import identity_advice

    advice = identity_advice(
        Config.model_validate({**raw, "metric": {"introspective": True, **raw.get("metric", {})}})
    )
    assert says in advice and not_says not in advice, advice
    monitor = LearningMonitor(
        IntrospectiveMetric(CosineSimilarity()),
        0.0,
        tmp_path,
        lr=1e-3,
        epochs=4,
        identity_advice=advice,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.check(3, {"pos_q10": 0.995, "pos_q50": 0.997, "u_cv": 0.01})
    assert len(caught) == 1 and advice in str(caught[0].message), caught


@pytest.mark.parametrize("mixup", [True, False])
def test_identity_warning_says_what_the_run_measures_instead(tmp_path: Path, mixup: bool) -> None:
    # An ISM run that acts as the identity measures Mixup only when it trains with Mixup.
    monitor = LearningMonitor(
        IntrospectiveMetric(CosineSimilarity()), 0.0, tmp_path, lr=1e-3, epochs=4, mixup=mixup
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.check(3, {"pos_q10": 0.995, "pos_q50": 0.997, "u_cv": 0.01})
    message = str(caught[0].message)
    expected, wrong = ("Mixup", "the plain metric,") if mixup else ("the plain metric,", "Mixup")
    assert f"measures {expected}" in message and f"measures {wrong}" not in message, message


def test_monitor_names_the_step_and_the_checkpoint_kept(tmp_path: Path) -> None:
    monitor = LearningMonitor(None, 0.0, tmp_path, lr=0.5)
    monitor.step(2, 6, steps_per_epoch=10)
    broken = nn.Linear(2, 2)
    with torch.no_grad():
        broken.bias[0] = float("nan")
    with pytest.raises(
        NonFiniteError, match=r"non-finite weights in model\.bias at epoch 3, step 7"
    ):
        monitor.check_finite_weights({"model": broken})
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("epoch_0001\n")
    error = monitor.non_finite("NaN in the test set", after_epoch=True)
    assert "after epoch 3" in str(error) and "(epoch_0001) stays latest" in str(error)
    assert "optim.lr (now 0.5)" in str(error)


# --------------------------------------------------------------------------- schedule
def test_restored_schedule_continues_or_replays_for_a_new_length() -> None:
    cfg = load_config(None, ["optim.scheduler=cosine", "optim.epochs=4", "optim.lr=1.0"])
    params = [nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(params, lr=1.0)
    scheduler = build_scheduler(cfg, optimizer)
    assert scheduler is not None
    optimizer.step()
    scheduler.step()
    saved = scheduler.state_dict()
    same = restore_schedule(cfg, optimizer, scheduler, saved, 1, epochs_changed=False)
    assert same is scheduler
    longer = load_config(None, ["optim.scheduler=cosine", "optim.epochs=8", "optim.lr=1.0"])
    replayed = restore_schedule(longer, optimizer, scheduler, saved, 1, epochs_changed=True)
    assert replayed is not None and replayed.state_dict()["T_max"] == 8
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi / 8)))


def test_monitor_warns_once_when_the_embeddings_collapse(tmp_path: Path) -> None:
    """A batch whose embeddings are one point (the Lite0 + ProxyAnchor + Mixup runs whose backbone
    died) has a mean resultant length of 1 and is called out once; embeddings as alike as a
    pretrained backbone's at initialisation (0.97 measured) or any healthy batch are not."""
    generator = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(1, 16, generator=generator), dim=1)
    jitter = 0.01 * torch.randn(60, 16, generator=generator)
    collapsed = 3.0 * direction.expand(60, 16) + jitter  # not unit: the monitor normalises
    alike = direction + 0.15 * torch.randn(60, 16, generator=generator)  # ~0.97, as at init
    spread = torch.randn(60, 16, generator=generator)

    def epoch(monitor: LearningMonitor, batches: list[torch.Tensor]) -> dict[str, float]:
        monitor.start_epoch(0)
        for batch in batches:
            monitor.record_embeddings(batch)
        return monitor.summary()

    monitor = LearningMonitor(None, 0.0, tmp_path, lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (spread, alike):
            summary = epoch(monitor, [batch, batch])
            assert summary["embedding_resultant"] < 0.999
            monitor.check(0, summary)
        assert caught == []
        summary = epoch(monitor, [collapsed, collapsed])
        assert summary["embedding_resultant"] > 0.999
        monitor.check(3, summary)
        monitor.check(4, summary)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "epoch 4: the embeddings have collapsed" in message
    assert "ism/embedding_resultant" in message and "Mixup" in message
    assert epoch(monitor, [spread[:1]]) == {}  # one image has no spread to measure


def test_level_drift_is_a_factor_beyond_two_either_way() -> None:
    from idml.app.training.level_probe import DRIFT_FACTOR, level_drift

    assert DRIFT_FACTOR == 2.0
    assert level_drift(0.04, 0.08) is None  # exactly 2-fold is not beyond it
    assert level_drift(0.04, 0.1) == pytest.approx(2.5)
    assert level_drift(0.1, 0.04) == pytest.approx(2.5)  # below as above
    assert level_drift(0.0, 0.0) is None
    assert level_drift(0.0, 0.1) == math.inf


def test_the_level_drift_warning_judges_the_model_the_run_delivers(tmp_path: Path) -> None:
    """After the last epoch only, the warning names both levels, the factor and its direction,
    and the run's advice; it stays silent within the factor, without a trained level, and on ranks
    that do not warn."""
    from idml.app.config import Config
    from idml.app.training.level_probe import LevelDriftWarning, drift_advice

    default = Config.model_validate({"model": {"uncertainty": {"enabled": True}}})
    advice = drift_advice(default, frozen_batchnorm=False)
    assert "level_input=standardized_running" in advice
    monitor = LearningMonitor(None, 0.0, tmp_path, lr=1e-3, epochs=8, drift_advice=advice)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.check_eval_level(3, 0.04, 0.5)  # mid-training: the trend is logged
        monitor.check_eval_level(7, 0.04, 0.07)  # 1.75-fold
        monitor.check_eval_level(7, None, 0.5)  # every training image was mixed
        monitor.check_eval_level(7, 0.04, 0.5)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].category is LevelDriftWarning
    message = str(caught[0].message)
    assert message.startswith("epoch 8: ") and "0.5 in eval mode, 12.5 times above the 0.04" in (
        message
    )
    assert advice in message
    below = LearningMonitor(None, 0.0, tmp_path, lr=1e-3, epochs=8, drift_advice=advice)
    silent = LearningMonitor(
        None, 0.0, tmp_path, lr=1e-3, epochs=8, warns=False, drift_advice=advice
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        below.check_eval_level(7, 0.5, 0.04)
        silent.check_eval_level(7, 0.5, 0.04)
    assert len(caught) == 1 and "12.5 times below the 0.5" in str(caught[0].message)
    for raw in (
        {"enabled": True, "level_input": "standardized_running"},
        {"enabled": True, "form": "linear"},
    ):
        cfg = Config.model_validate({"model": {"uncertainty": raw}})
        training_bn = drift_advice(cfg, frozen_batchnorm=False)
        assert "model.freeze_bn=true" in training_bn and "standardized_running" not in training_bn
        frozen_bn = drift_advice(cfg, frozen_batchnorm=True)
        assert "freeze_bn=true" not in frozen_bn and "comes from the images" in frozen_bn
