"""Contracts every entry of a registry keeps, parametrised over the registry itself: a loss, a
dataset or a task registered tomorrow is tested here without editing a list.

- ``LOSSES`` (:mod:`idml.losses`): the config section mirrors the hyper-parameter model, the loss
  builds from a config and gives a finite loss with gradients on plain and on Mixup set labels;
- ``DATASETS`` (:mod:`idml.data`): the options are what the loader takes, and a folder without
  the dataset is an error that names the folder;
- ``TASKS`` (:mod:`idml.app.tasks`): the config reads what the task declares (and refuses the
  rest), a stored config reads back, and one step of training evaluates to the metrics the task
  names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from idml.app import build
from idml.app.config import (
    LOSS_CONFIGS,
    RUN_KEYS,
    config_keys,
    config_to_dict,
    load_config,
    reads_key,
    validate_config,
)
from idml.app.tasks import TASKS
from idml.data import DATASETS, load_split
from idml.embeddings import Embeddings
from idml.losses import LOSSES
from idml.relations import LabelSets
from tiny_run import TINY


# --------------------------------------------------------------------------- losses
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_section_mirrors_its_params(name: str) -> None:
    spec = LOSSES[name]
    assert list(LOSS_CONFIGS[name].model_fields) == ["name", *spec.params.model_fields]
    defaults = load_config(None, [f"loss.name={name}"]).loss
    assert defaults.model_dump(exclude={"name"}) == spec.params().model_dump()


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_builds_from_a_config_and_trains_on_set_labels(name: str) -> None:
    spec = LOSSES[name]
    cfg = load_config(None, [f"loss.name={name}", "model.embedding_dim=6"])
    loss = build.build_loss(cfg, num_classes=3)
    assert name in repr(loss) or type(loss).__name__ in repr(loss)
    generator = torch.Generator().manual_seed(0)
    # A hard batch: the images cluster by i // 4 while the classes are i % 3, so positives lie
    # far apart and negatives close together and every loss (hinges included) has work to do.
    centres = torch.eye(6, dtype=torch.float64)[torch.arange(12) // 4]
    noise = 0.05 * torch.randn(12, 6, generator=generator, dtype=torch.float64)
    semantic = (centres + noise).requires_grad_(True)
    # A probabilistic loss reads (μ, log σ²) from the PEL head: give it an uncertainty input.
    uncertainty = (
        torch.randn(12, 6, generator=generator, dtype=torch.float64, requires_grad=True)
        if spec.probabilistic
        else None
    )
    loss = loss.double()
    labels = torch.arange(12) % 3
    # As Mixup appends them: 8 originals, then 4 images labelled with the sets {l_a, l_b}.
    mixed = LabelSets.coerce(labels[:8]).cat(LabelSets.mixed(labels[8:], (labels[8:] + 1) % 3))
    for targets in (labels, mixed):
        value = loss(Embeddings(semantic, uncertainty), targets)
        assert value.dim() == 0 and bool(torch.isfinite(value)), (name, targets)
        (grad,) = torch.autograd.grad(value, [semantic])
        assert bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0)


# --------------------------------------------------------------------------- datasets
@pytest.mark.parametrize("name", [n.value for n in DATASETS])
def test_dataset_options_are_the_loaders_keywords(name: str) -> None:
    from idml.data import DatasetName, dataset_options

    spec = DATASETS[DatasetName(name)]
    fields = {f.name for f in dataclasses.fields(spec.options)}
    assert set(dataset_options(name)) == fields
    spec.options()  # every option has a default: load_split(name, root) alone is a valid call
    assert not (spec.root is not None and not spec.takes_root)


@pytest.mark.parametrize("name", [n.value for n in DATASETS if DATASETS[n].takes_root])
def test_a_folder_without_the_dataset_is_an_error_naming_it(name: str, tmp_path: Path) -> None:
    empty = tmp_path / "not-the-dataset"
    empty.mkdir()
    with pytest.raises((ValueError, OSError)) as caught:
        load_split(name, empty)
    assert str(empty) in str(caught.value)


# --------------------------------------------------------------------------- tasks
@pytest.mark.parametrize("name", list(TASKS))
def test_task_reads_keys_the_config_has_and_refuses_the_others(name: str) -> None:
    task = TASKS[name]
    assert task.reads >= RUN_KEYS and task.reads <= config_keys()
    cfg = load_config(None, [f"task={name}"])
    assert cfg.task.name == name and cfg.eval.select in task.metric_names(cfg)
    stored = config_to_dict(cfg)
    assert validate_config(stored) == cfg  # a run's config.yaml reads back
    unread = sorted(
        key
        for key in config_keys() - {"task"}
        if key.count(".") == 1 and not any(key == r or key.startswith(r + ".") for r in task.reads)
    )
    for key in unread[:3]:
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        raw = {**stored, section: {**stored.get(section, {}), field: value}}
        with pytest.raises(ValueError, match=rf"^{key}: task {name} does not read this key"):
            validate_config(raw)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TASKS))
def test_task_trains_a_step_and_reports_its_metrics(name: str, tmp_path: Path) -> None:
    from idml.app.training import Trainer

    task = TASKS[name]
    settings = [item for item in TINY if reads_key(task.reads, item.split("=")[0])]
    cfg = load_config(None, [f"task={name}", *settings, "optim.max_steps_per_epoch=1"])
    result = Trainer(cfg, tmp_path / "run", progress=False).fit()
    assert set(task.metric_names(cfg)) <= set(result.final_metrics)
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
    loaded = task.load_run(tmp_path / "run")
    assert loaded.config == cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"pretrained": False})}
    )
