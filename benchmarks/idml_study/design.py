"""The IDML study's design: its settings (data × backbone), the methods and arms it trains, the
degradations, the comparisons its tables make, and the knobs and candidates among which
``validate`` chooses each baseline recipe.

Data and rules only: nothing here trains, reads a run or writes a file. ``benchmarks/study_idml.py``
describes the study and is its entry point.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OMNIGLOT = REPO.parent / "shared" / "data" / "omniglot"
TABLES = REPO / "benchmarks" / "study"


CONVERGED_GAIN = 1.0
"""Validation MAP@R points: a budget counts as converged when twice its epochs gain less than this
(paired mean over seeds); ``converge --adopt`` doubles a recipe's budget while the gain reaches it.
One point is about the seed-to-seed spread of a validation MAP@R, and a third of the smallest
difference the study's tables call (▲/▼) with 10 seeds."""

TRAINS_MARGIN = 1.0
"""MAP@R points by which a baseline must beat the untrained network's features (mean over seeds) to
count as trained (:func:`tables.floor_notes`): the same one point of seed-to-seed spread as
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
RUNNING_LEVEL = "model.uncertainty.level_input=standardized_running"
"""The level standardised by running statistics in training too, so ``||u||`` at test is the one
that trained (the default standardises with each batch's statistics: ``benchmarks/RESULTS.md``,
"The ``||u||`` a model reports at test is not the ``||u||`` it trained with")."""
DETACHED = "model.uncertainty.backbone_gradient=false"
"""The uncertainty head reads the features detached: ``u`` learns from them without shaping them,
so ISM's weakening is the only way the uncertainty reaches retrieval (``benchmarks/RESULTS.md``,
"Whose gradient costs retrieval?")."""


@dataclass(frozen=True)
class Match:
    """A control matched to another arm's trained runs (:func:`mechanism.matched_controls`): the
    uniform weakening (γ) or the positive margin ISM acts as, taken from the runs of arm ``to``."""

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

    @property
    def learns_u(self) -> bool:
        """Whether the arm trains ISM with an uncertainty head that moves (not frozen at its start)."""
        return self.method.head and self.method.ism and FROZEN_U not in self.extra

    def trains_with(self, loss: str) -> bool:
        """Whether a grid of ``loss`` (or of a degradation, whose arms name no loss) has this arm."""
        return self.losses is None or loss in self.losses


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


def controls_of(arms: Mapping[str, Arm], name: str) -> tuple[str, str]:
    """The names of the two controls :func:`with_controls` made for arm ``name`` in ``arms``: the
    same arm with ``u`` frozen, and no head with γ matched to it (whatever their names)."""
    arm = arms[name]
    (frozen,) = [
        other_name
        for other_name, other in arms.items()
        if other.method == arm.method and other.extra == (*arm.extra, FROZEN_U)
    ]
    (uniform,) = [n for n, other in arms.items() if other.match == Match("uniform", name)]
    return frozen, uniform


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
    **with_controls(
        "idml_running",
        (
            "IDML, level standardised as at test",
            "IDML, level standardised as at test, u frozen",
            "IDML, u = 0 and γ matched to the level standardised as at test (uniform weakening)",
        ),
        IDML,
        (RUNNING_LEVEL,),
    ),
    **with_controls(
        "idml_detached",
        (
            "IDML, head detached from the backbone",
            "IDML, head detached from the backbone, u frozen",
            "IDML, u = 0 and γ matched to the detached head (uniform weakening)",
        ),
        IDML,
        (DETACHED,),
    ),
    **with_controls(
        "idml_running_detached",
        (
            "IDML, level as at test, head detached",
            "IDML, level as at test, head detached, u frozen",
            "IDML, u = 0 and γ matched to the level as at test, head detached (uniform weakening)",
        ),
        IDML,
        (RUNNING_LEVEL, DETACHED),
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
    retune: tuple[float, ...] = ()
    """The values ``retune`` tries for an arm other than the baseline (empty: ``grid``'s), finer
    than ``grid`` where the arm's best value may lie between its steps."""

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
        "m_pos={}",
        "loss.pos_margin",
        (0.0, 0.2, 0.4),
        step=0.2,
        floor=0.0,
        ceiling=M_NEG,
        # Half steps: the margin matched to IDML's weakening on Omniglot (0.355) beat a Mixup arm
        # at the baseline's 0.2 by 3 points, so an arm's best margin may lie between the grid's
        # steps; and down to 0.0, since ISM's weakening already loosens the pull (IDML's
        # validation MAP@R on Omniglot was highest at the smallest margin above 0).
        retune=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5),
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


def knob_at(knob: Knob, chosen: dict[str, Any], value: float) -> tuple[str, tuple[str, ...]]:
    """The name and overrides of a stored recipe with ``knob`` at ``value``: only the knob moves,
    the budget and every other override stay.

    >>> knob_at(KNOBS["contrastive"], {"recipe": "m_pos=0.2, 40 epochs",
    ...                                "overrides": ["loss.pos_margin=0.2", "optim.epochs=40"]}, 0.3)
    ('m_pos=0.3, 40 epochs', ('loss.pos_margin=0.3', 'optim.epochs=40'))
    """
    current = knob.value_of(chosen["recipe"])
    if current is None:
        raise ValueError(f"the recipe {chosen['recipe']!r} does not name {knob.form}")
    name = chosen["recipe"].replace(knob.part(current), knob.part(value))
    overrides = tuple(
        knob.override(value) if o.startswith(knob.key + "=") else o for o in chosen["overrides"]
    )
    return name, overrides


def retune_candidates(loss: str, chosen: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """The recipes ``retune`` compares for an arm of ``loss``, by name: the baseline's validated
    recipe (``chosen``, from ``idml_recipes.json``) with its knob at each of the knob's ``retune``
    values and at the baseline's own value, the budget unchanged (every arm of a grid trains the
    same steps); empty for a loss without a knob.

    >>> list(retune_candidates("contrastive", {"recipe": "m_pos=0.2, 40 epochs",
    ...                        "overrides": ["loss.pos_margin=0.2", "optim.epochs=40"]}))
    ['m_pos=0.0, 40 epochs', 'm_pos=0.1, 40 epochs', 'm_pos=0.2, 40 epochs', \
'm_pos=0.3, 40 epochs', 'm_pos=0.4, 40 epochs', 'm_pos=0.5, 40 epochs']
    >>> list(retune_candidates("proxy_anchor", {"recipe": "proxy_lr×3, 80 epochs",
    ...                        "overrides": ["optim.proxy_lr_mult=3", "optim.epochs=80"]}))
    ['proxy_lr×1, 80 epochs', 'proxy_lr×3, 80 epochs', 'proxy_lr×10, 80 epochs', \
'proxy_lr×100, 80 epochs']
    >>> retune_candidates("multi_similarity", {"recipe": "80 epochs", "overrides": []})
    {}
    """
    knob = KNOBS.get(loss)
    if knob is None:
        return {}
    own = knob.value_of(chosen["recipe"])
    values = sorted({*(knob.retune or knob.grid), *([] if own is None else [own])})
    return dict(knob_at(knob, chosen, value) for value in values)


RETUNABLE = tuple(name for name, arm in ARMS.items() if name != "baseline" and not arm.matched)
"""The arms ``retune`` chooses a knob for: not the baseline (``validate`` chose its), nor a matched
control (it takes its knobs from the arm it matches, on top of that arm's recipe)."""


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
    return knob_at(knob, chosen, target)


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


def against_own_controls(
    prefix: str,
    arm: str,
    against: tuple[tuple[str, str], ...],
    frozen: str = "the same, u frozen",
) -> list[tuple[str, str, str]]:
    """A family that compares ``arm`` (one :func:`with_controls` made) with each ``(what, other
    arm)`` of ``against`` and with its own two controls, each label "<prefix> − <what>". The
    README's summary finds its rows by these labels in committed tables: keep them as they are."""
    frozen_arm, uniform_arm = controls_of(ARMS, arm)
    return [
        *((f"{prefix} − {what}", other, arm) for what, other in against),
        (f"{prefix} − {frozen}", frozen_arm, arm),
        (f"{prefix} − uniform weakening matched to it", uniform_arm, arm),
    ]


U_HIGH_COMPARISONS = against_own_controls(
    "u high",
    "idml_u_high",
    (("IDML (u at 2 %)", "idml"), ("Mixup only", "mixup")),
    frozen="u high, frozen",
)
"""Where ISM weakens pairs unevenly (``u`` starting high): does it help? A family of its own."""
RUNNING_LEVEL_COMPARISONS = against_own_controls(
    "level as at test",
    "idml_running",
    (("IDML (level by batch)", "idml"), ("Mixup only", "mixup")),
)
"""With ``u`` the same in training and at test (:data:`RUNNING_LEVEL`): does it help? A family of
its own."""
DETACHED_COMPARISONS = against_own_controls(
    "head detached",
    "idml_detached",
    (("IDML (head attached)", "idml"), ("baseline", "baseline"), ("Mixup only", "mixup")),
)
"""With ``u`` unable to shape the features (:data:`DETACHED`), ISM's weakening is all the head
does: does it help? A family of its own."""
RUNNING_DETACHED_COMPARISONS = against_own_controls(
    "level as at test, detached",
    "idml_running_detached",
    (
        ("attached", "idml_running"),
        ("IDML", "idml"),
        ("baseline", "baseline"),
        ("Mixup only", "mixup"),
    ),
)
"""``u`` the same in training and at test, and unable to shape the features: the introspection at
its cleanest. A family of its own."""
PROBES: list[tuple[str, list[tuple[str, str, str]]]] = [
    (
        f"Where ISM acts: `u` starting at a quarter of its bound (`{U_HIGH}`), against its own "
        "controls",
        U_HIGH_COMPARISONS,
    ),
    (
        f"`u` the same in training and at test (`{RUNNING_LEVEL}`), against IDML and its own "
        "controls",
        RUNNING_LEVEL_COMPARISONS,
    ),
    (
        f"The head detached from the backbone (`{DETACHED}`), against IDML and its own controls",
        DETACHED_COMPARISONS,
    ),
    (
        f"The level as at test with the head detached (`{RUNNING_LEVEL}`, `{DETACHED}`), against "
        "the attached level, IDML and its own controls",
        RUNNING_DETACHED_COMPARISONS,
    ),
]
"""The tables' sections beside the main differences, each its own Holm family."""


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
