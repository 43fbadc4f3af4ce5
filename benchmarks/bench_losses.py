"""Forward + backward time of every idml loss against pytorch-metric-learning's (pml) implementation.

For each of the eight losses of :mod:`idml.losses` (and PEL, which pml does not have) this times,
in one process
and interleaved repeat by repeat:

- **pml**: the pml loss with its miner, 240 images, integer labels;
- **plain**: ours on 120 real + 120 Mixup images with set labels, the plain metric;
- **ISM**: ours on the same batch with the introspective metric and a ``d_u``-dimensional
  uncertainty embedding (which also receives a gradient).

Embeddings are ``d = 512``, ``C = 100`` classes, float32 on the CPU; the 120 real images are 30 classes
× 4 images drawn from the 100, and each Mixup image is ``λ·x_a + (1−λ)·x_b`` of a random partner
(in embedding space, which is all a loss sees). Each timing is one ``loss.backward()`` from fresh leaf
tensors, miner included; the table gives the median over the repeats after warm-up and the ratios
ours/pml and ISM/plain (targets: ≤ 1.0 and ≤ 1.25).

The default clock is the process's CPU time, not wall time: on a machine shared with other jobs, wall
time mostly measures how long the scheduler kept this process waiting. Run with
``OMP_NUM_THREADS=1`` so that CPU time and work coincide (``--clock wall`` is available).

``--breakdown`` adds a second table that splits the ISM overhead of each loss, timed the same way:

- **ISM, u = 0**: the ISM loss without an uncertainty embedding (``β = 0``): the cost of the
  weakening alone;
- **β**: the joint uncertainty ``β_ij = ||u_i + u_j||`` (:func:`~idml.metrics.pairwise_uncertainty`)
  forward + backward on its own, or ``||u_i||`` for the proxy losses;
- **u-Gram floor**: the two matrix products that any exact ``β`` for all pairs needs, ``u·uᵀ``
  forward and one ``(B×B)·(B×d_u)`` product backward, with nothing else (0 for proxy losses, whose
  proxies have no uncertainty). ``floor/plain`` is its share of the plain loss: the ISM target
  (≤ 1.25) cannot be met where the floor alone nears 0.25.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_losses.py [--repeats 30] [--markdown] [--breakdown]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from torch import Tensor, nn

from idml.embeddings import Embeddings
from idml.losses.base import ProxyLoss
from idml.losses.contrastive import ContrastiveLoss
from idml.losses.fastap import FastAPLoss
from idml.losses.margin import MarginLoss
from idml.losses.multi_similarity import MultiSimilarityLoss
from idml.losses.pel import PELLoss
from idml.losses.proxy_anchor import ProxyAnchorLoss
from idml.losses.proxy_nca import ProxyNCALoss
from idml.losses.softmax import NormalizedSoftmaxLoss
from idml.losses.triplet import TripletLoss
from idml.metrics import (
    CosineSimilarity,
    EuclideanDistance,
    IntrospectiveMetric,
    Metric,
    pairwise_uncertainty,
)
from idml.relations import LabelSets

NUM_CLASSES = 100
DIM = 512
REAL_CLASSES, PER_CLASS = 30, 4

PLAIN_TARGET = 1.0
ISM_TARGET = 1.25


@dataclass
class Batch:
    """One benchmark batch: 120 real + 120 mixed embeddings, their set labels and pml's integer labels."""

    semantic: Tensor
    uncertainty: Tensor
    log_variance: Tensor
    set_labels: LabelSets
    int_labels: Tensor


def make_batch(seed: int, uncertainty_dim: int) -> Batch:
    """Class-structured embeddings so that miners and margins see realistic, varied distances."""
    generator = torch.Generator().manual_seed(seed)
    classes = torch.randperm(NUM_CLASSES, generator=generator)[:REAL_CLASSES]
    labels = classes.repeat_interleave(PER_CLASS)
    centres = F.normalize(torch.randn(NUM_CLASSES, DIM, generator=generator), dim=1)
    real = centres[labels] + 0.04 * torch.randn(len(labels), DIM, generator=generator)
    partner = torch.randperm(len(labels), generator=generator)
    lam = torch.rand(len(labels), 1, generator=generator)
    mixed = lam * real + (1 - lam) * real[partner]
    set_labels = LabelSets.from_labels(labels).cat(LabelSets.mixed(labels, labels[partner]))
    semantic = torch.cat([real, mixed])
    return Batch(
        semantic=semantic,
        uncertainty=0.1 * torch.randn(len(semantic), uncertainty_dim, generator=generator),
        log_variance=-4.0 + 0.1 * torch.randn(len(semantic), DIM, generator=generator),
        set_labels=set_labels,
        int_labels=set_labels.primary.clone(),
    )


def ism(base: Metric) -> IntrospectiveMetric:
    """The introspective metric with the paper's defaults (γ = 0, τ = 5)."""
    return IntrospectiveMetric(base, gamma=0.0, tau=5.0)


@dataclass
class Case:
    """One row of the table: how to run pml, ours plain and ours with ISM (None: not applicable).

    ``ism_without_uncertainty`` is the ISM loss on semantic embeddings only (``β = 0``) and
    ``proxies`` says whether ``β`` is ``||u_i||`` against proxies rather than a pairwise matrix; both
    serve the ``--breakdown`` table.
    """

    name: str
    pml: Callable[[Batch], Tensor] | None
    plain: Callable[[Batch], Tensor]
    ism: Callable[[Batch], Tensor] | None
    modules: tuple[nn.Module, ...] = ()
    ism_without_uncertainty: Callable[[Batch], Tensor] | None = None
    proxies: bool = False


def leaf(t: Tensor) -> Tensor:
    """A fresh leaf copy that will receive a gradient (so every repeat starts from scratch)."""
    return t.detach().clone().requires_grad_(True)


def pml_runner(loss: nn.Module, miner: nn.Module | None) -> Callable[[Batch], Tensor]:
    """pml's loss (after its miner) on all 240 images with integer labels."""

    def run(batch: Batch) -> Tensor:
        x = leaf(batch.semantic)
        indices = miner(x, batch.int_labels) if miner is not None else None
        return loss(x, batch.int_labels, indices)

    return run


def ours_runner(loss: nn.Module, with_uncertainty: bool) -> Callable[[Batch], Tensor]:
    """Our loss on the 240 images with set labels, with or without the uncertainty embedding."""

    def run(batch: Batch) -> Tensor:
        x = leaf(batch.semantic)
        emb = Embeddings(x, leaf(batch.uncertainty)) if with_uncertainty else Embeddings(x)
        return loss(emb, batch.set_labels)

    return run


def build_cases(seed: int) -> list[Case]:
    """Every loss with its default hyper-parameters, pml configured to match; proxies shared."""
    torch.manual_seed(seed)
    cases: list[Case] = []

    pairs: list[
        tuple[str, Callable[[Metric | None], nn.Module], Metric, nn.Module, nn.Module | None]
    ] = [
        (
            "Contrastive",
            lambda m: ContrastiveLoss(metric=m),
            EuclideanDistance(),
            pml_losses.ContrastiveLoss(pos_margin=0.0, neg_margin=0.5),
            None,
        ),
        (
            "Margin+DW",
            lambda m: MarginLoss(metric=m),
            EuclideanDistance(),
            pml_losses.MarginLoss(margin=0.2, beta=1.2),
            pml_miners.DistanceWeightedMiner(cutoff=0.5, nonzero_loss_cutoff=1.4),
        ),
        (
            "Triplet+SH",
            lambda m: TripletLoss(metric=m),
            EuclideanDistance(),
            pml_losses.TripletMarginLoss(margin=0.1),
            pml_miners.TripletMarginMiner(margin=0.1, type_of_triplets="semihard"),
        ),
        (
            "MultiSimilarity",
            lambda m: MultiSimilarityLoss(metric=m),
            CosineSimilarity(),
            pml_losses.MultiSimilarityLoss(alpha=2.0, beta=50.0, base=0.5),
            pml_miners.MultiSimilarityMiner(epsilon=0.1),
        ),
    ]
    for name, make, base, pml_loss, pml_miner in pairs:
        plain, introspective = make(None), make(ism(base))
        cases.append(
            Case(
                name,
                pml_runner(pml_loss, pml_miner),
                ours_runner(plain, with_uncertainty=False),
                ours_runner(introspective, with_uncertainty=True),
                ism_without_uncertainty=ours_runner(introspective, with_uncertainty=False),
            )
        )

    proxies: list[tuple[str, Callable[..., ProxyLoss], Metric, nn.Module]] = [
        (
            "NormSoftmax",
            NormalizedSoftmaxLoss,
            CosineSimilarity(),
            pml_losses.NormalizedSoftmaxLoss(NUM_CLASSES, DIM, temperature=0.05),
        ),
        (
            "ProxyNCA",
            ProxyNCALoss,
            EuclideanDistance(),
            pml_losses.ProxyNCALoss(NUM_CLASSES, DIM, softmax_scale=9.0),
        ),
        (
            "ProxyAnchor",
            ProxyAnchorLoss,
            CosineSimilarity(),
            pml_losses.ProxyAnchorLoss(NUM_CLASSES, DIM, margin=0.1, alpha=32),
        ),
    ]
    for name, make, base, pml_loss in proxies:
        plain = make(NUM_CLASSES, DIM)
        introspective = make(NUM_CLASSES, DIM, metric=ism(base))
        introspective.load_state_dict(plain.state_dict())
        with torch.no_grad():  # same proxies everywhere (pml keeps class weights as (d, C) columns)
            if hasattr(pml_loss, "W"):
                pml_proxies, ours = pml_loss.W, plain.proxies.T
            else:
                pml_proxies, ours = pml_loss.proxies, plain.proxies
            assert isinstance(pml_proxies, Tensor)  # an nn.Parameter of the pml loss
            pml_proxies.copy_(ours)
        cases.append(
            Case(
                name,
                pml_runner(pml_loss, None),
                ours_runner(plain, with_uncertainty=False),
                ours_runner(introspective, with_uncertainty=True),
                modules=(plain, introspective, pml_loss),
                ism_without_uncertainty=ours_runner(introspective, with_uncertainty=False),
                proxies=True,
            )
        )

    fastap_ism = FastAPLoss(metric=ism(EuclideanDistance()))
    cases.append(
        Case(
            "FastAP",
            pml_runner(pml_losses.FastAPLoss(num_bins=10), None),
            ours_runner(FastAPLoss(), with_uncertainty=False),
            ours_runner(fastap_ism, with_uncertainty=True),
            ism_without_uncertainty=ours_runner(fastap_ism, with_uncertainty=False),
        )
    )

    pel = PELLoss(generator=torch.Generator().manual_seed(seed))

    def run_pel(batch: Batch) -> Tensor:
        return pel(Embeddings(leaf(batch.semantic), leaf(batch.log_variance)), batch.set_labels)

    cases.append(Case("PEL (ours only)", None, run_pel, None, modules=(pel,)))
    return cases


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def time_once(
    run: Callable[[Batch], Tensor],
    batch: Batch,
    modules: tuple[nn.Module, ...],
    clock: Callable[[], float] = time.process_time,
) -> float:
    """Seconds of one forward + backward (backward only for a result that needs one), gradients of
    the loss modules cleared first."""
    for module in modules:
        module.zero_grad(set_to_none=True)
    start = clock()
    result = run(batch)
    if result.requires_grad:
        result.backward()
    return clock() - start


def measure_variants(
    variants: dict[str, Callable[[Batch], Tensor] | None],
    batch: Batch,
    repeats: int,
    warmup: int,
    clock: Callable[[], float],
    modules: tuple[nn.Module, ...] = (),
) -> dict[str, float]:
    """Median seconds per variant (None: skipped); the variants alternate within each repeat, in
    rotating order, so that load changes on the machine hit them alike."""
    active = {k: v for k, v in variants.items() if v is not None}
    times: dict[str, list[float]] = {k: [] for k in active}
    names = list(active)
    for repeat in range(warmup + repeats):
        shift = repeat % len(names)
        for key in names[shift:] + names[:shift]:
            elapsed = time_once(active[key], batch, modules, clock)
            if repeat >= warmup:
                times[key].append(elapsed)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(
    case: Case, batch: Batch, repeats: int, warmup: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Median seconds of pml, ours plain and ours with ISM."""
    variants = {"pml": case.pml, "plain": case.plain, "ism": case.ism}
    return measure_variants(variants, batch, repeats, warmup, clock, case.modules)


def joint_uncertainty_runner(proxies: bool) -> Callable[[Batch], Tensor]:
    """``β`` alone, forward + backward: all pairs of the batch, or ``||u_i||`` against C proxies."""

    def run(batch: Batch) -> Tensor:
        u = leaf(batch.uncertainty)
        if proxies:
            return pairwise_uncertainty(u, None, len(u), NUM_CLASSES, u).sum()
        return pairwise_uncertainty(u, u, len(u), len(u), u).sum()

    return run


def gram_floor(batch: Batch) -> Tensor:
    """The two products an exact pairwise ``β`` needs: ``u·uᵀ`` and one ``(B×B)·(B×d_u)`` backward."""
    u = batch.uncertainty
    with torch.no_grad():
        gram = u @ u.T
        return gram @ u


def breakdown(
    case: Case, batch: Batch, repeats: int, warmup: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Median seconds of plain, ISM, ISM with ``u = 0``, ``β`` alone and the u-Gram floor."""
    variants = {
        "plain": case.plain,
        "ism": case.ism,
        "ism_u0": case.ism_without_uncertainty,
        "beta": joint_uncertainty_runner(case.proxies),
        "floor": None if case.proxies else gram_floor,
    }
    medians = measure_variants(variants, batch, repeats, warmup, clock, case.modules)
    medians.setdefault("floor", 0.0)
    return medians


def fmt_ms(seconds: float | None) -> str:
    """Milliseconds with two decimals, or a dash for a variant that does not exist."""
    return "—" if seconds is None else f"{1e3 * seconds:.2f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    """``a / b`` with two decimals, or a dash."""
    return "—" if a is None or b is None else f"{a / b:.2f}"


def main() -> None:
    """Parse the options, time every case and print the table and the target check."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed repeats per variant (>= 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed warm-up repeats")
    parser.add_argument("--uncertainty-dim", type=int, default=DIM, help="d_u of the ISM runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, help="run only these loss names")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: process CPU time (robust on a shared machine); wall: elapsed time",
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also split each ISM overhead: weakening only (u = 0), β alone, u-Gram floor",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    batch = make_batch(args.seed, args.uncertainty_dim)
    cases = build_cases(args.seed)
    if args.only:
        cases = [c for c in cases if c.name in set(args.only)]

    machine = platform.processor() or platform.machine()
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} thread(s), {machine}; "
        f"B = 240 (120 real + 120 mixed), d = {DIM}, d_u = {args.uncertainty_dim}, "
        f"C = {NUM_CLASSES}, "
        f"float32 CPU; {args.clock} time, median of {args.repeats} after {args.warmup} warm-up"
    )
    header = ["loss", "pml ms", "ours ms", "ours+ISM ms", "ours/pml", "ISM/plain"]
    rows = []
    misses = []
    for case in cases:
        medians = measure(case, batch, args.repeats, args.warmup, CLOCKS[args.clock])
        pml, plain, ism_time = medians.get("pml"), medians["plain"], medians.get("ism")
        rows.append(
            [
                case.name,
                fmt_ms(pml),
                fmt_ms(plain),
                fmt_ms(ism_time),
                fmt_ratio(plain, pml),
                fmt_ratio(ism_time, plain),
            ]
        )
        if pml is not None and plain / pml > PLAIN_TARGET:
            misses.append(f"{case.name}: ours/pml {plain / pml:.2f} > {PLAIN_TARGET}")
        if ism_time is not None and ism_time / plain > ISM_TARGET:
            misses.append(f"{case.name}: ISM/plain {ism_time / plain:.2f} > {ISM_TARGET}")
        print(f"  done {case.name}", flush=True)

    print_table(header, rows, args.markdown)
    print(
        "targets: ours/pml <= {:.2f}, ISM/plain <= {:.2f}: {}".format(
            PLAIN_TARGET, ISM_TARGET, "all met" if not misses else "MISSED " + "; ".join(misses)
        )
    )
    if args.breakdown:
        print_breakdown(
            [c for c in cases if c.ism is not None],
            batch,
            args.repeats,
            args.warmup,
            CLOCKS[args.clock],
            args.markdown,
        )


def print_table(header: list[str], rows: list[list[str]], markdown: bool) -> None:
    """A Markdown table, or aligned plain-text columns."""
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )


def print_breakdown(
    cases: list[Case],
    batch: Batch,
    repeats: int,
    warmup: int,
    clock: Callable[[], float],
    markdown: bool,
) -> None:
    """The ISM overhead of each loss split into the weakening, ``β`` and the u-Gram floor."""
    header = [
        "loss",
        "plain ms",
        "ISM − plain",
        "ISM(u=0) − plain",
        "β ms",
        "u-Gram floor ms",
        "floor/plain",
    ]
    rows = []
    for case in cases:
        t = breakdown(case, batch, repeats, warmup, clock)
        rows.append(
            [
                case.name,
                fmt_ms(t["plain"]),
                fmt_ms(t["ism"] - t["plain"]),
                fmt_ms(t["ism_u0"] - t["plain"]),
                fmt_ms(t["beta"]),
                fmt_ms(t["floor"]),
                fmt_ratio(t["floor"], t["plain"]),
            ]
        )
        print(f"  done breakdown {case.name}", flush=True)
    print_table(header, rows, markdown)


if __name__ == "__main__":
    main()
