"""One source of truth per extension point: the loss registry and the README's 'Extending idml'."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import Field

from idml.app import build
from idml.app.config import LOSS_CONFIGS, ConfigError, load_config, validate_config
from idml.losses import LOSSES, LossParams, MetricLoss, ProxyAnchorLoss, register_loss
from idml.losses import registry as loss_registry
from readme_doctest import run_readme_section


@pytest.fixture
def restore_losses() -> Iterator[None]:
    """Losses registered by a test are gone after it."""
    before = dict(loss_registry._LOSSES)
    yield
    loss_registry._LOSSES.clear()
    loss_registry._LOSSES.update(before)


def test_readme_extending_example(restore_losses: None) -> None:
    """The README's 'Extending idml' walk-through registers a loss and a task and runs as written."""
    from idml.app.tasks import TASKS, unregister_task

    try:
        result = run_readme_section("## Extending idml")
        assert "deduplication" in TASKS
    finally:
        unregister_task("deduplication")
    assert result.failed == 0 and result.attempted > 15
    assert "centroid" in LOSS_CONFIGS


def test_readme_library_example() -> None:
    """The README's 'Using the library' block (model → Mixup → loss → step → evaluation) runs."""
    result = run_readme_section("## Using the library")
    assert result.failed == 0 and result.attempted > 15


def test_config_sections_follow_the_registry() -> None:
    # Each section's keys: tests/test_registries.py, for every registered loss.
    assert list(LOSS_CONFIGS) == list(LOSSES)


def test_constructor_defaults_come_from_the_params_model() -> None:
    loss = ProxyAnchorLoss(num_classes=3, embedding_dim=4)
    assert (
        (loss.alpha, loss.margin)
        == (32.0, 0.1)
        == tuple(ProxyAnchorLoss.params().model_dump().values())
    )


def test_natural_metric_and_flags() -> None:
    similarity = {n for n, s in LOSSES.items() if s.natural_metric().is_similarity}
    assert similarity == {"multi_similarity", "normalized_softmax", "proxy_anchor"}
    assert (
        LOSSES["fastap"].natural_metric().power == LOSSES["proxy_nca"].natural_metric().power == 2
    )
    assert [n for n, s in LOSSES.items() if s.probabilistic] == ["pel"]
    proxies = {n for n, s in LOSSES.items() if s.needs_proxies}
    assert proxies == {"normalized_softmax", "proxy_nca", "proxy_anchor"}


def test_bounds_and_cross_field_rules_reach_the_config() -> None:
    with pytest.raises(ConfigError, match=r"^loss\.alpha: Input should be greater than 0"):
        load_config(None, ["loss.alpha=0"])
    # A key named like a loss (the margin loss's margin) keeps its name in the message.
    with pytest.raises(ConfigError, match=r"^loss\.margin: Input should be greater than or equal"):
        load_config(None, ["loss.name=margin", "loss.margin=-1"])
    with pytest.raises(ConfigError, match="need cutoff < nonzero_loss_cutoff"):
        load_config(None, ["loss.name=margin", "loss.cutoff=2"])


def test_registering_needs_a_free_identifier(restore_losses: None) -> None:
    class Params(LossParams):
        weight: float = Field(1.0, gt=0)

    class Tiny(MetricLoss):
        params = Params

        def __init__(self, metric: object = None, weight: float = Params().weight) -> None:
            super().__init__(metric)  # type: ignore[arg-type]
            self.weight = weight

    with pytest.raises(ValueError, match="taken by ProxyAnchorLoss"):
        register_loss("proxy_anchor", Tiny)
    with pytest.raises(ValueError, match="identifier"):
        register_loss("not a name", Tiny)
    register_loss("tiny", Tiny)
    cfg = validate_config({"loss": {"name": "tiny", "weight": 3}})
    loss = build.build_loss(cfg, 2)
    assert loss.weight == 3.0 and not loss.metric.is_similarity
    with pytest.raises(ConfigError, match=r"valid loss names: .*, pel, tiny"):
        validate_config({"loss": {"name": "tin"}})
