"""Proxy losses: NormalizedSoftmax, ProxyNCA, ProxyAnchor.

Checked against pytorch-metric-learning 2.9 (value and gradients, float64), hand-computed cases, the
introspective metric and Mixup set labels.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses

from idml.embeddings import Embeddings
from idml.losses.base import ProxyLoss
from idml.losses.proxy_anchor import ProxyAnchorLoss
from idml.losses.proxy_nca import ProxyNCALoss
from idml.losses.softmax import NormalizedSoftmaxLoss, set_label_cross_entropy
from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric
from idml.relations import LabelSets

DIM = 8

# (num_classes, labels): balanced 7×3 and 4×5, and unbalanced with classes absent from the batch.
LABEL_CASES: dict[str, tuple[int, list[int]]] = {
    "7x3": (7, [c for c in range(7) for _ in range(3)]),
    "4x5": (4, [c for c in range(4) for _ in range(5)]),
    "unbalanced": (9, [0, 1, 1, 1, 1, 1, 1, 3, 3, 5, 8, 8, 8]),
}
SEEDS = [0, 1, 2]


def make_ours(kind: str, num_classes: int, **kwargs: Any) -> ProxyLoss:
    """Our loss with its default hyper-parameters."""
    if kind == "softmax":
        return NormalizedSoftmaxLoss(num_classes, DIM, **kwargs)
    if kind == "nca":
        return ProxyNCALoss(num_classes, DIM, **kwargs)
    return ProxyAnchorLoss(num_classes, DIM, **kwargs)


def make_oracle(
    kind: str, num_classes: int, proxies: torch.Tensor
) -> tuple[torch.nn.Module, Callable]:
    """pytorch-metric-learning's loss configured with our defaults and our proxies.

    Returns the module and a function giving its proxy gradient in our ``(C, d)`` layout.
    """
    if kind == "softmax":
        oracle = pml_losses.NormalizedSoftmaxLoss(num_classes, DIM, temperature=0.05)
        oracle.W.data = proxies.T.clone()  # pml stores class weights as (d, C) columns
        return oracle, lambda: oracle.W.grad.T
    if kind == "nca":
        oracle = pml_losses.ProxyNCALoss(num_classes, DIM, softmax_scale=9.0)
    else:
        oracle = pml_losses.ProxyAnchorLoss(num_classes, DIM, margin=0.1, alpha=32)
    oracle.proxies.data = proxies.clone()
    return oracle, lambda: oracle.proxies.grad


# ---------------------------------------------------------------------------------------- oracle
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(LABEL_CASES))
@pytest.mark.parametrize("kind", ["softmax", "nca", "anchor"])
def test_matches_pytorch_metric_learning(kind: str, case: str, seed: int) -> None:
    num_classes, label_list = LABEL_CASES[case]
    labels = torch.tensor(label_list)
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(len(labels), DIM, generator=generator, dtype=torch.float64)

    ours = make_ours(kind, num_classes).double()
    oracle, oracle_proxy_grad = make_oracle(kind, num_classes, ours.proxies.detach())

    x_ours = embeddings.clone().requires_grad_(True)
    x_oracle = embeddings.clone().requires_grad_(True)
    value_ours = ours(x_ours, labels)
    value_oracle = oracle(x_oracle, labels)
    value_ours.backward()
    value_oracle.backward()

    # float64 on both sides, different formulas: measured agreement within 3e-14 relative (NCA's
    # tiniest gradient entries 2e-10 relative, i.e. < 1e-20 absolute, which atol covers). rtol 1e-5
    # holds on any CPU and still fails a wrong scale, margin or proxy normalisation (> 1e-2).
    torch.testing.assert_close(value_ours, value_oracle, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(x_ours.grad, x_oracle.grad, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(ours.proxies.grad, oracle_proxy_grad(), rtol=1e-5, atol=1e-10)
    assert value_ours.item() > 0  # a real, non-degenerate comparison


# ------------------------------------------------------------------------------------- golden
def test_proxy_anchor_hand_computed_with_mixed_image() -> None:
    """Proxies e0, e1, e2; a mixed image (e0 + e1)/√2 with set {0, 1} and a real image e2 of class 2."""
    loss_fn = ProxyAnchorLoss(3, 3).double()
    with torch.no_grad():
        loss_fn.proxies.copy_(torch.eye(3) * 2.5)  # scale is irrelevant under cosine
    x = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 4.0]], dtype=torch.float64)
    labels = LabelSets(torch.tensor([[0, 1], [2, -1]]))

    alpha, delta, c = 32.0, 0.1, 1 / math.sqrt(2)
    # Positive terms: proxies 0 and 1 each see the mixed image at cos c, proxy 2 sees e2 at cos 1.
    pull = 2 * math.log1p(math.exp(-alpha * (c - delta))) + math.log1p(
        math.exp(-alpha * (1 - delta))
    )
    # Negative terms: proxies 0 and 1 see e2 at cos 0; proxy 2 sees the mixed image at cos 0.
    push = 3 * math.log1p(math.exp(alpha * (0 + delta)))
    expected = pull / 3 + push / 3
    # float64 hand value: a few log1p/exp of O(10) arguments, a few ε relative: rel 1e-12.
    assert loss_fn(x, labels).item() == pytest.approx(expected, rel=1e-12)

    # Were the mixed image labelled {0} only, proxy 1 would push it away instead: a different value.
    single = loss_fn(x, torch.tensor([0, 2])).item()
    # An inequality: the changed push term moves the value by far more than rel 1e-3.
    assert single != pytest.approx(expected, rel=1e-3)


def test_normalized_softmax_hand_computed() -> None:
    loss_fn = NormalizedSoftmaxLoss(2, 2, temperature=0.5).double()
    with torch.no_grad():
        loss_fn.proxies.copy_(torch.tensor([[1.0, 0.0], [0.0, 3.0]]))
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # cos 0.6 to proxy 0, 0.8 to proxy 1
    expected = -math.log(math.exp(0.6 / 0.5) / (math.exp(0.6 / 0.5) + math.exp(0.8 / 0.5)))
    # float64 softmax of 2 logits (normalised 3-4-5 vectors: cosines exact up to ε): rel 1e-12.
    assert loss_fn(x, torch.tensor([0])).item() == pytest.approx(expected, rel=1e-12)


def test_proxy_nca_hand_computed_set_label() -> None:
    """Uniform set target: −½(log P0 + log P1) with P = softmax(−9·||x̂ − p̂||²)."""
    loss_fn = ProxyNCALoss(3, 2).double()
    with torch.no_grad():
        loss_fn.proxies.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
    x = torch.tensor([[0.6, 0.8]], dtype=torch.float64)
    squared = [0.8, 0.4, 3.2]  # ||x − p||² for unit x and p
    logits = [-9 * d for d in squared]
    log_norm = math.log(sum(math.exp(z) for z in logits))
    expected = -0.5 * ((logits[0] - log_norm) + (logits[1] - log_norm))
    value = loss_fn(x, LabelSets(torch.tensor([[0, 1]]))).item()
    # float64 log-softmax of 3 logits of O(10) (×9 amplifies a distance's ε): ≲ 30ε, rel 1e-12.
    assert value == pytest.approx(expected, rel=1e-12)


def test_set_label_cross_entropy_targets() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0]], dtype=torch.float64)
    member = torch.tensor([[True, True, False]])
    log_p = torch.log_softmax(logits, 1)[0]
    uniform = set_label_cross_entropy(logits, member, "uniform").item()
    summed = set_label_cross_entropy(logits, member, "sum").item()
    # float64 log-softmax of 3 logits, then a mean or a log of a sum of 2: a few ε, rel 1e-12.
    assert uniform == pytest.approx(-(log_p[0] + log_p[1]).item() / 2, rel=1e-12)
    assert summed == pytest.approx(
        -math.log(log_p[0].exp().item() + log_p[1].exp().item()), rel=1e-12
    )
    # For a singleton both are the ordinary cross-entropy.
    single = torch.tensor([[False, True, False]])
    ce = F.cross_entropy(logits, torch.tensor([1])).item()
    # float64, a log-softmax of 3 logits vs F.cross_entropy's: a few ε, so rel 1e-12 (approx's
    # default rel 1e-6 was far looser).
    assert set_label_cross_entropy(logits, single, "uniform").item() == pytest.approx(ce, rel=1e-12)
    assert set_label_cross_entropy(logits, single, "sum").item() == pytest.approx(ce, rel=1e-12)


# ---------------------------------------------------------------------------------- set labels
def cosines_after_step(kind: str, labels: LabelSets) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines to proxies e0, e1, e2 of the image (e0 + e1 + ½·e2) before and after a tiny gradient step."""
    loss_fn = make_ours(kind, 3).double()
    proxies = torch.eye(3, DIM, dtype=torch.float64)
    with torch.no_grad():
        loss_fn.proxies.copy_(proxies)
    x = torch.zeros(1, DIM, dtype=torch.float64)
    x[0, :3] = torch.tensor([1.0, 1.0, 0.5])
    x.requires_grad_(True)
    loss_fn(x, labels).backward()
    assert x.grad is not None
    step = x.detach() - 1e-4 * x.grad / x.grad.norm()
    before = F.normalize(x.detach(), dim=1) @ proxies.T
    after = F.normalize(step, dim=1) @ proxies.T
    return before[0], after[0]


@pytest.mark.parametrize("kind", ["softmax", "nca", "anchor"])
def test_mixed_image_is_pulled_toward_both_source_proxies(kind: str) -> None:
    """Set {0, 1}: descending the loss moves the image toward proxies 0 AND 1 and away from proxy 2;
    with the single label {0} the same image is pushed away from proxy 1 instead."""
    before, after = cosines_after_step(kind, LabelSets.mixed(torch.tensor([0]), torch.tensor([1])))
    assert after[0] > before[0] and after[1] > before[1]
    assert after[2] < before[2]
    before, after = cosines_after_step(kind, LabelSets.from_labels(torch.tensor([0])))
    assert after[0] > before[0] and after[1] < before[1]


# ------------------------------------------------------------------------------------------ ISM
def ism_metric(kind: str, gamma: float = 0.0, tau: float = 5.0) -> IntrospectiveMetric:
    base = EuclideanDistance() if kind == "nca" else CosineSimilarity()
    return IntrospectiveMetric(base, gamma=gamma, tau=tau)


@pytest.mark.parametrize("kind", ["softmax", "nca", "anchor"])
def test_ism_with_zero_uncertainty_and_bias_equals_plain(kind: str) -> None:
    num_classes, label_list = LABEL_CASES["4x5"]
    labels = torch.tensor(label_list)
    x = torch.randn(
        len(labels), DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    plain = make_ours(kind, num_classes).double()
    ism = make_ours(kind, num_classes, metric=ism_metric(kind)).double()
    ism.load_state_dict(plain.state_dict())

    x_plain, x_ism = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    value_plain = plain(x_plain, labels)
    value_ism = ism(Embeddings(x_ism, torch.zeros(len(labels), 5, dtype=torch.float64)), labels)
    value_plain.backward()
    value_ism.backward()
    # S_IN = 1 − (1 − C)·1 is C up to one rounding; the distance form is bit-exact. float64: the
    # loss moves by ~ε·scale ≈ 1e-14, the gradients (through the same ~10-term softmaxes) by
    # ≲ 1e-13 relative, hence 1e-13 and 1e-10.
    torch.testing.assert_close(value_ism, value_plain, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(x_ism.grad, x_plain.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(ism.proxies.grad, plain.proxies.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kind", ["softmax", "nca"])
def test_ism_uncertainty_makes_a_confident_sample_less_confident(kind: str) -> None:
    """Uncertainty pulls every sample–proxy pair toward "alike", so the softmax flattens: the loss of a
    sample sitting on its proxy rises toward the uninformed value log C, never past it."""
    num_classes = 4
    loss_fn = make_ours(kind, num_classes, metric=ism_metric(kind)).double()
    with torch.no_grad():
        loss_fn.proxies.copy_(torch.eye(num_classes, DIM, dtype=torch.float64))
    x = torch.eye(num_classes, DIM, dtype=torch.float64)[:1] + 0.1
    labels = torch.tensor([0])
    values = []
    for norm in [0.0, 1.0, 3.0, 30.0]:
        u = torch.full((1, 6), norm / math.sqrt(6), dtype=torch.float64)
        values.append(loss_fn(Embeddings(x, u), labels).item())
    assert all(a < b for a, b in itertools.pairwise(values)), values
    assert values[-1] < math.log(num_classes)


def test_ism_uncertainty_weakens_proxy_anchor_pull() -> None:
    """With a single class only the positive term exists; S_IN → 1 makes it smaller."""
    loss_fn = ProxyAnchorLoss(1, DIM, metric=ism_metric("anchor")).double()
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    labels = torch.zeros(5, dtype=torch.long)
    plain_value = loss_fn(Embeddings(x, torch.zeros(5, 3, dtype=torch.float64)), labels).item()
    u = torch.randn(5, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    uncertain_value = loss_fn(Embeddings(x, u), labels).item()
    assert uncertain_value < plain_value


@pytest.mark.parametrize("kind", ["softmax", "nca", "anchor"])
def test_ism_large_uncertainty_shrinks_semantic_gradient(kind: str) -> None:
    """Uncertain images pull less (IDML, TPAMI Eq. 19–20): the semantic gradient vanishes as ||u|| grows."""
    num_classes, label_list = LABEL_CASES["4x5"]
    labels = torch.tensor(label_list)
    x = torch.randn(
        len(labels), DIM, generator=torch.Generator().manual_seed(6), dtype=torch.float64
    )
    loss_fn = make_ours(kind, num_classes, metric=ism_metric(kind)).double()
    direction = F.normalize(torch.randn(len(labels), 4, dtype=torch.float64), dim=1)
    norms = []
    for scale in [0.0, 30.0]:
        x_leaf = x.clone().requires_grad_(True)
        loss_fn(Embeddings(x_leaf, scale * direction), labels).backward()
        assert x_leaf.grad is not None
        norms.append(x_leaf.grad.norm().item())
    assert norms[1] < 0.1 * norms[0], norms


@pytest.mark.parametrize("kind", ["softmax", "nca", "anchor"])
def test_ism_learnable_proxy_uncertainty_gets_finite_gradients(kind: str) -> None:
    num_classes, label_list = LABEL_CASES["7x3"]
    labels = torch.tensor(label_list)
    generator = torch.Generator().manual_seed(7)
    loss_fn = make_ours(
        kind, num_classes, metric=ism_metric(kind, gamma=2.0), proxy_uncertainty_dim=4
    ).double()
    x = torch.randn(len(labels), DIM, generator=generator, dtype=torch.float64)
    # One sample sits exactly on its proxy (α = 0) and one has zero uncertainty: the singular points.
    with torch.no_grad():
        x[0] = loss_fn.proxies[labels[0]]
    u = torch.randn(len(labels), 4, generator=generator, dtype=torch.float64)
    u[1] = 0.0
    x.requires_grad_(True)
    u.requires_grad_(True)
    value = loss_fn(Embeddings(x, u), labels)
    value.backward()
    assert torch.isfinite(value)
    proxy_uncertainty = loss_fn.proxy_uncertainty
    assert proxy_uncertainty is not None
    for grad in (x.grad, u.grad, loss_fn.proxies.grad, proxy_uncertainty.grad):
        assert grad is not None and bool(torch.isfinite(grad).all())
    assert proxy_uncertainty.grad is not None and u.grad is not None
    assert proxy_uncertainty.grad.abs().sum() > 0
    assert u.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kind", ["softmax", "nca", "anchor"])
def test_bad_input_raises_clear_errors(kind: str) -> None:
    loss_fn = make_ours(kind, 3)
    x = torch.randn(4, DIM)
    with pytest.raises(ValueError, match="out of range"):
        loss_fn(x, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="out of range"):
        loss_fn(x, LabelSets(torch.tensor([[0, 5], [1, -1], [2, -1], [0, -1]])))
    with pytest.raises(ValueError, match="embedding_dim"):
        loss_fn(torch.randn(4, DIM + 1), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="one label"):
        loss_fn(x, torch.tensor([0, 1, 2]))
    bad = x.clone()
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        loss_fn(bad, torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="uncertainty"):
        loss_fn(Embeddings(x, torch.randn(3, 5)), torch.tensor([0, 1, 2, 0]))
    with_unc = make_ours(kind, 3, metric=ism_metric(kind), proxy_uncertainty_dim=5)
    with pytest.raises(ValueError, match="proxy_uncertainty_dim"):
        with_unc(Embeddings(x, torch.randn(4, 6)), torch.tensor([0, 1, 2, 0]))


def test_bad_hyper_parameters_raise() -> None:
    with pytest.raises(ValueError, match="temperature"):
        NormalizedSoftmaxLoss(3, DIM, temperature=0.0)
    with pytest.raises(ValueError, match="set_target"):
        NormalizedSoftmaxLoss(3, DIM, set_target="mean")  # type: ignore[arg-type]  # bad input
    with pytest.raises(ValueError, match="scale"):
        ProxyNCALoss(3, DIM, scale=-9.0)
    with pytest.raises(ValueError, match="alpha"):
        ProxyAnchorLoss(3, DIM, alpha=0.0)
    with pytest.raises(ValueError, match="margin"):
        ProxyAnchorLoss(3, DIM, margin=float("nan"))
    with pytest.raises(ValueError, match="num_classes"):
        ProxyAnchorLoss(0, DIM)


def test_defaults_follow_the_spec() -> None:
    softmax, nca, anchor = (
        NormalizedSoftmaxLoss(5, DIM),
        ProxyNCALoss(5, DIM),
        ProxyAnchorLoss(5, DIM),
    )
    assert softmax.temperature == 0.05 and isinstance(softmax.metric, CosineSimilarity)
    assert nca.scale == 9.0 and isinstance(nca.metric, EuclideanDistance) and nca.metric.power == 2
    assert (
        anchor.alpha == 32.0
        and anchor.margin == 0.1
        and isinstance(anchor.metric, CosineSimilarity)
    )
    # Proxies are the parameters a trainer gives their own learning rate.
    for loss_fn in (softmax, nca, anchor):
        assert [name for name, _ in loss_fn.named_parameters()] == ["proxies"]
        assert loss_fn.proxies.shape == (5, DIM)
