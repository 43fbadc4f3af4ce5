"""Is IDML's introspection real, and does it help? ISM against the controls that isolate it.

The question (issue "IDML whose introspection is real"): with an uncertainty embedding ``u`` that
moves, does the introspective similarity metric (ISM) improve retrieval of unseen classes beyond what
Mixup, a frozen ``u`` and a uniform weakening give? Every arm of a setting trains the same steps from
the same initialisation and batches (seed ``s`` of every arm), and the tables report last-epoch test
metrics with paired tests over seeds, Holm-corrected across each table.

Settings (zero-shot: train and test classes are disjoint):

- ``demo``: ``idml demo``'s data and model (scikit-learn's digits, small CNN from scratch, 16 px),
  with the standard first-half/second-half class split (0–4 train, 5–9 test).
- ``omniglot_cnn``: Omniglot's minimal background splits (136 training characters of five
  alphabets, 106 test characters of three others), 28 px, a small CNN from scratch.
- ``omniglot_lite0`` / ``fashion_lite0``: Omniglot at 32 px / Debian's Fashion-MNIST (0–4 train,
  5–9 test, 200 images a class), EfficientNet-Lite0 from its shipped ImageNet weights.

Arms (:data:`ARMS`), each for Multi-Similarity, ProxyAnchor and Contrastive:

- ``baseline`` (plain metric, no Mixup), ``mixup`` (Mixup set labels), ``ism`` (ISM alone),
  ``idml`` (ISM + Mixup: the paper's method with the default uncertainty head);
- the controls of ``idml``: ``idml_frozen_u`` (the head never trains: ``u`` stays at its start),
  ``idml_uniform`` (no head, ``u ≡ 0``, and ``γ`` chosen so that the uniform weakening
  ``e^{−γ/(τδ)}`` has the same median over the positive relations the loss compares — pairs of
  samples, or samples and their proxies for ProxyAnchor — as ``idml``'s learned one) and, for
  Contrastive, ``mixup_margin`` (Mixup with the positive margin moved by the median amount ISM
  moves positive pairs in ``idml``: the margin ISM acts as, :func:`matched_controls`; capped at
  the negative margin, which Contrastive's margins may not cross, :func:`matched_margin`; not
  trained where that is the recipe's own margin, which would make it Mixup only again,
  :func:`idle_control`);
- ``idml_u_high``: ``idml`` with ``u`` starting at a quarter of its bound instead of 2 %
  (``model.uncertainty.init_level=0.25``): does the objective bring ``u`` back to the level where
  ISM is near the identity, or does the weakening stay where it starts? And where ISM does weaken
  pairs unevenly, does it help? Its own controls: ``idml_u_high_frozen_u`` (the same start, the
  head never trains) and ``idml_u_high_uniform`` (``u ≡ 0``, γ matched to its weakening), compared
  in a table of their own (:data:`U_HIGH_COMPARISONS`, Holm within it).
- ``idml_ext``: ``idml`` plus the Mixup-supervised uncertainty *extension*
  (``mixup.uncertainty_weight``, :mod:`idml.losses.ambiguity`), never the default.

Recipes (``validate``): the baseline's hyper-parameters are chosen per setting and loss on a
validation split of the *training* classes (``data.protocol=validation``; the test classes are never
loaded), by the highest mean validation MAP@R over the seeds; every arm then uses them. The knobs
are the ones a broken baseline recipe was traced to: ProxyAnchor's proxy learning rate (a multiple
of the heads'), Contrastive's positive margin, and the step budget (``optim.epochs``: the setting's
and twice that). Pretrained settings train heads only for the first epoch (``optim.warmup_epochs=1``,
as the presets do). The chosen recipes are stored in ``benchmarks/study/idml_recipes.json``.
``converge`` then trains each chosen recipe at twice its budget: a budget is converged when that
gains less than :data:`CONVERGED_GAIN` validation MAP@R points, and ``--adopt`` doubles the ones that
are not (each doubling in the recipe's ``history``). ``widen`` does the same for a knob whose chosen
value is the largest (or smallest) tried: it trains the recipe with the knob one step further
(m_pos + 0.2 up to m_neg = 0.5, which it may meet but not cross; the proxy rate ×10) and
``--adopt`` takes it on the same rule, recording every trial (``widened``) so that a knob's range
grows until the choice lies inside it (or meets its ceiling). A run folder pins the recipe its runs
used (``<loss>/recipe.json``), so a grid at an adopted recipe goes to a new
``--out``, its tables named by ``--label``; ``run --recipe pinned`` adds arms or seeds to an older
grid at the recipe it pins.
A setting's folder pins the memory format its runs train in (``memory_format.json``): runs added to
a folder trained before channels-last became the CPU's default keep the contiguous layout.

Diagnostics (``run --override KEY=VALUE``, repeatable): every run of the grid trains with these
config overrides on top of its recipe, for a question the validated recipe does not ask ("does the
collapse go away at a tenth of the backbone's rate?"). They may change the setting's or the recipe's
keys, never a key an arm sets (that would make two arms one) nor the seed. The setting folder pins
them (``study_overrides.json``) as it pins its layout, so a folder's runs all share one set, a grid
of the plain recipe never gains a diagnostic run, and its tables print them: run a diagnostic in its
own ``--out``. Recipes are chosen without them (``validate``, ``converge`` and ``widen`` refuse it).

Ledger (``benchmarks/study/ledger/<--out's name>``, committed): each finished run's
``result.json`` and ``mechanism.json`` and each folder's pins, copied as runs finish and restored into
an empty ``--out`` of the same name at the start of every command. A session's machine does not
outlive it, and a Lite0 grid takes longer than one: with its ledger committed, a grid resumes on the
next machine at its first unfinished seed, and its tables can be drawn anywhere (a restored run is
reused because its record names the same config; ``data.root`` is part of it, so keep
``--omniglot-root`` where it was).

Mechanism (``mechanism.json`` beside each run with an uncertainty head): ``||u||`` over the test
images (mean and coefficient of variation), the AUROC of ``||u||`` for "altered vs clean" test
images (Mixup, low resolution, blur, occlusion; :func:`idml.diagnostics.uncertainty_probe`), the
last epoch's weakening quantiles and ``||u||`` spread over training batches (``metrics.jsonl``), the
trend of ``||u||`` for original and Mixup (or degraded) training images, and the test metrics with
ISM at test time (the paper's Table 5 ablation).

Degradations (``--degradations``): the paper's Table 3 (low resolution, blur, occlusion of a quarter
of each batch instead of Mixup), for baseline, ISM and ISM's two controls, and ISM with ``u``
starting high with its own two (``--kinds`` and ``--arms`` stage it: each kind's cost first).

Run (each step reuses finished runs; ``--workers 2`` trains two runs at a time, one thread each):

    python benchmarks/study_idml.py validate --setting demo --seeds 2
    python benchmarks/study_idml.py converge --setting demo --seeds 3   # the chosen budget, doubled
    python benchmarks/study_idml.py converge --setting demo --seeds 3 --adopt   # ... and adopted
    python benchmarks/study_idml.py widen --setting demo --seeds 3 --adopt   # a knob at its edge
    python benchmarks/study_idml.py run --setting demo --seeds 10
    python benchmarks/study_idml.py tables --setting demo
    python benchmarks/study_idml.py run --setting demo --arms mixup --seeds 3 \\
        --override optim.backbone_lr_mult=0.1 --out runs/diag_slow_backbone   # a diagnostic

(``--omniglot-root`` defaults to ``../shared/data/omniglot`` beside the repository; the library never
reads that folder.)
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OMNIGLOT = REPO.parent / "shared" / "data" / "omniglot"
TABLES = REPO / "benchmarks" / "study"
RECIPES = TABLES / "idml_recipes.json"
FOLDER_RECIPE = "recipe.json"
"""Beside a loss's arms in a run folder: the recipe its runs were trained with (:func:`pin_recipe`)."""

CONVERGED_GAIN = 1.0
"""Validation MAP@R points: a budget counts as converged when twice its epochs gain less than this
(paired mean over seeds); ``converge --adopt`` doubles a recipe's budget while the gain reaches it.
One point is about the seed-to-seed spread of a validation MAP@R, and a third of the smallest
difference the study's tables call (▲/▼) with 10 seeds."""

TRAINS_MARGIN = 1.0
"""MAP@R points by which a baseline must beat the untrained network's features (mean over seeds) to
count as trained (:func:`floor_notes`): the same one point of seed-to-seed spread as
:data:`CONVERGED_GAIN`. MAP@R, the metric recipes are chosen by, because R@1 saturates on a
two-class validation split (Lite0's training-free features already reach 89 % on Fashion-MNIST's).
A baseline below it is a broken recipe (issue 21), and its loss's comparisons are not evidence
about ISM."""

LOSSES = ("multi_similarity", "proxy_anchor", "contrastive")
LOSS_NAMES = {
    "multi_similarity": "Multi-Similarity",
    "proxy_anchor": "ProxyAnchor",
    "contrastive": "Contrastive",
}

COMMON = [
    "data.resize_size=null",
    "data.num_workers=0",
    "data.horizontal_flip=false",
    "optim.amp=false",
    "optim.scheduler=cosine",
    "optim.grad_clip=10",
    "eval.every=1000",
    "eval.nmi_backend=sklearn",
    "tensorboard=false",
    "mixup.fraction=0.5",
]
SMALL_CNN = [
    "model.backbone=small_cnn",
    "model.pretrained=false",
    "model.embedding_dim=64",
    "optim.lr=0.003",
]
LITE0 = [
    "model.backbone=efficientnet_lite0",
    "model.pretrained=true",
    "model.embedding_dim=128",
    "optim.lr=0.0003",
    "optim.head_lr_mult=10",
    "optim.warmup_epochs=1",
]


FIVE_CLASS_VALIDATION = (
    "data.validation_classes=0.4",
    "sampler.classes_per_batch=3",
    "sampler.images_per_class=20",
)


@dataclass(frozen=True)
class Setting:
    """A dataset × backbone of the study: its overrides and its step budget (epochs)."""

    overrides: tuple[str, ...]
    epochs: int
    pretrained: bool
    needs_omniglot: bool = False
    validation: tuple[str, ...] = ()
    """What ``validate`` changes besides ``data.protocol=validation`` (digits and Fashion-MNIST
    hold out two of their five training classes, since one held-out class would make every
    query's neighbours right, and batch the three left)."""


SETTINGS: dict[str, Setting] = {
    "demo": Setting(
        (
            *COMMON,
            *SMALL_CNN[:2],
            "data.dataset=digits",
            "data.image_size=16",
            "model.embedding_dim=64",
            "optim.lr=0.003",
            "sampler.classes_per_batch=5",
            "sampler.images_per_class=12",
            "data.train_crop_scale=[0.7, 1.0]",
        ),
        epochs=8,
        pretrained=False,
        validation=FIVE_CLASS_VALIDATION,
    ),
    "omniglot_cnn": Setting(
        (
            *COMMON,
            *SMALL_CNN,
            "data.dataset=omniglot",
            "data.image_size=28",
            "data.train_crop_scale=[0.8, 1.0]",
            "sampler.classes_per_batch=12",
            "sampler.images_per_class=5",
        ),
        epochs=5,
        pretrained=False,
        needs_omniglot=True,
    ),
    "omniglot_lite0": Setting(
        (
            *COMMON,
            *LITE0,
            "data.dataset=omniglot",
            "data.image_size=32",
            "data.train_crop_scale=[0.8, 1.0]",
            "sampler.classes_per_batch=12",
            "sampler.images_per_class=5",
        ),
        epochs=4,
        pretrained=True,
        needs_omniglot=True,
    ),
    "fashion_lite0": Setting(
        (
            *COMMON,
            *LITE0,
            "data.dataset=fashion_mnist",
            "data.samples_per_class=200",
            # Five training classes: the same batch of 60 as P×K = 12×5 elsewhere, as 5×12.
            "sampler.classes_per_batch=5",
            "sampler.images_per_class=12",
            "data.image_size=32",
            "data.train_crop_scale=[0.7, 1.0]",
        ),
        epochs=4,
        pretrained=True,
        validation=FIVE_CLASS_VALIDATION,
    ),
}


@dataclass(frozen=True)
class Method:
    """Which of IDML's parts an arm trains with: the uncertainty head, the introspective metric
    (ISM) and Mixup's set labels. ISM without a head is ``u ≡ 0``: a uniform weakening by γ."""

    head: bool
    ism: bool
    mixup: bool

    @property
    def overrides(self) -> tuple[str, ...]:
        def flag(on: bool) -> str:
            return "true" if on else "false"

        return (
            f"model.uncertainty.enabled={flag(self.head)}",
            f"metric.introspective={flag(self.ism)}",
            f"mixup.enabled={flag(self.mixup)}",
        )


BASELINE = Method(head=False, ism=False, mixup=False)
MIXUP = Method(head=False, ism=False, mixup=True)
ISM = Method(head=True, ism=True, mixup=False)
IDML = Method(head=True, ism=True, mixup=True)


U_HIGH = "model.uncertainty.init_level=0.25"
"""``u`` starting at a quarter of its bound (the default starts at 2 %)."""


@dataclass(frozen=True)
class Match:
    """A control matched to another arm's trained runs (:func:`matched_controls`): the uniform
    weakening (γ) or the positive margin ISM acts as, taken from the runs of arm ``to``."""

    control: Literal["uniform", "margin"]
    to: str


@dataclass(frozen=True)
class Arm:
    """One arm: its method and further overrides, and the losses it applies to (``None``: all)."""

    label: str
    method: Method
    extra: tuple[str, ...] = ()
    losses: tuple[str, ...] | None = None
    match: Match | None = None
    """Set for a control whose overrides depend on another arm's trained runs."""

    @property
    def overrides(self) -> tuple[str, ...]:
        return (*self.method.overrides, *self.extra)

    @property
    def has_head(self) -> bool:
        return self.method.head

    @property
    def matched(self) -> bool:
        return self.match is not None


FROZEN_U = "optim.uncertainty_lr_mult=0"
"""Trains with the uncertainty head frozen at its start."""


def with_controls(
    name: str,
    labels: tuple[str, str, str],
    method: Method,
    extra: tuple[str, ...] = (),
    uniform_name: str | None = None,
) -> dict[str, Arm]:
    """An ISM arm and the two controls that isolate it: the same arm with ``u`` frozen at its start
    (``<name>_frozen_u``), and no head (``u ≡ 0``) with γ matched so the uniform weakening has the
    learned one's median (``uniform_name``, default ``<name>_uniform``); Mixup as ``method`` has it.
    ``labels`` are the three arms' table labels."""
    assert method.head and method.ism, f"{name}: the controls isolate ISM with a head"
    no_head = Method(head=False, ism=True, mixup=method.mixup)
    return {
        name: Arm(labels[0], method, extra),
        f"{name}_frozen_u": Arm(labels[1], method, (*extra, FROZEN_U)),
        uniform_name or f"{name}_uniform": Arm(labels[2], no_head, match=Match("uniform", name)),
    }


ARMS: dict[str, Arm] = {
    "baseline": Arm("baseline", BASELINE),
    "mixup": Arm("Mixup only", MIXUP),
    "ism": Arm("ISM only", ISM),
    **with_controls(
        "idml",
        ("IDML", "IDML, u frozen", "IDML, u = 0 and matched γ (uniform weakening)"),
        IDML,
    ),
    "mixup_margin": Arm(
        "Mixup only, margin matched to IDML",
        MIXUP,
        losses=("contrastive",),
        match=Match("margin", "idml"),
    ),
    **with_controls(
        "idml_u_high",
        (
            "IDML, u starting high",
            "IDML, u starting high, frozen",
            "IDML, u = 0 and γ matched to u starting high (uniform weakening)",
        ),
        IDML,
        (U_HIGH,),
    ),
    "idml_ext": Arm(
        "IDML + Mixup-supervised u (extension)",
        IDML,
        ("mixup.uncertainty_weight=1.0",),
    ),
}

DEGRADATIONS = {
    "low_resolution": "degradations.low_resolution_fraction=0.25",
    "blur": "degradations.blur_fraction=0.25",
    "occlusion": "degradations.occlusion_fraction=0.25",
}
DEGRADATION_ARMS: dict[str, Arm] = {
    "deg_baseline": Arm("baseline + degraded images", BASELINE),
    **with_controls(
        "deg_ism",
        (
            "ISM + degraded images",
            "ISM + degraded images, u frozen",
            "ISM + degraded images, u = 0 and matched γ (uniform weakening)",
        ),
        ISM,
        uniform_name="deg_uniform",  # the name its run folders already have
    ),
    **with_controls(
        "deg_ism_u_high",
        (
            "ISM + degraded images, u starting high",
            "ISM + degraded images, u starting high, frozen",
            "ISM + degraded images, u = 0 and γ matched to u starting high (uniform weakening)",
        ),
        ISM,
        (U_HIGH,),
    ),
}
DEGRADATION_LOSS = "multi_similarity"
MATCHED_TO = frozenset(
    arm.match.to for arm in (*ARMS.values(), *DEGRADATION_ARMS.values()) if arm.match is not None
)
"""The arms whose runs record what their matched controls take (``mechanism.json``'s ``matched``)."""


@dataclass(frozen=True)
class Knob:
    """A baseline hyper-parameter that ``validate`` chooses, beside the budget, and ``widen``
    extends when the choice lies at the edge of what was tried."""

    form: str
    """Its part of a recipe's name, ``{}`` standing for the value: ``m_pos={}``."""
    key: str
    grid: tuple[float, ...]
    """The values ``validate`` tries (ints print as ints: ``proxy_lr×10``)."""
    factor: float = 0.0
    """Each step outward multiplies the value by this (a geometric knob) ..."""
    step: float = 0.0
    """... or adds this (an arithmetic one)."""
    floor: float = 0.0
    """No step below this (a margin below 0 or a rate of 0 is no recipe)."""
    ceiling: float = math.inf
    """No step above this: a step that would pass it stops at it (Contrastive's m_pos may meet
    m_neg, never cross it)."""

    def value_text(self, value: float) -> str:
        return str(value) if isinstance(value, int) else repr(round(value, 6))

    def part(self, value: float) -> str:
        return self.form.format(self.value_text(value))

    def override(self, value: float) -> str:
        return f"{self.key}={self.value_text(value)}"

    def value_of(self, recipe: str) -> float | None:
        """The knob's value in a recipe's name, ``None`` if it does not name the knob.

        >>> KNOBS["contrastive"].value_of("m_pos=0.4, 32 epochs")
        0.4
        >>> KNOBS["proxy_anchor"].value_of("proxy_lr×10, 16 epochs")
        10
        """
        prefix = self.form.split("{}")[0]
        for part in recipe.split(", "):
            if part.startswith(prefix):
                text = part.removeprefix(prefix)
                return float(text) if "." in text else int(text)
        return None

    def beyond(self, value: float, upward: bool) -> float | None:
        """One step past ``value`` (up or down), stopping at the ceiling: ``None`` below the floor,
        or up from a value at the ceiling.

        >>> KNOBS["contrastive"].beyond(0.2, upward=True), KNOBS["contrastive"].beyond(0.4, True)
        (0.4, 0.5)
        >>> KNOBS["contrastive"].beyond(0.5, upward=True), KNOBS["contrastive"].beyond(0.5, False)
        (None, 0.3)
        """
        if self.factor:
            out = value * self.factor if upward else value / self.factor
            out = int(out) if isinstance(value, int) and float(out).is_integer() else out
        else:
            out = round(value + self.step if upward else value - self.step, 6)
        if out < self.floor or (upward and value >= self.ceiling):
            return None
        return min(out, self.ceiling)


M_NEG = 0.5
"""Contrastive's negative margin in every setting: the Euclidean default
(``idml.losses.contrastive.DISTANCE_MARGINS``, not imported here: torch must not load before
``main`` limits its threads), and the ceiling of its positive margin."""

KNOBS: dict[str, Knob] = {
    "proxy_anchor": Knob("proxy_lr×{}", "optim.proxy_lr_mult", (1, 10, 100), factor=10, floor=0.01),
    "contrastive": Knob(
        "m_pos={}", "loss.pos_margin", (0.0, 0.2, 0.4), step=0.2, floor=0.0, ceiling=M_NEG
    ),
}
"""The knob each loss's broken baseline recipe was traced to (issue 21); Multi-Similarity has none
beyond the budget."""


def recipe_candidates(setting: str, loss: str) -> dict[str, tuple[str, ...]]:
    """The baseline recipes ``validate`` compares for ``loss`` in ``setting``, by name."""
    epochs = SETTINGS[setting].epochs
    knobs: dict[str, tuple[str, ...]] = {"": ()}
    if loss in KNOBS:
        knob = KNOBS[loss]
        knobs = {knob.part(v): (knob.override(v),) for v in knob.grid}
    out = {}
    for budget in (epochs, 2 * epochs):
        for name, overrides in knobs.items():
            label = ", ".join(x for x in (name, f"{budget} epochs") if x)
            out[label] = (*overrides, f"optim.epochs={budget}")
    return out


def grid_edges(setting: str, loss: str, chosen: str) -> list[str]:
    """The knobs whose largest tried value ``chosen`` (a :func:`recipe_candidates` name) takes:
    the epoch budget at twice the setting's, the proxy-rate multiplier at 100, m_pos at 0.4.

    >>> grid_edges("demo", "contrastive", "m_pos=0.4, 16 epochs")
    ['m_pos=0.4 is the largest m_pos tried', '16 epochs is the largest budget tried']
    >>> grid_edges("demo", "contrastive", "m_pos=0.2, 8 epochs")
    []
    """
    names = list(recipe_candidates(setting, loss))
    last = names[-1].split(", ")
    edges = []
    for part in chosen.split(", "):
        if part in last:
            kind = "budget" if part.endswith("epochs") else part.split("=")[0].split("×")[0]
            edges.append(f"{part} is the largest {kind} tried")
    return edges


def widened_knob(loss: str, chosen: dict[str, Any]) -> tuple[str, tuple[str, ...]] | None:
    """The name and overrides of a stored recipe (``idml_recipes.json``) with its knob one step past
    the edge of every value tried — ``validate``'s grid and the earlier ``widen`` trials the recipe
    records — when its value is that edge; ``None`` when the tried values bracket it (or the loss
    has no knob). Only the knob moves: the budget and every other override stay.

    >>> widened_knob("contrastive", {"recipe": "m_pos=0.4, 32 epochs",
    ...                              "overrides": ["loss.pos_margin=0.4", "optim.epochs=32"]})
    ('m_pos=0.5, 32 epochs', ('loss.pos_margin=0.5', 'optim.epochs=32'))
    >>> widened_knob("contrastive", {"recipe": "m_pos=0.4, 32 epochs",
    ...                              "overrides": ["loss.pos_margin=0.4", "optim.epochs=32"],
    ...                              "widened": [{"value": 0.5, "gain": -0.4}]}) is None
    True
    >>> widened_knob("proxy_anchor", {"recipe": "proxy_lr×1, 8 epochs",
    ...                               "overrides": ["optim.proxy_lr_mult=1", "optim.epochs=8"]})
    ('proxy_lr×0.1, 8 epochs', ('optim.proxy_lr_mult=0.1', 'optim.epochs=8'))
    >>> widened_knob("proxy_anchor", {"recipe": "proxy_lr×10, 8 epochs",
    ...                               "overrides": ["optim.proxy_lr_mult=10", "optim.epochs=8"]})
    """
    knob = KNOBS.get(loss)
    value = knob.value_of(chosen["recipe"]) if knob else None
    if knob is None or value is None:
        return None
    tried = {*knob.grid, *(trial["value"] for trial in chosen.get("widened", []))}
    if value >= max(tried):
        target = knob.beyond(value, upward=True)
    elif value <= min(tried):
        target = knob.beyond(value, upward=False)
    else:
        return None
    if target is None:
        return None
    name = chosen["recipe"].replace(knob.part(value), knob.part(target))
    overrides = tuple(
        knob.override(target) if o.startswith(knob.key + "=") else o for o in chosen["overrides"]
    )
    return name, overrides


# --------------------------------------------------------------------------- configuration
def setting_overrides(args: argparse.Namespace, pin: bool = True) -> list[str]:
    """The overrides every run of ``args.setting`` in ``args.out`` trains with: the setting's, its
    data, and the memory format the folder's runs use (:func:`memory_format`; ``pin``: record it
    for a new folder)."""
    spec = SETTINGS[args.setting]
    out = [*spec.overrides, f"optim.epochs={spec.epochs}"]
    if spec.needs_omniglot:
        out.append(f"data.root={args.omniglot_root}")
    if args.quick:
        out += ["optim.max_steps_per_epoch=3"]
    return [*out, memory_format(args.out / args.setting, pin)]


FOLDER_MEMORY_FORMAT = "memory_format.json"
"""Beside a setting's runs: the memory format they train in (:func:`memory_format`)."""

LEGACY_LAYOUT = "optim.channels_last=false"
"""The layout :func:`memory_format` pins to a folder trained before the pin existed."""


FOLDER_OVERRIDES = "study_overrides.json"
"""Beside a setting's runs: the ``--override`` values they all train with (:func:`study_overrides`)."""


def trained_runs(folder: Path) -> bool:
    """Whether ``folder`` holds a run that trained, or the record of one (restored from a ledger)."""
    return folder.is_dir() and any(
        path.name in ("metrics.jsonl", "result.json") for path in folder.rglob("*.json*")
    )


def said(overrides: Sequence[str]) -> str:
    """``overrides`` as the command line that asks for them."""
    return " ".join(f"--override {o}" for o in overrides) or "no --override"


def study_overrides(args: argparse.Namespace, pin: bool) -> list[str]:
    """The ``--override`` values every run in ``args.out / args.setting`` trains with: those the
    folder pins, which ``args.override`` (when given, or when ``pin``) must repeat. A folder without
    the pin whose runs trained, trained without overrides; a new folder pins what it is asked for
    (``pin``). A mismatch stops the command: one folder never mixes a diagnostic with the recipe."""
    folder = args.out / args.setting
    path = folder / FOLDER_OVERRIDES
    asked = list(getattr(args, "override", None) or [])
    if path.is_file():
        pinned: list[str] | None = list(json.loads(path.read_text())["overrides"])
    else:
        pinned = [] if trained_runs(folder) else None
    if pinned is None:
        if pin:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"overrides": asked}, indent=2) + "\n")
        return asked
    if (pin or asked) and asked != pinned:
        raise SystemExit(
            f"{folder}: its runs trained with {said(pinned)}, this command asks for {said(asked)}; "
            "a folder's runs share one set of overrides, so run a diagnostic in its own --out "
            f"(or repeat the folder's: {said(pinned)})"
        )
    return pinned


def memory_format(setting_folder: Path, pin: bool) -> str:
    """The ``optim.channels_last`` override of every run in ``setting_folder``, the same for all of
    them. Channels-last became the CPU's default on 2026-12-03: the same float32 sums in another
    order, which training's chaos turns into a seed-sized difference, so a grid grown after that
    must not mix its new runs' layout with its old ones'. The layout is pinned at a folder's first
    run (``pin``); a folder with runs but no pin was trained before, in the default layout."""
    path = setting_folder / FOLDER_MEMORY_FORMAT
    if path.is_file():
        return str(json.loads(path.read_text())["override"])
    override = LEGACY_LAYOUT if trained_runs(setting_folder) else "optim.channels_last=true"
    if pin:
        setting_folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"override": override}, indent=2) + "\n")
    return override


LEDGER = TABLES / "ledger"
"""The committed copy of each study folder's small files (:class:`Ledger`), one subfolder per
``--out`` by its name."""

DURABLE_FILES = frozenset({FOLDER_MEMORY_FORMAT, FOLDER_OVERRIDES, FOLDER_RECIPE, "untrained.json"})
"""A study folder's pins and caches, kept in its ledger wherever they lie."""
DURABLE_RUN_FILES = frozenset({"result.json", "mechanism.json"})
"""A finished run's record: what ``run_ablation`` reuses a run by, and what the tables read."""


@dataclass(frozen=True)
class Ledger:
    """The durable copy of a study folder: its pins, caches and finished runs' records, without the
    checkpoints, mirrored file for file under ``root`` (``benchmarks/study/ledger/<out's name>``).

    A grid of Lite0 runs outlives a session and its machine only in the repository: a run folder's
    checkpoints are hundreds of megabytes, a run's record a few kilobytes. :meth:`record` copies a
    folder's records into the ledger as its runs finish; :meth:`restore` puts them back into a new
    machine's empty ``--out``, where ``run_ablation`` reuses a run whose ``result.json`` names the
    same config (so a grid resumes at its next untrained seed), the controls match the restored
    ``mechanism.json``, and the tables read them as any finished run."""

    out: Path
    root: Path

    def durable(self, folder: Path) -> list[Path]:
        """The files of ``folder`` (within :attr:`out`) that the ledger keeps: pins and caches,
        and the records of finished runs, not of runs moved aside (``seedN.replaced-…``)."""
        kept = []
        for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
            if path.name in DURABLE_FILES or (
                path.name in DURABLE_RUN_FILES and re.fullmatch(r"seed\d+", path.parent.name)
            ):
                kept.append(path)
        return kept

    def record(self, folder: Path | None = None) -> int:
        """Copy the durable files of ``folder`` (default: all of :attr:`out`) into the ledger,
        replacing an older copy (a re-run's or a rematch's); the number of files written."""
        return self.copy(self.durable(folder or self.out))

    def record_run(self, run_folder: Path) -> int:
        """A finished run's records and the pins of the folders above it (the grid's recipe, the
        setting's layout), so that a chain stopped mid-grid leaves what resuming needs."""
        above = [a for a in run_folder.parents if a == self.out or self.out in a.parents]
        pins = [a / name for a in above for name in sorted(DURABLE_FILES) if (a / name).is_file()]
        return self.copy([*self.durable(run_folder), *pins])

    def copy(self, paths: Sequence[Path]) -> int:
        """Copy ``paths`` (within :attr:`out`) into the ledger where its copy differs; the number
        of files written."""
        from idml.app.checkpoint import atomic_write_text

        written = 0
        for path in paths:
            copy = self.root / path.relative_to(self.out)
            text = path.read_text()
            if not copy.is_file() or copy.read_text() != text:
                copy.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(copy, text)
                written += 1
        return written

    def restore(self) -> int:
        """Copy into :attr:`out` the ledger's files it lacks (never over a file it has: a run
        folder's own record is at least as new); the number of files restored."""
        restored = 0
        for copy in sorted(self.root.rglob("*.json")) if self.root.is_dir() else []:
            path = self.out / copy.relative_to(self.root)
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(copy.read_text())
                restored += 1
        return restored


def study_ledger(args: argparse.Namespace) -> Ledger | None:
    """The ledger of ``args.out``, or ``None`` for a ``--quick`` pipeline check or ``--no-ledger``."""
    root = getattr(args, "ledger", None)
    if root is None or args.quick:
        return None
    return Ledger(args.out, root / args.out.name)


def load_recipes() -> dict[str, Any]:
    return json.loads(RECIPES.read_text()) if RECIPES.is_file() else {}


def recipe_record(setting: str, loss: str) -> dict[str, Any]:
    """The validated recipe of ``loss`` in ``setting`` (``idml_recipes.json``; an error before
    ``validate``)."""
    chosen = load_recipes().get(setting, {}).get(loss)
    if chosen is None:
        raise SystemExit(
            f"no validated recipe for {setting}/{loss}: run `python benchmarks/study_idml.py "
            f"validate --setting {setting}` first ({RECIPES} holds the chosen ones)"
        )
    return dict(chosen)


def pin_recipe(loss_folder: Path, chosen: dict[str, Any]) -> None:
    """Record the recipe a loss's runs in ``loss_folder`` train with, or stop if its runs used
    another: a grid never mixes budgets or knobs across arms. ``converge --adopt`` changes a
    recipe; its grid then goes to a new ``--out``, the old grid keeping the recipe it was run at."""
    path = loss_folder / FOLDER_RECIPE
    if path.is_file():
        pinned = json.loads(path.read_text())
        if list(pinned["overrides"]) != list(chosen["overrides"]):
            raise SystemExit(
                f"{loss_folder}: its runs used the recipe {pinned['recipe']!r} "
                f"({' '.join(pinned['overrides'])}), the validated recipe is now "
                f"{chosen['recipe']!r} ({' '.join(chosen['overrides'])}); run the new recipe in a "
                "new --out (with --label for its tables), or move this folder away"
            )
        return
    loss_folder.mkdir(parents=True, exist_ok=True)
    record = {"recipe": chosen["recipe"], "overrides": list(chosen["overrides"])}
    path.write_text(json.dumps(record, indent=2) + "\n")


def pinned_recipe(loss_folder: Path) -> str | None:
    """The recipe name :func:`pin_recipe` recorded in ``loss_folder``, if any."""
    path = loss_folder / FOLDER_RECIPE
    return str(json.loads(path.read_text())["recipe"]) if path.is_file() else None


def grid_recipe(args: argparse.Namespace, loss: str, loss_folder: Path) -> list[str]:
    """The overrides a grid's runs of ``loss`` in ``loss_folder`` train with: the validated recipe,
    pinned to the folder (:func:`pin_recipe`), or with ``--recipe pinned`` the one the folder
    already pins, so that arms or seeds can be added to a grid after ``converge --adopt`` moved the
    validated recipe on."""
    if args.quick:
        return []
    if args.recipe == "pinned":
        path = loss_folder / FOLDER_RECIPE
        if not path.is_file():
            raise SystemExit(
                f"--recipe pinned: {loss_folder} pins no recipe ({FOLDER_RECIPE} is missing); "
                "start a grid with the validated recipe (the default --recipe validated)"
            )
        return list(json.loads(path.read_text())["overrides"])
    chosen = recipe_record(args.setting, loss)
    pin_recipe(loss_folder, chosen)
    return list(chosen["overrides"])


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
            if arm.match is None:
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


@dataclass(frozen=True)
class Job:
    """One run: a folder, the overrides of its config, and whether to write ``mechanism.json``."""

    folder: Path
    overrides: tuple[str, ...]
    mechanism: bool
    match_controls: bool = False


def reuse_overrides(job: Job) -> list[str]:
    """``job``'s overrides, but a run that finished before layouts were pinned is reused as it is:
    it says ``optim.channels_last: auto``, which on the CPU meant the contiguous layout its folder
    is pinned to (:data:`LEGACY_LAYOUT`), so it is the same run and must not be trained again."""
    overrides = list(job.overrides)
    if LEGACY_LAYOUT not in overrides:
        return overrides
    for result in job.folder.glob("cells/*/seed*/result.json"):
        if not re.fullmatch(r"seed\d+", result.parent.name):
            continue  # a run moved aside (``seed0.replaced-…``) is not the one reused
        stored = json.loads(result.read_text()).get("config", {})
        if stored.get("optim", {}).get("channels_last") == "auto":
            return [o for o in overrides if o != LEGACY_LAYOUT]
    return overrides


def run_job(job: Job) -> tuple[str, float]:
    """Train (or reuse) one run, then its mechanism diagnostics; ``(folder, seconds)``."""
    import torch

    torch.set_num_threads(1)
    from idml.app.ablation import parse_grid, run_ablation

    start = time.perf_counter()
    result = run_ablation(
        None, parse_grid([]), 1, job.folder, overrides=reuse_overrides(job), log=lambda _: None
    )
    run_dir = result.cells[0].runs[0].run_dir
    mechanism = run_dir / "mechanism.json"
    if job.mechanism and not mechanism.is_file():
        write_mechanism(run_dir, job.match_controls)
    elif job.match_controls and stale_match(run_dir):
        rematch(run_dir)
    return str(job.folder), time.perf_counter() - start


def run_jobs(jobs: Sequence[Job], workers: int, ledger: Ledger | None = None) -> None:
    """Run ``jobs`` on ``workers`` processes (one thread each), printing a line per finished run
    and copying its record into ``ledger`` at once (a chain stopped mid-grid keeps every run that
    finished)."""
    total = len(jobs)
    start = time.perf_counter()

    def report(results: Iterator[tuple[str, float]]) -> None:
        for done, (folder, seconds) in enumerate(results, start=1):
            if ledger is not None:
                ledger.record_run(Path(folder))
            elapsed = (time.perf_counter() - start) / 60
            print(
                f"[{done}/{total}] {folder} ({seconds:.0f} s; {elapsed:.1f} min so far)", flush=True
            )

    if not total:
        return
    if workers <= 1:
        report(map(run_job, jobs))
        return
    with multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=8) as pool:
        report(pool.imap_unordered(run_job, jobs))


# --------------------------------------------------------------------------- mechanism
def write_mechanism(run_dir: Path, match_controls: bool) -> None:
    """``mechanism.json``: what ``u`` and ISM did in a finished run (see the module docstring)."""
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


# --------------------------------------------------------------------------- commands
def validate(args: argparse.Namespace) -> None:
    setting = args.setting
    base = [
        *setting_overrides(args),
        "data.protocol=validation",
        *SETTINGS[setting].validation,
    ]
    jobs = []
    for loss in args.losses:
        for name, overrides in recipe_candidates(setting, loss).items():
            folder = args.out / setting / "validation" / loss / slug(name)
            for seed in range(args.seeds):
                config = [
                    *base,
                    f"loss.name={loss}",
                    *BASELINE.overrides,
                    *overrides,
                    f"seed={seed}",
                ]
                jobs.append(Job(folder / f"s{seed}", tuple(config), mechanism=False))
    run_jobs(jobs, args.workers, study_ledger(args))
    recipes = load_recipes()
    lines = [
        f"# IDML study, {setting}: baseline recipes on the validation split\n",
        "Held-out *training* classes (`data.protocol=validation`, `data.validation_classes`); the "
        "test classes are never loaded. Baseline arm (plain metric, no Mixup), "
        f"{args.seeds} seeds, last epoch. Chosen: the highest mean validation MAP@R.\n",
        "Settings: `" + " ".join(o for o in base if not o.startswith("data.root=")) + "`\n",
        "| loss | recipe | R@1 | MAP@R | NMI | |",
        "|---|---|---|---|---|---|",
    ]
    reference = untrained_reference(args, validation=True)
    lines.append(
        f"| – | *untrained network* | {fmt(reference['recall@1'])} | {fmt(reference['map@r'])} | "
        f"{fmt(reference['nmi'])} | |"
    )
    notes: list[str] = []
    # Every loss validated so far goes in the table, not only this call's: the file is the
    # setting's one record of how its recipes were chosen.
    for loss in LOSSES:
        scores = {
            name: final_metrics(args.out / setting / "validation" / loss / slug(name), args.seeds)
            for name in recipe_candidates(setting, loss)
        }
        if loss not in args.losses and not all(m["map@r"] for m in scores.values()):
            continue  # not validated yet
        best = max(scores, key=lambda n: mean(scores[n]["map@r"]))
        for name, metrics in scores.items():
            lines.append(
                f"| {LOSS_NAMES[loss]} | {name} | {fmt(metrics['recall@1'])} | "
                f"{fmt(metrics['map@r'])} | {fmt(metrics['nmi'])} | {'**chosen**' if name == best else ''} |"
            )
        notes += floor_notes(reference, {f"{LOSS_NAMES[loss]} ({best})": scores[best]})
        edges = grid_edges(setting, loss, best)
        if edges:
            notes.append(
                f"- {LOSS_NAMES[loss]}: the chosen recipe ({best}) lies at the edge of the grid "
                f"({'; '.join(edges)}): a larger value was not tried, so the baseline may not have "
                "reached its best there."
            )
        if loss not in args.losses:
            continue
        recipes.setdefault(setting, {})[loss] = {
            "recipe": best,
            "overrides": list(recipe_candidates(setting, loss)[best]),
            "validation_map@r": mean(scores[best]["map@r"]),
        }
    if notes:
        lines += ["", *notes]
    if not args.quick:
        TABLES.mkdir(parents=True, exist_ok=True)
        RECIPES.write_text(json.dumps(recipes, indent=2, sort_keys=True) + "\n")
        (TABLES / f"idml_validation_{setting}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def doubled_budget(chosen: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The name and overrides of a stored recipe (``idml_recipes.json``) at twice its budget.

    >>> doubled_budget({"recipe": "m_pos=0.2, 10 epochs",
    ...                 "overrides": ["loss.pos_margin=0.2", "optim.epochs=10"]})
    ('m_pos=0.2, 20 epochs', ('loss.pos_margin=0.2', 'optim.epochs=20'))
    """
    epochs = next(
        int(o.split("=")[1]) for o in chosen["overrides"] if o.startswith("optim.epochs=")
    )
    name = chosen["recipe"].replace(f"{epochs} epochs", f"{2 * epochs} epochs")
    overrides = tuple(
        f"optim.epochs={2 * epochs}" if o.startswith("optim.epochs=") else o
        for o in chosen["overrides"]
    )
    return name, overrides


@dataclass(frozen=True)
class Challenge:
    """One way ``converge`` and ``widen`` question a validated recipe: train a challenger beside it
    on the validation split, paired over seeds, and adopt the challenger when it gains at least
    :data:`CONVERGED_GAIN` MAP@R points."""

    command: str
    challenger: Any
    """``(loss, recipe record) -> (name, overrides) | None``: the recipe to try, if any."""
    title: str
    rule: str
    table: str
    """The table's file name, ``{}`` standing for the setting."""
    axis: str
    """What the challenger changes, for the table's headings."""
    compared: str
    """The table's line of which runs it holds starts with this (:func:`write_table`)."""
    verdicts: tuple[str, str]
    """The recipe's verdict when the challenger gains less than the rule, and when not."""


CHALLENGES = {
    "converge": Challenge(
        "converge",
        lambda loss, chosen: doubled_budget(chosen),
        "has the baseline converged at its chosen budget?",
        "the same recipe at twice its epochs. A budget counts as converged when its doubling "
        "gains less than {gain:g} validation MAP@R point (paired mean); `converge --adopt` "
        "replaces one that has not by the doubled recipe.",
        "idml_convergence_{}.md",
        "Twice the budget",
        "Budgets compared",
        ("converged", "**not converged**"),
    ),
    "widen": Challenge(
        "widen",
        widened_knob,
        "does the chosen knob lie inside the values tried?",
        "the same recipe with its knob (ProxyAnchor's proxy-rate multiplier, Contrastive's "
        "positive margin) one step past the edge of every value tried, where the chosen value is "
        "that edge (`validate`'s grid and the earlier trials the recipe records). The wider value "
        "is adopted by `widen --adopt` when it gains at least {gain:g} validation MAP@R point "
        "(paired mean); adopted or not, `--adopt` records the trial, so the next call steps past "
        "a new edge or finds the knob bracketed.",
        "idml_widening_{}.md",
        "The knob one step further",
        "Knob values compared",
        ("inside the values tried", "**the edge was not the best**"),
    ),
}


def converge(args: argparse.Namespace) -> None:
    """Has the baseline converged at its chosen budget? Each loss's validated recipe trained again
    at twice its epochs on the validation split, the same seeds, compared paired over seeds. A
    budget whose doubling gains at least :data:`CONVERGED_GAIN` MAP@R points has not converged;
    with ``--adopt`` the doubled recipe replaces it in ``idml_recipes.json`` (call again to check
    the new budget). The table covers every loss of the setting with both budgets' runs."""
    challenge(args, CHALLENGES["converge"])


def widen(args: argparse.Namespace) -> None:
    """Does the chosen knob lie inside the values tried? ``validate`` chose Contrastive's largest
    margin on Omniglot with Lite0: a recipe at the edge of its grid may not be the baseline's best.
    Each such loss's recipe is trained with the knob one step further (:func:`widened_knob`) and
    compared as ``converge`` compares budgets; a loss whose knob is bracketed is left alone."""
    challenge(args, CHALLENGES["widen"])


def challenge(args: argparse.Namespace, kind: Challenge) -> None:
    """Train each loss's validated recipe and its challenger (``kind``) on the validation split,
    the same seeds, and compare them paired over seeds; with ``--adopt``, a challenger that gains
    :data:`CONVERGED_GAIN` MAP@R points replaces the recipe in ``idml_recipes.json``."""
    setting = args.setting
    base = [
        *setting_overrides(args),
        "data.protocol=validation",
        *SETTINGS[setting].validation,
    ]
    all_recipes = load_recipes()
    recipes = all_recipes.get(setting, {})
    missing = [loss for loss in args.losses if loss not in recipes]
    if missing:
        raise SystemExit(f"no validated recipe for {setting}/{missing}: run `validate` first")

    def contenders(loss: str) -> list[tuple[str, tuple[str, ...], Path]] | None:
        chosen = recipes[loss]
        challenger = kind.challenger(loss, chosen)
        if challenger is None:
            return None
        return [
            (name, overrides, args.out / setting / "validation" / loss / slug(name))
            for name, overrides in ((chosen["recipe"], tuple(chosen["overrides"])), challenger)
        ]

    jobs = [
        Job(
            folder / f"s{seed}",
            (*base, f"loss.name={loss}", *BASELINE.overrides, *overrides, f"seed={seed}"),
            mechanism=False,
        )
        for loss in args.losses
        for _, overrides, folder in contenders(loss) or []
        for seed in range(args.seeds)
    ]
    run_jobs(jobs, args.workers, study_ledger(args))
    lines = [
        f"# IDML study, {setting}: {kind.title}\n",
        "The validated baseline recipe of each loss (`idml_recipes.json`) against "
        + kind.rule.format(gain=CONVERGED_GAIN)
        + f" Validation split of the training classes, seeds 0–{args.seeds - 1} of both (last "
        "epoch).\n",
        "| loss | recipe | R@1 | MAP@R | |",
        "|---|---|---|---|---|",
    ]
    pairs, adopted, compared, left = [], [], [], []
    for loss in LOSSES:
        if loss not in recipes:
            continue
        candidates = contenders(loss)
        if candidates is None:
            if loss in args.losses:
                left.append(f"- {LOSS_NAMES[loss]}: nothing to try ({recipes[loss]['recipe']}).")
            continue
        runs = []
        for _, _, folder in candidates:
            runs.append({s: r for s, r in seed_results(folder).items() if s < args.seeds})
        common = sorted(set(runs[0]) & set(runs[1]))
        if not common:
            continue  # this loss's challenger was not trained yet
        (name, _, _), (challenger, overrides, _) = candidates
        compared.append(f"{LOSS_NAMES[loss]}: {name} → {challenger}")
        gain = 100 * mean(
            [runs[1][s]["metrics"]["map@r"] - runs[0][s]["metrics"]["map@r"] for s in common]
        )
        verdict = kind.verdicts[gain >= CONVERGED_GAIN]
        if args.adopt and loss in args.losses and not args.quick:
            record = dict(recipes[loss])
            step = (
                f"{name} → {challenger}: {kind.command} gained {gain:+.2f} validation MAP@R "
                f"({len(common)} seeds)"
            )
            if kind.command == "widen":
                knob = KNOBS[loss]
                trial = {"value": knob.value_of(challenger), "recipe": challenger}
                record["widened"] = [
                    *record.get("widened", []),
                    {**trial, "gain": round(gain, 4), "seeds": len(common)},
                ]
            if gain >= CONVERGED_GAIN:
                record.update(
                    recipe=challenger,
                    overrides=list(overrides),
                    history=[*record.get("history", []), step],
                )
                record["validation_map@r"] = mean([runs[1][s]["metrics"]["map@r"] for s in common])
                adopted.append(f"- {LOSS_NAMES[loss]}: adopted {challenger} (was {name}).")
                verdict += ", adopted"
            recipes[loss] = record
        for label, seeds in zip((name, challenger), runs, strict=True):
            r1, map_r = ([r["metrics"][k] for r in seeds.values()] for k in TABLE_METRICS)
            note = f"{gain:+.2f} MAP@R: {verdict}" if label == challenger else ""
            lines.append(f"| {LOSS_NAMES[loss]} | {label} | {fmt(r1)} | {fmt(map_r)} | {note} |")
        pairs.append((LOSS_NAMES[loss], f"{challenger} − {name}", runs[0], runs[1]))
    lines += [f"\n## {kind.axis} − the chosen recipe (paired over seeds)\n"]
    lines += difference_table(pairs)
    lines += ["", *adopted, *left] if adopted or left else []
    if args.adopt and not args.quick and compared:
        all_recipes[setting] = recipes
        RECIPES.write_text(json.dumps(all_recipes, indent=2, sort_keys=True) + "\n")
    budgets_line = f"{kind.compared}: " + "; ".join(compared) + ".\n"
    lines.insert(1, budgets_line)
    write_table(args, kind.table.format(setting), lines, of=budgets_line)


def control_overrides(arms_folder: Path, arm: Arm) -> list[str]:
    """The overrides a matched control takes from the runs of the arm it matches (a sibling folder
    in ``arms_folder``); none for an arm that is not a matched control."""
    if arm.match is None:
        return []
    return matched_overrides(arms_folder / arm.match.to, arm.match.control)


def key_of(override: str) -> str:
    return override.partition("=")[0].strip()


PER_RUN_KEYS = frozenset({"loss.name", "seed"})
"""Keys the study sets for each run itself (from ``--losses`` and ``--seeds``): never an
``--override``."""


def arm_config(
    base: Sequence[str],
    loss: str,
    recipe: Sequence[str],
    study: Sequence[str],
    arm: str,
    own: Sequence[str],
) -> tuple[str, ...]:
    """One arm's overrides in the order that lets the later win: the setting's, the loss, its
    recipe, the study's ``--override`` values, then what makes the arm itself (``own``: its
    method, a matched control's value, a degradation). A study override of a key the arm sets
    would make two arms the same run, so it stops the command.

    >>> arm_config(["optim.epochs=8"], "contrastive", ["optim.epochs=16"], ["optim.lr=1e-4"],
    ...            "mixup", ["mixup.enabled=true"])[1:]
    ('loss.name=contrastive', 'optim.epochs=16', 'optim.lr=1e-4', 'mixup.enabled=true')
    """
    sets = {key_of(o): o for o in own}
    clash = [o for o in study if key_of(o) in sets]
    if clash:
        raise SystemExit(
            f"--override {' '.join(clash)}: the arm {arm!r} sets "
            f"{', '.join(sets[key_of(o)] for o in clash)} itself; override setting or recipe "
            "keys only (optim.*, data.*, model.* that no arm sets)"
        )
    return (*base, f"loss.name={loss}", *recipe, *study, *own)


def checked_jobs(args: argparse.Namespace, jobs: list[Job]) -> list[Job]:
    """``jobs``, once every one's config validates and passes the trainer's preflight, and then
    the folder's ``--override`` values pinned (:func:`study_overrides`): a misspelt key, a value
    out of range or a loss that refuses its hyper-parameters (a matched margin past m_neg) stops
    the command before the first run trains, with the config's own message, and pins nothing."""
    from idml.app.config import ConfigError, load_config
    from idml.app.preflight import check_run_config

    for job in jobs:
        try:
            check_run_config(load_config(None, list(job.overrides)))
        except ConfigError as error:
            raise SystemExit(f"{job.folder}: its config does not validate: {error}") from None
    study_overrides(args, pin=True)
    return jobs


def main_jobs(args: argparse.Namespace, matched: bool) -> list[Job]:
    setting = args.setting
    base = setting_overrides(args)
    study = study_overrides(args, pin=False)
    jobs = []
    for loss in args.losses:
        chosen = grid_recipe(args, loss, args.out / setting / loss)
        for name in args.arms:
            arm = ARMS[name]
            if arm.matched != matched or (arm.losses is not None and loss not in arm.losses):
                continue
            arms_folder = args.out / setting / loss
            if idle := idle_control(arms_folder, arm):
                print(f"{arms_folder / name}: not trained: {idle}")
                continue
            extra = control_overrides(arms_folder, arm)
            own = (*arm.overrides, *extra)
            for seed in range(args.seeds):
                config = (*arm_config(base, loss, chosen, study, name, own), f"seed={seed}")
                folder = args.out / setting / loss / name / f"s{seed}"
                jobs.append(Job(folder, config, arm.has_head, match_controls=name in MATCHED_TO))
    return jobs


def degradation_jobs(args: argparse.Namespace, matched: bool) -> list[Job]:
    setting, loss = args.setting, DEGRADATION_LOSS
    base = setting_overrides(args)
    study = study_overrides(args, pin=False)
    # The degraded arms are compared with this loss's clean baseline of the main grid.
    chosen = grid_recipe(args, loss, args.out / setting / loss)
    jobs = []
    for degradation in args.kinds:
        knob = DEGRADATIONS[degradation]
        folder = args.out / setting / "degradations" / degradation
        for name in args.arms:
            arm = DEGRADATION_ARMS[name]
            if arm.matched != matched:
                continue
            extra = control_overrides(folder, arm)
            for seed in range(args.seeds):
                config = arm_config(base, loss, chosen, study, name, (*arm.overrides, knob, *extra))
                jobs.append(
                    Job(
                        folder / name / f"s{seed}",
                        (*config, f"seed={seed}"),
                        arm.has_head,
                        match_controls=name in MATCHED_TO,
                    )
                )
    return jobs


def seed_major(jobs: Sequence[Job]) -> list[Job]:
    """``jobs`` seed by seed: every arm's seed 0, then every arm's seed 1, and so on (arms and
    groups in their order within a seed). A grid of a day's CPU time outlives the session that
    starts it; stopped anywhere, it leaves every arm with the same seeds or one fewer, so its
    tables already pair all arms, where arm after arm left the last arms with no seed at all.

    >>> names = [Job(Path(a) / f"s{s}", (), False) for a in "ab" for s in range(2)]
    >>> [str(job.folder) for job in seed_major(names)]
    ['a/s0', 'b/s0', 'a/s1', 'b/s1']
    """
    return sorted(jobs, key=lambda job: int(job.folder.name.removeprefix("s")))


def run(args: argparse.Namespace) -> None:
    """Trains the arms that stand alone, then the controls matched to their runs, each phase seed
    by seed (:func:`seed_major`). The first phase pins each grid's recipe; the second trains at
    that pin, so a grid finishes at the recipe it started with even when ``converge --adopt``
    moves the validated recipe on while it runs."""
    jobs = degradation_jobs if args.degradations else main_jobs
    first = seed_major(jobs(args, matched=False))
    run_jobs(checked_jobs(args, first), args.workers, study_ledger(args))
    started = argparse.Namespace(**{**vars(args), "recipe": "pinned"})
    matched = seed_major(jobs(started, matched=True))
    run_jobs(checked_jobs(args, matched), args.workers, study_ledger(args))


# --------------------------------------------------------------------------- tables
def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._=" else "_" for c in name).strip("_") or "default"


def mean_of(records: Sequence[dict[str, Any]], get: Any) -> float:
    """Mean of ``get(record)`` over the records where it is not ``None``."""
    return mean([v for v in (get(r) for r in records) if v is not None])


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def fmt(values: Sequence[float], scale: float = 100.0) -> str:
    if not values:
        return "–"
    m = mean(values)
    if len(values) < 2:
        return f"{scale * m:.1f}"
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{scale * m:.1f} ± {scale * sd:.1f}"


def run_files(arm_folder: Path, name: str) -> list[Path]:
    """``name`` in each seed's run folder of an arm — not in the ``seedN.replaced-…`` folders a
    re-run set aside (a run retrained after its config changed keeps the old one there)."""
    return sorted(
        path
        for path in arm_folder.glob(f"s*/cells/base/seed*/{name}")
        if re.fullmatch(r"seed\d+", path.parent.name)
    )


def seed_results(arm_folder: Path) -> dict[int, dict[str, Any]]:
    """``{seed: {"metrics": …, "mechanism": … | None}}`` of an arm's finished runs."""
    out = {}
    for result in run_files(arm_folder, "result.json"):
        record = json.loads(result.read_text())
        mech = result.parent / "mechanism.json"
        out[int(record["seed"])] = {
            "metrics": record["final_metrics"],
            "mechanism": json.loads(mech.read_text()) if mech.is_file() else None,
        }
    return out


def final_metrics(folder: Path, seeds: int) -> dict[str, list[float]]:
    runs = seed_results(folder)
    keys = ("recall@1", "map@r", "nmi")
    return {
        k: [runs[s]["metrics"][k] for s in sorted(runs) if k in runs[s]["metrics"]] for k in keys
    }


COMPARISONS: list[tuple[str, str, str]] = [
    ("ISM only − baseline", "baseline", "ism"),
    ("Mixup only − baseline", "baseline", "mixup"),
    ("IDML − baseline", "baseline", "idml"),
    ("IDML − Mixup only", "mixup", "idml"),
    ("IDML − IDML with u frozen", "idml_frozen_u", "idml"),
    ("IDML − uniform weakening", "idml_uniform", "idml"),
    ("IDML − margin-matched Mixup", "mixup_margin", "idml"),
    ("extension − IDML", "idml", "idml_ext"),
    ("extension − Mixup only", "mixup", "idml_ext"),
]
U_HIGH_COMPARISONS: list[tuple[str, str, str]] = [
    ("u high − IDML (u at 2 %)", "idml", "idml_u_high"),
    ("u high − Mixup only", "mixup", "idml_u_high"),
    ("u high − u high, frozen", "idml_u_high_frozen_u", "idml_u_high"),
    ("u high − uniform weakening matched to it", "idml_u_high_uniform", "idml_u_high"),
]
"""Where ISM weakens pairs unevenly (``u`` starting high): does it help? A family of its own."""
TABLE_METRICS = ("recall@1", "map@r")


def untrained_reference(
    args: argparse.Namespace, validation: bool = False
) -> dict[str, list[float]]:
    """Test metrics of the setting's network before any training, per seed (one value for a
    pretrained backbone, whose features do not depend on the seed): the floor a baseline must clear.
    With ``validation``, the same on the validation split of the training classes (``validate``'s
    floor; the test classes are never loaded). Cached in ``untrained.json`` of the split's folder."""
    folder = args.out / args.setting / ("validation" if validation else "")
    cache = folder / "untrained.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    import torch

    from idml.app import build
    from idml.app.config import load_config
    from idml.embeddings import Embeddings
    from idml.evaluation import EvaluationSettings, evaluate_embeddings

    base = setting_overrides(args)
    if validation:
        base += ["data.protocol=validation", *SETTINGS[args.setting].validation]
    seeds = 1 if SETTINGS[args.setting].pretrained else args.seeds
    out: dict[str, list[float]] = {"recall@1": [], "map@r": [], "nmi": []}
    for seed in range(seeds):
        cfg = load_config(None, [*base, *BASELINE.overrides, f"seed={seed}"])
        torch.manual_seed(cfg.seed)
        data = build.build_data(cfg)
        model = build.build_model(cfg).eval()
        features, labels = [], []
        with torch.no_grad():
            for images, batch_labels, *_ in torch.utils.data.DataLoader(data.test, batch_size=256):
                features.append(model.features(images))
                labels.append(batch_labels)
        settings = EvaluationSettings(ks=(1,), nmi=True, nmi_backend="sklearn", seed=cfg.seed)
        metrics = evaluate_embeddings(
            Embeddings(torch.cat(features)), torch.cat(labels), settings
        ).metrics
        for k in out:
            out[k].append(float(metrics[k]))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(out))
    return out


Runs = dict[int, dict[str, Any]]
"""An arm's finished runs by seed (:func:`seed_results`)."""


def floor_notes(
    reference: Mapping[str, Sequence[float]], baselines: Mapping[str, Mapping[str, Sequence[float]]]
) -> list[str]:
    """A note for each loss whose baseline does not beat the untrained network's ``reference`` by
    :data:`TRAINS_MARGIN` MAP@R points. ``baselines`` maps a loss's name to its baseline's metrics
    over seeds, in the shape of ``reference`` (:func:`final_metrics`).

    >>> print(*floor_notes({"recall@1": [0.833], "map@r": [0.364]},
    ...                    {"Multi-Similarity": {"recall@1": [0.872], "map@r": [0.347]}}))
    ... # doctest: +ELLIPSIS
    - **Multi-Similarity: the baseline does not beat the untrained network** (MAP@R 34.7 against 36.4, R@1 87.2 against 83.3; ...
    >>> floor_notes({"recall@1": [0.892], "map@r": [0.482]},
    ...             {"Contrastive": {"recall@1": [0.897], "map@r": [0.707]}})
    []
    """
    notes = []
    untrained = {key: 100 * mean(reference[key]) for key in TABLE_METRICS}
    for loss, metrics in baselines.items():
        trained = {key: 100 * mean(metrics[key]) for key in TABLE_METRICS}
        if trained["map@r"] - untrained["map@r"] < TRAINS_MARGIN:
            notes.append(
                f"- **{loss}: the baseline does not beat the untrained network** (MAP@R "
                f"{trained['map@r']:.1f} against {untrained['map@r']:.1f}, R@1 "
                f"{trained['recall@1']:.1f} against {untrained['recall@1']:.1f}; a trained recipe "
                f"clears it by {TRAINS_MARGIN:g} MAP@R point): by the study's rule its recipe is "
                "broken here, and this loss's comparisons are not evidence about ISM."
            )
    return notes


def failed_seed_notes(
    reference: Mapping[str, Sequence[float]], runs: Mapping[str, Runs]
) -> list[str]:
    """A note for each arm (``runs``: label → its runs by seed) with seeds whose test MAP@R ends
    below the untrained network's ``reference``: runs that failed (on Lite0, ProxyAnchor with
    Mixup collapsed every image to one embedding). They stay in every mean and test, as measured;
    the note says which seeds they are, so a reader can tell a spread from a failure.

    >>> print(*failed_seed_notes({"recall@1": [0.23], "map@r": [0.062]},
    ...       {"ProxyAnchor, Mixup only": {0: {"metrics": {"recall@1": 0.0, "map@r": 0.0}},
    ...                                    1: {"metrics": {"recall@1": 0.39, "map@r": 0.14}}},
    ...        "ProxyAnchor, baseline": {0: {"metrics": {"recall@1": 0.58, "map@r": 0.24}}}}))
    - ProxyAnchor, Mixup only: 1 of 2 seeds end below the untrained network's MAP@R of 6.2 (seed 0: R@1 0.0, MAP@R 0.0); they count in every mean and test here, as measured.
    """
    floor = mean(reference["map@r"])
    notes = []
    for label, seeds in runs.items():
        failed = {
            s: r["metrics"] for s, r in sorted(seeds.items()) if r["metrics"]["map@r"] < floor
        }
        if failed:
            which = "; ".join(
                f"seed {s}: R@1 {100 * m['recall@1']:.1f}, MAP@R {100 * m['map@r']:.1f}"
                for s, m in failed.items()
            )
            notes.append(
                f"- {label}: {len(failed)} of {len(seeds)} seeds end below the untrained "
                f"network's MAP@R of {100 * floor:.1f} ({which}); they count in every mean and "
                "test here, as measured."
            )
    return notes


def arm_row(name: str, label: str, seeds: Runs) -> str:
    values = {
        k: [r["metrics"][k] for r in seeds.values() if k in r["metrics"]]
        for k in ("recall@1", "map@r", "nmi")
    }
    return (
        f"| {name} | {label} | {len(seeds)} | {fmt(values['recall@1'])} | "
        f"{fmt(values['map@r'])} | {fmt(values['nmi'])} |"
    )


def difference_table(pairs: Sequence[tuple[str, str, Runs, Runs]]) -> list[str]:
    """Markdown rows of paired differences ``b − a`` for ``(group, comparison, a, b)``, Holm-adjusted
    over every cell (comparison × metric) of the table."""
    from idml.statistics import compare_paired, holm

    cells = []
    for group, label, a, b in pairs:
        common = sorted(set(a) & set(b))
        for metric in TABLE_METRICS:
            x = [a[s]["metrics"][metric] * 100 for s in common]
            y = [b[s]["metrics"][metric] * 100 for s in common]
            cells.append((group, label, metric, compare_paired(x, y)))
    adjusted = holm([c.p_value for *_, c in cells])
    lines = [
        "Δ = mean of the per-seed differences in points, its 95 % t-interval, Cohen's d_z, and the "
        f"p-value of a paired t-test Holm-adjusted over all {len(cells)} cells of this table; "
        "▲/▼ only where the adjusted p < 0.05.\n",
        "| | comparison | n | Δ R@1 [95 % CI] | d_z | p (Holm) | Δ MAP@R [95 % CI] | d_z | p (Holm) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows: dict[tuple[str, str], dict[str, str]] = {}
    counts: dict[tuple[str, str], int] = {}
    for (group, label, metric, c), p in zip(cells, adjusted, strict=True):
        mark = (" ▲" if c.difference > 0 else " ▼") if c.significant(p) else ""
        rows.setdefault((group, label), {})[metric] = (
            f"{c.difference:+.2f}{mark} [{c.low:+.2f}, {c.high:+.2f}] | {c.effect_size:+.2f} | {p:.3g}"
            if math.isfinite(c.p_value)
            else f"{c.difference:+.2f} | – | –"
        )
        counts[(group, label)] = c.n
    for (group, label), texts in rows.items():
        lines.append(
            f"| {group} | {label} | {counts[(group, label)]} | "
            + " | ".join(texts.get(m, "– | – | –") for m in TABLE_METRICS)
            + " |"
        )
    return lines


def mechanism_header(altered: str = "Mixup") -> list[str]:
    """The mechanism table's preamble and header; ``altered`` names the training images whose
    ``||u||`` trend is shown beside the originals' (Mixup images, or the degraded ones)."""
    return [
        "Test images: `||u||` mean and coefficient of variation; AUROC of `||u||` for Mixup / "
        "blurred / low-resolution / occluded images against the same images clean (0.5: no "
        "difference). Training batches, last epoch: the 10th and 50th percentile of the weakening "
        f"`e^{{−y}}` over positive pairs and the CV of `||u||` across a batch. `||u||` of the "
        f"original training images (those no augmentation changed) and of the {altered} ones in "
        "the first → last epoch. ISM at test: R@1 / MAP@R with the introspective metric at test "
        "time (the paper's Table 5).\n",
        "| | arm | test ‖u‖ | test CV | AUROC mixup / blur / low-res / occl. | pos q10 / q50 | "
        f"batch CV | ‖u‖ original | ‖u‖ {altered} | ISM at test R@1 / MAP@R |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]


def mechanism_row(group: str, label: str, seeds: Runs, altered: str = "mixed") -> str | None:
    """The mechanism of an arm's runs (mean over seeds), or ``None`` without an uncertainty head;
    ``altered`` is the ``uncertainty/<altered>`` training key trended beside the originals'."""
    mechs = [r["mechanism"] for r in seeds.values() if r["mechanism"]]
    if not mechs:
        return None
    avg = partial(mean_of, mechs)
    probe = " / ".join(
        f"{avg(lambda m, k=k: m['probe_auroc'][k]):.2f}"
        for k in ("mixup", "blur", "low_resolution", "occlusion")
    )

    def trend(kind: str) -> str:
        key = f"uncertainty/{kind}"
        before = avg(lambda m: m["first_epoch"].get(key))
        after = avg(lambda m: m["last_epoch"].get(key))
        return "–" if math.isnan(before) else f"{before:.3f} → {after:.3f}"

    return (
        f"| {group} | {label} | {avg(lambda m: m['test_u_mean']):.4f} | "
        f"{avg(lambda m: m['test_u_cv']):.2f} | {probe} | "
        f"{avg(lambda m: m['last_epoch'].get('ism/pos_q10')):.3f} / "
        f"{avg(lambda m: m['last_epoch'].get('ism/pos_q50')):.3f} | "
        f"{avg(lambda m: m['last_epoch'].get('ism/u_cv')):.2f} | {trend('original')} | "
        f"{trend(altered)} | {100 * avg(lambda m: m['ism_at_test'].get('recall@1')):.1f} / "
        f"{100 * avg(lambda m: m['ism_at_test'].get('map@r')):.1f} |"
    )


def settings_lines(args: argparse.Namespace, losses: Sequence[str]) -> list[str]:
    """The setting's overrides and the recipe of each loss whose runs the table holds: the one its
    runs were trained with (the run folder's :data:`FOLDER_RECIPE`), else — a grid started before
    folders pinned their recipe — the validated one."""
    base = setting_overrides(argparse.Namespace(**{**vars(args), "quick": False}), pin=False)
    recipes = load_recipes().get(args.setting, {})
    names = {
        loss: pinned_recipe(args.out / args.setting / loss) or recipes.get(loss, {}).get("recipe")
        for loss in losses
    }
    # The setting's default budget is not printed: every recipe sets its own (optim.epochs).
    shown = [o for o in base if not o.startswith(("data.root=", "optim.epochs="))]
    lines = [
        "Settings: `" + " ".join(shown) + "`\n",
        "Baseline recipes (validation split of the training classes): "
        + "; ".join(f"{LOSS_NAMES[k]}: {v or 'as set'}" for k, v in names.items() if v is not None)
        + ".\n",
    ]
    study = study_overrides(args, pin=False)
    if study:
        lines.append(
            "**A diagnostic**: every run also trains with `"
            + " ".join(study)
            + "` (`--override`), on top of its validated recipe; not the recipe's grid.\n"
        )
    return lines


def tables(args: argparse.Namespace) -> None:
    if args.degradations:
        return degradation_tables(args)
    setting = args.setting
    root = args.out / setting
    reference = untrained_reference(args)
    runs = {
        (loss, arm): seed_results(root / loss / arm)
        for loss in args.losses
        for arm in ARMS
        if (root / loss / arm).is_dir()
    }
    runs = {key: seeds for key, seeds in runs.items() if seeds}
    header = settings_lines(args, [loss for loss in args.losses if any(k[0] == loss for k in runs)])
    lines = [f"# IDML study: {setting}\n", *header]
    lines += [
        "## Test metrics (last epoch, mean ± std over seeds, %)\n",
        "| loss | arm | seeds | R@1 | MAP@R | NMI |",
        "|---|---|---|---|---|---|",
        arm_row(
            "–",
            "*untrained network*",
            {
                i: {"metrics": {k: v[i] for k, v in reference.items()}}
                for i in range(len(reference["recall@1"]))
            },
        ),
    ]
    lines += [
        arm_row(LOSS_NAMES[loss], ARMS[arm].label, seeds) for (loss, arm), seeds in runs.items()
    ]
    below = floor_notes(
        reference,
        {
            LOSS_NAMES[loss]: {k: [r["metrics"][k] for r in seeds.values()] for k in TABLE_METRICS}
            for (loss, arm), seeds in runs.items()
            if arm == "baseline"
        },
    )
    below += failed_seed_notes(
        reference,
        {f"{LOSS_NAMES[loss]}, {ARMS[arm].label}": seeds for (loss, arm), seeds in runs.items()},
    )
    if below:
        lines += ["", *below]
    lines += matched_section({LOSS_NAMES[loss]: root / loss for loss in args.losses}, ARMS)
    pairs = [
        (LOSS_NAMES[loss], label, runs[(loss, ref)], runs[(loss, arm)])
        for loss in args.losses
        for label, ref, arm in COMPARISONS
        if (loss, ref) in runs and (loss, arm) in runs
    ]
    lines += ["\n## Differences (paired over seeds that share initialisation and batches)\n"]
    lines += difference_table(pairs)
    probe = [
        (LOSS_NAMES[loss], label, runs[(loss, ref)], runs[(loss, arm)])
        for loss in args.losses
        for label, ref, arm in U_HIGH_COMPARISONS
        if (loss, ref) in runs and (loss, arm) in runs
    ]
    if probe:
        lines += [
            "\n## Where ISM acts: `u` starting at a quarter of its bound "
            f"(`{U_HIGH}`), against its own controls\n"
        ]
        lines += difference_table(probe)
    lines += ["\n## Is the introspection real? (runs with an uncertainty head, mean over seeds)\n"]
    lines += mechanism_header()
    for (loss, arm), seeds in runs.items():
        row = mechanism_row(LOSS_NAMES[loss], ARMS[arm].label, seeds)
        if row is not None:
            lines.append(row)
    write_table(args, f"idml_{setting}.md", lines, of=header[1])


DEGRADATION_COMPARISONS: list[tuple[str, str, str]] = [
    ("degraded baseline − clean baseline (the cost)", "baseline", "deg_baseline"),
    ("ISM − degraded baseline (the recovery)", "deg_baseline", "deg_ism"),
    ("ISM − ISM with u frozen", "deg_ism_frozen_u", "deg_ism"),
    ("ISM − uniform weakening", "deg_uniform", "deg_ism"),
    ("ISM, u starting high − degraded baseline", "deg_baseline", "deg_ism_u_high"),
    ("ISM, u starting high − the same start, frozen", "deg_ism_u_high_frozen_u", "deg_ism_u_high"),
    (
        "ISM, u starting high − uniform weakening matched to it",
        "deg_ism_u_high_uniform",
        "deg_ism_u_high",
    ),
]


def degradation_tables(args: argparse.Namespace) -> None:
    setting, loss = args.setting, DEGRADATION_LOSS
    clean = seed_results(args.out / setting / loss / "baseline")
    header = settings_lines(args, [loss])
    lines = [f"# IDML study: {setting}, degraded training images (the paper's Table 3)\n", *header]
    lines += [
        f"{LOSS_NAMES[loss]}; a quarter of every batch degraded (low resolution ×4, Gaussian blur "
        "σ 2, a quarter of the image occluded), labels unchanged; the clean baseline is the main "
        "grid's.\n",
        "## Test metrics (last epoch, mean ± std over seeds, %)\n",
        "| degradation | arm | seeds | R@1 | MAP@R | NMI |",
        "|---|---|---|---|---|---|",
        arm_row("none", "baseline (clean images)", clean),
    ]
    pairs, mechanism = [], []
    for degradation in args.kinds:
        folder = args.out / setting / "degradations" / degradation
        runs = {"baseline": clean}
        for name, arm in DEGRADATION_ARMS.items():
            seeds = seed_results(folder / name)
            if seeds:
                runs[name] = seeds
                lines.append(arm_row(degradation, arm.label, seeds))
                row = mechanism_row(degradation, arm.label, seeds, altered="degraded")
                if row is not None:
                    mechanism.append(row)
        pairs += [
            (degradation, label, runs[ref], runs[arm])
            for label, ref, arm in DEGRADATION_COMPARISONS
            if ref in runs and arm in runs and runs[ref] and runs[arm]
        ]
    degraded = {kind: args.out / setting / "degradations" / kind for kind in args.kinds}
    lines += matched_section(degraded, DEGRADATION_ARMS)
    lines += ["\n## Differences (paired over seeds)\n", *difference_table(pairs)]
    lines += ["\n## Mechanism\n", *mechanism_header("degraded"), *mechanism]
    write_table(args, f"idml_{setting}_degradations.md", lines, of=header[1])


def write_table(args: argparse.Namespace, name: str, lines: list[str], of: str) -> None:
    """Write ``name`` (``<name>_<label>.md`` with ``--label``) under ``benchmarks/study``.

    ``of`` is the table's line saying which runs it is of (the recipes, or the budgets compared).
    An existing table without that line is the record of other runs — another recipe, other losses,
    an older version of this script — and is never replaced: the call stops and asks for a label.
    """
    text = "\n".join(lines) + "\n"
    if args.label:
        name = name.removesuffix(".md") + f"_{args.label}.md"
    path = TABLES / name
    if not args.quick:
        if path.is_file() and of.strip() not in path.read_text().splitlines():
            held = next(
                (
                    line
                    for line in path.read_text().splitlines()
                    if line.startswith(of.split(":")[0] + ":")
                ),
                "no such line (an older version of this script)",
            )
            raise SystemExit(
                f"{path} holds a table of other runs; it says {held!r}, this one would say "
                f"{of.strip()!r}. Pass --label NAME to write idml_..._NAME.md beside it (or delete "
                "the file if it is stale)."
            )
        TABLES.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("validate", "converge", "widen", "run", "tables"))
    parser.add_argument("--setting", choices=sorted(SETTINGS), required=True)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument(
        "--arms",
        default=None,
        help=f"the main grid's arms (default all: {', '.join(ARMS)}); with --degradations, the "
        f"degraded grid's (default all: {', '.join(DEGRADATION_ARMS)})",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--degradations", action="store_true", help="the Table 3 grid instead")
    parser.add_argument(
        "--kinds",
        default=",".join(DEGRADATIONS),
        help="with --degradations: which degradations to train (default all)",
    )
    parser.add_argument("--omniglot-root", type=Path, default=DEFAULT_OMNIGLOT)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "study_idml")
    parser.add_argument(
        "--ledger",
        type=Path,
        default=LEDGER,
        help="where the finished runs' records and the folder's pins are copied, under the --out "
        "folder's name, and restored from on a new machine (default: the committed "
        "benchmarks/study/ledger)",
    )
    parser.add_argument(
        "--no-ledger", dest="ledger", action="store_const", const=None, help="keep no ledger"
    )
    parser.add_argument("--quick", action="store_true", help="3 steps an epoch: a pipeline check")
    parser.add_argument(
        "--label",
        default="",
        help="suffix of the tables written (idml_<setting>_<label>.md): a grid in its own --out",
    )
    parser.add_argument(
        "--recipe",
        choices=("validated", "pinned"),
        default="validated",
        help="run: train with the validated recipe (pinned to the run folder), or with the one the "
        "run folder already pins (add arms or seeds to a grid after its recipe was adopted away)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run: a config override every run of the grid trains with, on top of its recipe (a "
        "diagnostic; repeatable). The setting folder pins them: use a new --out",
    )
    parser.add_argument(
        "--adopt",
        action="store_true",
        help=f"converge / widen: replace a recipe by its doubled budget / its knob one step past "
        f"the edge when that gains ≥ {CONVERGED_GAIN} validation MAP@R points (widen records the "
        "trial either way)",
    )
    args = parser.parse_args(argv)
    if args.label and not re.fullmatch(r"[A-Za-z0-9_]+", args.label):
        parser.error(f"--label {args.label!r}: letters, digits and underscores only")
    args.losses = [x for x in args.losses.split(",") if x]
    arms: Mapping[str, Arm] = DEGRADATION_ARMS if args.degradations else ARMS
    args.arms = [x for x in (args.arms or ",".join(arms)).split(",") if x]
    args.kinds = [x for x in args.kinds.split(",") if x]
    unknown = (
        [x for x in args.arms if x not in arms]
        + [x for x in args.losses if x not in LOSSES]
        + [x for x in args.kinds if x not in DEGRADATIONS]
    )
    if unknown:
        parser.error(
            f"unknown arm, loss or degradation {unknown}; arms: {', '.join(arms)}; losses: "
            f"{', '.join(LOSSES)}; degradations: {', '.join(DEGRADATIONS)}"
        )
    if args.override and args.command in ("validate", "converge", "widen"):
        parser.error(
            f"--override is for run (and tables) only: {args.command} chooses the recipe every "
            "arm trains with, on the validation split, without diagnostics"
        )
    malformed = [o for o in args.override if not re.fullmatch(r"[A-Za-z_][\w.]*=.*", o)]
    if malformed:
        parser.error(f"--override {malformed[0]!r}: write it as key.sub=value")
    per_run = [o for o in args.override if key_of(o) in PER_RUN_KEYS]
    if per_run:
        parser.error(f"--override {per_run[0]}: the study sets it per run (--losses, --seeds)")
    if args.quick:
        args.out = args.out.with_name(args.out.name + "_quick")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ledger = study_ledger(args)
    if ledger is not None and (restored := ledger.restore()):
        print(f"restored {restored} records of finished runs and pins from {ledger.root}")
    if args.command in ("validate", "converge", "widen") and (
        diagnostic := study_overrides(args, pin=False)
    ):
        parser.error(
            f"{args.out / args.setting} holds a diagnostic ({said(diagnostic)}); choose recipes "
            "in an --out of their own"
        )
    commands = {"validate": validate, "converge": converge, "widen": widen, "run": run}
    {**commands, "tables": tables}[args.command](args)
    if ledger is not None and (written := ledger.record()):
        print(
            f"recorded {written} files in {ledger.root} (commit them: the runs outlive this machine)"
        )


if __name__ == "__main__":
    main()
