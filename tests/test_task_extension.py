"""A third task is one module and one registry line: a toy task, defined and registered here,
trains, resumes, evaluates, embeds and reports through the CLI like the two that ship.

The toy task, ``prototypes``: every class has a learnable prototype, an image's logits are its
negative squared distances to them over a temperature, and the test metric is how often the nearest
prototype is the image's class (Snell et al. 2017's rule with learned prototypes). It reads fewer
keys than the shipped tasks (no metric, loss, Mixup or SSR), has one setting of its own
(``task.temperature``) and its own defaults (a fragment file).
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from pydantic import Field
from safetensors.torch import load_file
from torch import Tensor, nn

from idml.app import build
from idml.app.config import RUN_KEYS, Config, ConfigError, load_config
from idml.app.tasks import (
    Evaluation,
    EvaluationContext,
    EvaluationRequest,
    LoadedRun,
    MetricsTable,
    Objective,
    Task,
    TaskParams,
    register_task,
    unregister_task,
)
from idml.augment import AugmentationPipeline, AugmentedBatch
from idml.data.classification import load_classification_split
from idml.data.datasets import TrainTestPair
from idml.embeddings import Embeddings
from idml.models import embed_dataset
from tiny_run import TINY, write_images


# --------------------------------------------------------------------------- the toy task
class PrototypeParams(TaskParams):
    """The toy task's settings."""

    temperature: float = Field(1.0, gt=0, description="logits = −||x − p_c||² / temperature")


class Prototypes(nn.Module):
    """One learnable prototype per class."""

    def __init__(self, classes: int, dim: int, temperature: float) -> None:
        super().__init__()
        self.prototypes = nn.Parameter(torch.randn(classes, dim))
        self.temperature = temperature

    def logits(self, semantic: Tensor) -> Tensor:
        return -torch.cdist(semantic, self.prototypes).pow(2) / self.temperature


class PrototypeObjective(Objective):
    module: Prototypes

    def __init__(self, module: Prototypes) -> None:
        self.module = module

    def __call__(self, embeddings: Embeddings, batch: AugmentedBatch) -> Tensor:
        logits = self.module.logits(embeddings.semantic)
        return nn.functional.cross_entropy(logits, batch.labels.primary)


@torch.no_grad()
def accuracy(model: Any, prototypes: Prototypes, dataset: Any, device: torch.device) -> float:
    emb, labels = embed_dataset(model, dataset, 64, device)
    predicted = prototypes.logits(emb.semantic.to(device)).argmax(dim=1).cpu()
    return float((predicted == labels).double().mean())


@dataclass(frozen=True)
class PrototypeRun(LoadedRun):
    run: Any
    prototypes: Prototypes

    extra_arrays: ClassVar[tuple[str, ...]] = ("distances",)

    def extra_outputs(self, embeddings: Embeddings) -> tuple[dict[str, Tensor], dict[str, list]]:
        with torch.no_grad():
            return {"distances": -self.prototypes.logits(embeddings.semantic)}, {}


@dataclass(frozen=True)
class PrototypeAnalysis:
    metrics: dict[str, float]
    checkpoint: str
    epoch: int


class PrototypeTask(Task):
    name = "prototypes"
    params = PrototypeParams
    reads: ClassVar[frozenset[str]] = RUN_KEYS | {
        "data.dataset",
        "data.image_size",
        "data.resize_size",
        "data.train_crop_scale",
        "data.horizontal_flip",
        "data.samples_per_class",
        "data.num_workers",
        "sampler",
        "model",
        "optim",
        "eval.every",
        "eval.select",
        "eval.batch_size",
    }

    def __init__(self, defaults: Path) -> None:
        self.defaults = defaults  # type: ignore[misc]  # a fragment file of this test

    def metric_names(self, cfg: Config) -> list[str]:
        return ["accuracy"]

    def build_data(self, cfg: Config) -> TrainTestPair:
        train, test = build.data_transforms(cfg)
        d = cfg.data
        return load_classification_split(
            d.dataset, per_class=d.samples_per_class, train_transform=train, test_transform=test
        )

    def build_objective(self, cfg: Config, data: TrainTestPair) -> PrototypeObjective:
        params = cfg.task
        assert isinstance(params, PrototypeParams)
        return PrototypeObjective(
            Prototypes(data.num_train_classes, cfg.model.embedding_dim, params.temperature)
        )

    def build_augmentations(self, cfg: Config) -> AugmentationPipeline:
        return AugmentationPipeline()

    def evaluate(self, context: EvaluationContext) -> Evaluation:
        found = None
        if context.dist.is_main:
            module = context.objective.module
            assert isinstance(module, Prototypes)
            found = {"accuracy": accuracy(context.model, module, context.data.test, context.device)}
        metrics = context.dist.broadcast_object(found)
        assert metrics is not None  # rank 0 evaluated
        return Evaluation(metrics)

    def load_run(self, path: Path, which: str = "best") -> PrototypeRun:
        from idml.app.checkpoint import TRAINING_FILE
        from idml.app.trained_run import load_trained_run

        run = load_trained_run(path, which)
        params = run.config.task
        assert isinstance(params, PrototypeParams)
        weights = load_file(str(run.checkpoint / TRAINING_FILE))["loss.prototypes"]
        prototypes = Prototypes(weights.shape[0], weights.shape[1], params.temperature)
        prototypes.prototypes.data.copy_(weights)
        return PrototypeRun(run, prototypes)

    def evaluate_run(
        self,
        path: Path,
        which: str,
        request: EvaluationRequest,
        device: torch.device | str | None = None,
        progress: bool = False,
    ) -> MetricsTable:
        loaded = self.load_run(path, which)
        test = self.build_data(loaded.config).test
        value = accuracy(loaded.model, loaded.prototypes, test, torch.device("cpu"))
        return MetricsTable(str(path), {"accuracy": value})

    def analyse(self, log: Any, options: Any, device: torch.device, progress: bool) -> Any:
        loaded = self.load_run(log.run_dir, options.which)
        metrics = self.evaluate_run(log.run_dir, options.which, EvaluationRequest()).metrics
        epoch = int(loaded.run.state["epoch"]) + 1
        return PrototypeAnalysis(metrics, loaded.run.which, epoch)

    def report_section(self, analysis: Any, slug: str, page: Any) -> str:
        value = analysis.metrics["accuracy"]
        return f"<h3>Nearest prototype</h3><p>accuracy {html.escape(f'{value:.4f}')}</p>"


# --------------------------------------------------------------------------- its registry line
@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrototypeTask]:
    defaults = tmp_path_factory.mktemp("task") / "prototypes.yaml"
    defaults.write_text("eval: {select: accuracy}\nsampler: {kind: random, batch_size: 20}\n")
    registered = register_task(PrototypeTask(defaults))
    yield registered
    unregister_task(registered.name)


# The tiny run's keys the toy task reads (it has no metric section to set, nor NMI to switch off).
SETTINGS = [item for item in TINY if not item.startswith(("eval.nmi", "sampler."))]


def train(config: Path, folder: Path, epochs: int, *flags: str) -> int:
    from idml.app.cli import main

    args = ["train", str(config), "--out", str(folder), "--no-progress", *flags]
    for item in [*SETTINGS, f"optim.epochs={epochs}"]:
        args += ["--set", item]
    return main(args)


def test_a_registered_task_runs_the_whole_cli_path(
    task: PrototypeTask, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from idml.app.cli import main
    from idml.evaluation.io import read_entries

    cfg = load_config(None, ["task=prototypes", "task.temperature=2", *SETTINGS])
    assert (cfg.task.name, cfg.eval.select, cfg.sampler.kind) == (
        "prototypes",
        "accuracy",
        "random",
    )
    with pytest.raises(ConfigError, match=r"^mixup\.enabled: task prototypes does not read"):
        load_config(None, ["task=prototypes", "mixup.enabled=true"])

    # Train two epochs at once, and one epoch resumed to two: the same run.
    config = tmp_path / "prototypes.yaml"
    config.write_text("task: {name: prototypes, temperature: 2.0}\n")
    assert train(config, tmp_path / "whole", 2) == 0
    assert train(config, tmp_path / "part", 1) == 0
    assert train(config, tmp_path / "part", 2, "--resume") == 0
    logs = [
        [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("whole", "part")
    ]
    timings = ("seconds", "eval_seconds")  # wall times differ between any two runs
    strip = [[{k: v for k, v in line.items() if k not in timings} for line in log] for log in logs]
    assert strip[0] == strip[1] and "test/accuracy" in logs[0][-1]

    # Evaluate from the checkpoint alone: the number training logged.
    capsys.readouterr()
    assert (
        main(["evaluate", "--checkpoint", str(tmp_path / "whole"), "--which", "latest", "--json"])
        == 0
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == {"accuracy": logs[0][-1]["test/accuracy"]}
    assert main(["evaluate", "--checkpoint", str(tmp_path / "whole"), "--ks", "1,2"]) == 2
    assert "--ks do not apply to prototypes runs" in capsys.readouterr().err

    # Embed: the task's extra array beside the embeddings.
    images = write_images(tmp_path / "images", classes=2, per_class=3)
    out = tmp_path / "emb.npz"
    embed = ["embed", "--checkpoint", str(tmp_path / "whole"), "--images", str(images)]
    assert main([*embed, "--out", str(out), "--no-progress"]) == 0
    assert "with distances" in capsys.readouterr().out
    entries = read_entries(out)
    assert entries["distances"].shape == (6, 10) and bool((entries["distances"] >= 0).all())

    # Report: the task's own section, and the metric it logged.
    assert (
        main(["report", str(tmp_path / "whole"), "--out", str(tmp_path / "rep"), "--no-progress"])
        == 0
    )
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "<h3>Nearest prototype</h3>" in page and "prototypes" in page
    assert np.isclose(
        float(page.split("<h3>Nearest prototype</h3><p>accuracy ")[1][:6]),
        printed["accuracy"],
        atol=1e-4,
    )
