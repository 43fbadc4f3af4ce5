"""The mechanism and the matched controls: what ``u`` and ISM did in a finished run
(``mechanism.json``), what the uniform-weakening and margin-matched controls take from it, and when
such a control is not trained.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from idml_study.design import Arm
from idml_study.results import mean, run_files


def matched_values(idml_folder: Path) -> list[dict[str, Any]]:
    """What each trained run of the ISM arm in ``idml_folder`` recorded for its matched controls
    (``mechanism.json``'s ``matched``, :func:`matched_controls`)."""
    values = [
        json.loads(m.read_text())["matched"] for m in run_files(idml_folder, "mechanism.json")
    ]
    if not values:
        raise SystemExit(f"{idml_folder}: the controls are matched to it, but it has no run yet")
    return values


def matched_margin(values: Sequence[dict[str, Any]]) -> tuple[float, float | None]:
    """The positive margin of the margin-matched control: the mean over runs of the margin ISM
    acts as, and ``None``; or, where that mean passes the loss's negative margin, the negative
    margin and the mean it replaces. Past m_neg a positive and a negative pair between the two
    margins both cost nothing, so Contrastive refuses such margins; m_pos = m_neg is the largest
    positive margin (distance form) that still separates them. Runs recorded before the negative
    margin was (2026-12-04) are never capped: their controls trained.

    >>> matched_margin([{"pos_margin": 0.3, "neg_margin": 0.5}, {"pos_margin": 0.5}])
    (0.4, None)
    >>> matched_margin([{"pos_margin": 0.6, "neg_margin": 0.5, "similarity": False}] * 2)
    (0.5, 0.6)
    >>> matched_margin([{"pos_margin": 0.2, "neg_margin": 0.3, "similarity": True}])
    (0.3, 0.2)
    """
    margin = mean([v["pos_margin"] for v in values])
    bound = values[0].get("neg_margin")
    if bound is None:
        return margin, None
    crossed = margin < bound if values[0].get("similarity") else margin > bound
    return (bound, margin) if crossed else (margin, None)


def margin_copies_mixup(values: Sequence[dict[str, Any]]) -> str | None:
    """Why the margin-matched control would train Mixup only again, or ``None``: its margin
    (:func:`matched_margin`) is the recipe's own positive margin, as when the recipe's m_pos is
    already m_neg and the cap takes the control back to it. Runs recorded before their recipe's
    margin was (2026-12-04) never say so.

    >>> print(margin_copies_mixup([{"pos_margin": 0.7, "neg_margin": 0.5, "recipe_pos_margin": 0.5}]))
    ISM acts as m_pos = 0.7, capped at m_neg = 0.5, which is the recipe's own m_pos
    >>> margin_copies_mixup([{"pos_margin": 0.62, "neg_margin": 0.5, "recipe_pos_margin": 0.4}])
    """
    margin, uncapped = matched_margin(values)
    own = values[0].get("recipe_pos_margin")
    if own is None or not math.isclose(margin, own, rel_tol=0.0, abs_tol=1e-9):
        return None
    if uncapped is None:
        return f"ISM acts as m_pos = {margin:.4g}, the recipe's own m_pos"
    return f"ISM acts as m_pos = {uncapped:.4g}, capped at m_neg = {margin:.4g}, which is the recipe's own m_pos"


def idle_control(arms_folder: Path, arm: Arm) -> str | None:
    """Why the matched control ``arm`` of the grid in ``arms_folder`` is not trained (it would
    repeat another arm), or ``None``: so far only a margin-matched control whose margin is the
    recipe's own (:func:`margin_copies_mixup`), which would train Mixup only again."""
    if arm.match is None or arm.match.control != "margin":
        return None
    source = arms_folder / arm.match.to
    if not run_files(source, "mechanism.json"):
        return None
    copy = margin_copies_mixup(matched_values(source))
    return (
        None
        if copy is None
        else f"{copy}, so it would be Mixup only (IDML − Mixup only is its comparison)"
    )


def matched_setting(idml_folder: Path, control: str) -> tuple[str, float, float | None]:
    """The config key a matched control (``uniform`` or ``margin``) sets, the value it takes from
    the trained runs of the ISM arm in ``idml_folder`` (their ``mechanism.json``), and the value
    a cap replaced (:func:`matched_margin`; ``None`` if none)."""
    values = matched_values(idml_folder)
    if control == "uniform":
        return "metric.gamma", mean([v["gamma"] for v in values]), None
    return ("loss.pos_margin", *matched_margin(values))


def matched_overrides(idml_folder: Path, control: str) -> list[str]:
    """The overrides that match a control to the trained runs in ``idml_folder``."""
    key, value, _ = matched_setting(idml_folder, control)
    return [f"{key}={value:.6g}"]


def matched_section(folders: Mapping[str, Path], arms: Mapping[str, Arm]) -> list[str]:
    """A table's lines on its matched controls: for each group's folder (a loss, a degradation)
    and each matched control of ``arms`` with runs there, the value it took from the runs it
    matches, and why, where the margin was capped; no lines without such controls."""
    lines = []
    for group, folder in folders.items():
        for name, arm in arms.items():
            # A group's folder is named by its loss (or its degradation, which every arm has).
            if arm.match is None or not arm.trains_with(folder.name):
                continue
            source = folder / arm.match.to
            if not run_files(folder / name, "result.json"):
                if idle := idle_control(folder, arm):
                    lines.append(f"- {group}, {arm.label}: not trained: {idle}")
                continue
            key, value, uncapped = matched_setting(source, arm.match.control)
            said = f"{key} = {value:.4g}"
            if uncapped is not None:
                said += (
                    f" (ISM acts as {uncapped:.4g}, past the negative margin {value:.4g}, where "
                    "Contrastive no longer separates a positive from a negative pair: capped there)"
                )
            runs = len(run_files(source, "mechanism.json"))
            lines.append(f"- {group}, {arm.label}: {said}, from {runs} runs of `{arm.match.to}`")
    if not lines:
        return []
    return ["", "Matched controls (the mean over the runs they match):\n", *lines]


def write_mechanism(run_dir: Path, match_controls: bool) -> None:
    """``mechanism.json``: what ``u`` and ISM did in a finished run (see ``study_idml.py``)."""
    import torch

    from idml.app import build
    from idml.app.checkpoint import atomic_write_text
    from idml.app.trained_run import load_trained_run
    from idml.diagnostics import uncertainty_probe
    from idml.models import embed_dataset

    run = load_trained_run(run_dir, "latest")
    cfg, model = run.config, run.model
    data = build.build_data(cfg)
    device = torch.device("cpu")
    with torch.no_grad():
        emb, labels = embed_dataset(model, data.test, 256, device)
    assert emb.uncertainty is not None, f"{run_dir}: the mechanism needs an uncertainty head"
    level = emb.uncertainty.norm(dim=1).double()
    probe = uncertainty_probe(model, data.test, images=400)
    at_test = cfg.eval.model_copy(update={"introspective": True, "nmi": False})
    ism_at_test = build.evaluate(
        cfg.model_copy(update={"eval": at_test}), emb, labels, device
    ).metrics
    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = log[0], log[-1]
    out: dict[str, Any] = {
        "test_u_mean": float(level.mean()),
        "test_u_cv": float(level.std() / level.mean()),
        "probe_auroc": probe.auroc,
        "last_epoch": {k: v for k, v in last.items() if k.startswith(("ism/", "uncertainty/"))},
        "first_epoch": {k: v for k, v in first.items() if k.startswith("uncertainty/")},
        "ism_at_test": {k: ism_at_test[k] for k in ("recall@1", "map@r") if k in ism_at_test},
    }
    if match_controls:
        out["matched"] = matched_controls(cfg, model, data, run.checkpoint)
    atomic_write_text(run_dir / "mechanism.json", json.dumps(out, indent=2))


def stale_match(run_dir: Path) -> bool:
    """Whether a run's matched values (``mechanism.json``) are missing, or predate
    :func:`matched_controls` taking its loss's own relations for a proxy loss (they were taken over
    sample–sample pairs, which for a pair loss are its own relations)."""
    from idml.losses import LOSSES

    matched = json.loads((run_dir / "mechanism.json").read_text()).get("matched")
    if matched is None:
        return True
    if "relations" in matched:
        return False  # a run restored from the ledger has no config.yaml, and needs none here
    loss = yaml.safe_load((run_dir / "config.yaml").read_text())["loss"]["name"]
    return bool(LOSSES[loss].needs_proxies)


def rematch(run_dir: Path) -> None:
    """Recompute ``mechanism.json``'s matched values of a finished run (the rest is kept)."""
    from idml.app import build
    from idml.app.checkpoint import atomic_write_text
    from idml.app.trained_run import load_trained_run

    run = load_trained_run(run_dir, "latest")
    mechanism = run_dir / "mechanism.json"
    out = json.loads(mechanism.read_text())
    data = build.build_data(run.config)
    out["matched"] = matched_controls(run.config, run.model, data, run.checkpoint)
    atomic_write_text(mechanism, json.dumps(out, indent=2))


def matched_controls(
    cfg: Any, model: Any, data: Any, checkpoint: Path, batches: int = 8
) -> dict[str, Any]:
    """What the uniform-weakening and margin-matched controls take from a trained IDML model, on
    training batches drawn and mixed as in training (model in eval mode), over the relations its
    loss compares (``loss.weakening``: sample–sample pairs, or sample–proxy relations with the
    run's trained proxies for a proxy loss):

    - ``gamma``: the ``γ`` whose uniform weakening (no head, ``u ≡ 0``: ``y = γ·k`` with
      ``k = 1/(τ·α^p)`` per relation) has the same median over the positive relations as the
      learned ``e^{−y}``. ``e^{−γk}`` falls monotonically in ``k``, so its median is
      ``e^{−γ·median(k)}`` and ``γ = −log(median e^{−y}) / median(k)`` (exactly for an odd count of
      relations; to the neighbouring order statistic for an even one);
    - ``pos_margin`` (pair losses; ``None`` for a proxy loss, which has no positive margin to
      move): the margin ISM acts as on Contrastive's positive term. The distance form
      ``D_IN = δ·e^{−y}`` takes ``δ(1 − e^{−y})`` off a positive distance, which ``[D − m_pos]₊``
      reads as ``m_pos`` raised by that much; the similarity form ``S_IN = 1 − (δ²/2)·e^{−y}``
      adds ``(δ²/2)(1 − e^{−y})`` to a positive similarity, which ``[m_pos − S]₊`` reads as
      ``m_pos`` lowered by that much. The median over the positive pairs is taken;
      ``neg_margin`` and ``similarity`` (the loss's negative margin and metric form) let
      :func:`matched_margin` keep the control's margins from crossing, and ``recipe_pos_margin``
      (the run's own) lets :func:`margin_copies_mixup` tell when the control would be Mixup only.

    (Until 2026-12-02 the relations were always the batch's sample–sample pairs: right for the
    pair losses, but for ProxyAnchor a weakening about ten times the one its proxies saw.)
    """
    import copy

    import torch

    from idml.app import build
    from idml.app.checkpoint import load_training_state
    from idml.embeddings import Embeddings
    from idml.losses.base import ProxyLoss
    from idml.metrics import IntrospectiveMetric

    loss = build.build_loss(cfg, data.num_train_classes)
    load_training_state(checkpoint, {"loss": loss}, {})
    proxy = isinstance(loss, ProxyLoss)
    # The same relations at γ = 1 with u ≡ 0 (proxies' too): their factor is e^{−k}, so −log of
    # it is k.
    unit_loss = copy.deepcopy(loss)
    assert isinstance(unit_loss.metric, IntrospectiveMetric), "the controls need ISM"
    unit_loss.metric.gamma = 1.0
    if isinstance(unit_loss, ProxyLoss):
        unit_loss.proxy_uncertainty = None
    augment = build.build_augmentations(cfg)
    learned, unit, chords = [], [], []
    generator = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the loader's crops draw from the global generator
    loader = build.train_loader(cfg, data, 0, generator, num_replicas=1, rank=0)
    with torch.no_grad():
        for step, (images, labels, *_) in enumerate(loader):
            if step >= batches:
                break
            batch = augment(images, labels, generator)
            emb = model(batch.images)
            found = loss.weakening(emb, batch.labels)
            assert found is not None, "the matched controls need an introspective loss"
            factors, positive, _ = found
            learned.append(factors[positive])
            no_head = Embeddings(emb.semantic, torch.zeros_like(emb.uncertainty))
            at_one = unit_loss.weakening(no_head, batch.labels)
            assert at_one is not None
            unit.append(-torch.log(at_one[0][positive].double()))
            if not proxy:
                s = emb.semantic
                chords.append((2 - 2 * s @ s.T).clamp_min(0).sqrt()[positive])
    weakening = torch.cat(learned).double()
    target = float(weakening.median())
    gamma = -math.log(target) / float(torch.cat(unit).median())
    pos_margin = None
    base_margin = float(getattr(loss, "pos_margin", 0.0) or 0.0)
    if not proxy:
        delta = torch.cat(chords).double()
        if loss.metric.is_similarity:
            pos_margin = base_margin - float((delta**2 / 2 * (1 - weakening)).median())
        else:
            pos_margin = base_margin + float((delta * (1 - weakening)).median())
    return {
        "gamma": gamma,
        "median_weakening": target,
        "pos_margin": pos_margin,
        "neg_margin": getattr(loss, "neg_margin", None),
        "recipe_pos_margin": None if proxy else base_margin,
        "similarity": bool(loss.metric.is_similarity),
        "relations": "proxy" if proxy else "pair",
    }


def control_overrides(arms_folder: Path, arm: Arm) -> list[str]:
    """The overrides a matched control takes from the runs of the arm it matches (a sibling folder
    in ``arms_folder``); none for an arm that is not a matched control."""
    if arm.match is None:
        return []
    return matched_overrides(arms_folder / arm.match.to, arm.match.control)
