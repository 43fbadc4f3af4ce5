"""How a training step uses its device (:class:`ComputePlan`): the choices per device, and on the
CPU each path the accelerator defaults take — bfloat16 autocast, channels-last, the fused optimizer,
torch.compile, and host reads once per interval — against the float32 eager step."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from idml.app import build
from idml.app.checkpoint import MODEL_FILE, resolve_checkpoint
from idml.app.config import ConfigError, OptimConfig, load_config
from idml.app.training import Trainer
from idml.app.training.compute import ComputePlan
from idml.app.training.monitoring import NonFiniteError
from idml.app.training.optim import build_optimizers
from idml.checks import value_checks
from tiny_run import IDML, TINY

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device object only: resolving a plan touches no GPU


@pytest.mark.parametrize(
    ("device", "overrides", "bf16", "expected"),
    [
        (CPU, {}, True, (None, True, False, 1)),
        (CPU, {"amp_dtype": "bfloat16"}, True, (torch.bfloat16, True, False, 1)),
        (CPU, {"channels_last": False}, True, (None, False, False, 1)),
        (CPU, {"channels_last": True, "fused": True, "sync_every": 4}, True, (None, True, True, 4)),
        (CUDA, {}, True, (torch.bfloat16, True, True, 25)),
        (CUDA, {}, False, (torch.float16, True, True, 25)),
        (
            CUDA,
            {"amp": False, "channels_last": False, "fused": False},
            True,
            (None, False, False, 25),
        ),
        (CUDA, {"amp_dtype": "float16", "sync_every": 1}, True, (torch.float16, True, True, 1)),
    ],
)
def test_the_plan_of_each_device(
    device: torch.device, overrides: dict, bf16: bool, expected: tuple
) -> None:
    plan = ComputePlan.resolve(OptimConfig(**overrides), device, bf16_supported=lambda: bf16)
    assert (plan.autocast_dtype, plan.channels_last, plan.fused, plan.sync_every) == expected
    assert plan.loss_scaling == (plan.autocast_dtype == torch.float16)
    if device.type == "cpu":  # a CUDA scaler disables itself on a machine without a GPU
        assert plan.grad_scaler().is_enabled() == plan.loss_scaling


def test_compute_settings_are_validated_by_key() -> None:
    with pytest.raises(ConfigError, match=r"optim\.sync_every"):
        load_config(None, ["optim.sync_every=0"])
    with pytest.raises(ConfigError, match=r"optim\.compile") as caught:
        load_config(None, ["optim.compile=fast"])
    assert "max-autotune" in str(caught.value)  # the valid modes are listed


def test_host_reads_at_the_interval_and_the_epoch_end() -> None:
    plan = ComputePlan.resolve(OptimConfig(sync_every=3), CPU)
    assert [s for s in range(7) if plan.reads_at(s, 7)] == [2, 5, 6]


def _log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(root: Path, name: str, *extra: str) -> tuple[Trainer, list[dict]]:
    cfg = load_config(None, [*TINY, *IDML, "optim.epochs=2", "optim.max_steps_per_epoch=5", *extra])
    trainer = Trainer(cfg, root / name, progress=False)
    trainer.fit()
    return trainer, _log(root / name)


def _losses(log: list[dict]) -> list[dict]:
    """What a run learned, per epoch: losses, ||u|| levels and ISM's monitor (not timings)."""
    kept = ("loss/", "uncertainty/", "ism/", "test/")
    return [{k: v for k, v in e.items() if k.startswith(kept)} for e in log]


def test_reading_every_few_steps_logs_what_reading_every_step_does(tmp_path: Path) -> None:
    every, _ = _train(tmp_path, "every", "optim.sync_every=1")
    interval, _ = _train(tmp_path, "interval", "optim.sync_every=3")
    a, b = _log(tmp_path / "every"), _log(tmp_path / "interval")
    # The same arithmetic in the same order (float64 sums of the steps): identical, not close.
    assert _losses(a) == _losses(b)
    assert {"ism/u_cv", "uncertainty/mixed", "loss/total", "test/recall@1"} <= a[-1].keys()
    for p, q in zip(every.model.parameters(), interval.model.parameters(), strict=True):
        assert torch.equal(p, q)


class _HostReads:
    """Counts the ways Python code reads a tensor's value to the host, but for the reads of the
    trainer's random streams, which are CPU generators by design (``sample_beta`` seeds NumPy from
    one): those read no device."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")
    CPU_STREAMS = ("sample_beta",)

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(tensor, *args, _real=real, _name=name, **kwargs):
                caller = traceback.extract_stack(limit=2)[0]
                if caller.name not in self.CPU_STREAMS:
                    self.calls.append(f"{_name} in {caller.filename}:{caller.lineno}")
                return _real(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_a_step_between_reads_reads_nothing_to_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idml.app.training.step_values import StepValues

    # The accelerator's plan: fused optimizer (torch's foreach Adam reads its step counts, CPU
    # tensors then), reads every 8 steps.
    cfg = load_config(None, [*TINY, *IDML, "optim.sync_every=8", "optim.fused=true"])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    gen = torch.Generator().manual_seed(0)
    images, labels, _ = next(iter(build.train_loader(cfg, trainer.data, 0, gen)))
    values = StepValues()
    with value_checks(False):  # as the epoch loop runs the steps between reads
        trainer.step(images, labels, gen, gen, False, values, None)  # warm-up
        reads = _HostReads(monkeypatch)
        trainer.step(images, labels, gen, gen, False, values, None)
    assert reads.calls == []
    read = trainer.step(images, labels, gen, gen, False, values, 0)
    assert read is not None and read.keys() >= {"metric", "total", "u_original", "u_mixed"}
    assert reads.calls  # the reading step does read


def test_a_nan_between_reads_stops_the_run_naming_the_steps(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, "optim.sync_every=4", "optim.max_steps_per_epoch=6"])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    forward = trainer.objective.__call__
    calls = []

    def poisoned(*args, **kwargs):
        loss = forward(*args, **kwargs)
        calls.append(1)
        return loss * float("nan") if len(calls) == 2 else loss

    # A stand-in, not an Objective: it forwards everything but the call to the real one.
    trainer.objective = _Wrapped(trainer.objective, poisoned)  # type: ignore[assignment]
    # The NaN of step 2 reaches the weights; step 4 reads, and finds it (in its embeddings).
    with pytest.raises(NonFiniteError, match=r"NaN or inf .* at epoch 1, in steps 1-4; "):
        trainer.fit()
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()


class _Wrapped:
    """An objective whose call is replaced (the rest is the wrapped one's)."""

    def __init__(self, inner, call) -> None:
        self._inner, self._call = inner, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _one_step_loss(root: Path, name: str, *extra: str) -> tuple[float, Trainer]:
    cfg = load_config(None, [*TINY, *IDML, "optim.max_steps_per_epoch=1", *extra])
    trainer = Trainer(cfg, root / name, progress=False)
    trainer.fit()
    return _log(root / name)[0]["loss/total"], trainer


def test_bfloat16_autocast_on_the_cpu(tmp_path: Path) -> None:
    reference, _ = _one_step_loss(tmp_path, "fp32")
    loss, trainer = _one_step_loss(tmp_path, "bf16", "optim.amp=true", "optim.amp_dtype=bfloat16")
    assert trainer.compute.autocast_dtype == torch.bfloat16
    seen = []
    conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with trainer.compute.autocast():
        trainer.model(torch.rand(2, 1, 8, 8))
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights
    # bfloat16 keeps 8 bits of mantissa (unit roundoff 2^-8 ≈ 0.4 %); a loss through a few layers
    # of such products stays within a few per cent of float32, and must be finite.
    assert loss == pytest.approx(reference, rel=0.05)


def test_channels_last_on_the_cpu(tmp_path: Path) -> None:
    reference, plain = _one_step_loss(tmp_path, "plain", "optim.channels_last=false")
    conv = next(m for m in plain.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous()  # the layout runs trained before it was the default had
    loss, fast = _one_step_loss(tmp_path, "fast", "optim.fused=true")  # channels-last: auto
    conv = next(m for m in fast.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert fast.optimizer.defaults["fused"] is True
    # The same float32 sums in another order (a convolution's reduction over 3·3·C inputs): the
    # first step's loss agrees to a few float32 roundoffs per layer. (The weights after the step
    # are not compared elementwise: Adam's first update lr·g/(|g|+ε) turns a roundoff in a
    # gradient near ε into a large change of that weight's step.)
    assert loss == pytest.approx(reference, rel=1e-5)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)  # still, after the step
    # The checkpoint holds the same weights (stored contiguous, as safetensors needs them).
    saved = load_file(resolve_checkpoint(tmp_path / "fast") / MODEL_FILE)
    for name, value in fast.model.state_dict().items():
        assert torch.equal(saved[name], value)


def test_the_fused_optimizer_steps_as_the_foreach_one(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, *IDML])
    steps = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = build.build_model(cfg)
        optimizer, _ = build_optimizers(cfg, model, torch.nn.Linear(1, 1), None, fused=fused)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            optimizer.step()
        steps.append([p.detach().clone() for p in model.parameters()])
    # The same elementwise AdamW formula on the same gradients, in another operation order: a few
    # float32 roundoffs of each weight (torch's float32 tolerances: rtol 1.3e-6, atol 1e-5).
    for a, b in zip(*steps, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_a_compiled_backbone_trains_like_the_eager_one(tmp_path: Path) -> None:
    reference, eager = _one_step_loss(tmp_path, "eager")
    loss, compiled = _one_step_loss(tmp_path, "compiled", "optim.compile=default")
    # Inductor fuses and reorders the float32 arithmetic, nothing else (weights after the step:
    # see the channels-last test).
    assert loss == pytest.approx(reference, rel=1e-5)
    assert "backbone" in dict(compiled.model.named_children())  # state-dict names unchanged
    assert compiled.model.state_dict().keys() == eager.model.state_dict().keys()
