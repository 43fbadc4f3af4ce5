"""Cost of confidence scores and re-ranking next to the exact search, per query.

Two settings, synthetic clustered unit vectors (``--clusters`` centres, points = centre + noise,
L2-normalised, float32; labels = cluster ids):

* **SOP scale** (``--sop``): 60,502 × 512 searched against itself (the evaluation protocol), 11,316
  classes. The search's own lists are the gallery graph (hubness, DBA and k-reciprocal read it).
* **Large gallery** (``--n``, default 1,000,000, at each of ``--dims``): a batch of ``--queries``
  held-out queries against the gallery. The gallery graph (each reference's 20 nearest others) is
  an index-time cost, built here *within each synthetic cluster* (exact there; a stand-in for the
  gallery's self-search, whose time is reported apart and is not a query-time cost).

For each it times, per query: the exact search at the depth the confidence needs (10) and at the
re-rankers' shortlist (100); each confidence score and the logistic calibrator from the lists;
α-query expansion (+DBA) and k-reciprocal re-ranking of the shortlist (their gallery side,
``prepare``, once, reported apart); and peak RSS. Timings are medians of ``--repeats`` runs after a
warm-up; the machine's load average is printed with them (timings on a loaded machine are not
results).

Example (the recorded run): ``python benchmarks/bench_confidence.py --sop --n 1000000 --dims 128 512``;
a quick check: ``python benchmarks/bench_confidence.py --sop --sop-n 5000 --n 20000 --dims 64``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from bench_retrieval import rss_mib, timed
from idml.evaluation.confidence import (
    DEFAULT_FEATURES,
    AnswerNeighbors,
    HubnessCorrectedSimilarity,
    KnnAgreement,
    LabelMargin,
    NegativeUncertaintyLevel,
    ReferenceHubness,
    Top1Similarity,
    fit_calibration,
)
from idml.evaluation.reranking import KReciprocal, QueryExpansion
from idml.evaluation.search import NeighborLists, SearchExecution, neighbors_only

SCORES = (
    Top1Similarity(),
    LabelMargin(10),
    KnnAgreement(10),
    HubnessCorrectedSimilarity(10),
    NegativeUncertaintyLevel(),
)
RERANKERS = {
    "αQE (n 2)": QueryExpansion(query_neighbors=2),
    "αQE + DBA (n 2, 2)": QueryExpansion(query_neighbors=2, database_neighbors=2),
    "k-reciprocal (20, 6, 0.3)": KReciprocal(),
}


def clustered(
    n: int, d: int, clusters: int, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` unit vectors around ``clusters`` random unit centres and their cluster ids."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(clusters, d, generator=g), dim=1)
    out = torch.empty(n, d)
    labels = torch.empty(n, dtype=torch.long)
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        which = torch.randint(0, clusters, (stop - start,), generator=g)
        x = centres[which] + noise * torch.randn(stop - start, d, generator=g) / d**0.5
        out[start:stop] = torch.nn.functional.normalize(x, dim=1)
        labels[start:stop] = which
    return out, labels


T = TypeVar("T")


def once(fn: Callable[..., T]) -> tuple[float, T]:
    """Wall time of one call ``fn()`` (for steps too slow to repeat) and its result (``...``: as
    :func:`bench_retrieval.timed`)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def within_cluster_graph(x: torch.Tensor, labels: torch.Tensor, k: int) -> NeighborLists:
    """Each point's ``k`` nearest others *in its own cluster* (exact there): the stand-in gallery
    graph of the large setting (module docstring)."""
    ids = torch.full((len(x), k), -1, dtype=torch.long)
    scores = torch.full((len(x), k), -torch.inf)
    order = torch.argsort(labels, stable=True)
    bounds = torch.searchsorted(labels[order], torch.unique(labels), right=True)
    start = 0
    for stop in bounds.tolist():
        members = order[start:stop]
        start = stop
        if len(members) < 2:
            continue
        lists = neighbors_only(x[members], min(k, len(members) - 1))
        kk = lists.k
        ids[members, :kk] = members[lists.indices.clamp_min(0)]
        scores[members, :kk] = lists.scores
    return NeighborLists(ids, scores)


def confidence_costs(
    answers: AnswerNeighbors, labels: torch.Tensor, repeats: int
) -> dict[str, float]:
    """Seconds for each score and for the logistic calibrator on ``answers``."""
    out = {}
    for score in SCORES:
        out[score.key], _ = timed(lambda s=score: s(answers), repeats)
    assert answers.labels is not None  # the answers are built with the gallery's labels
    correct = answers.labels[:, 0] == labels
    # Timing only: a few forced errors so that a calibrator can be fitted on easy synthetic data.
    correct[: max(4, len(correct) // 10) : 2] = False
    calibration = fit_calibration(answers, correct, DEFAULT_FEATURES)
    out["calibrated (logistic, 3 scores)"], _ = timed(
        lambda: calibration.confidence(answers), repeats
    )
    return out


def report(title: str, n_queries: int, rows: dict[str, float], search_key: str) -> list[str]:
    base = rows[search_key] / n_queries
    lines = [f"\n{title}", f"{'step':42s} {'µs/query':>12s} {'× search':>9s}"]
    for name, seconds in rows.items():
        per = seconds / n_queries
        lines.append(f"{name:42s} {1e6 * per:12.2f} {per / base:9.4f}")
    return lines


def bench_sop(n: int, d: int, classes: int, noise: float, repeats: int) -> dict[str, object]:
    x, labels = clustered(n, d, classes, noise, seed=0)
    u = torch.rand(n)
    execution = SearchExecution()
    rows: dict[str, float] = {}
    rows["exact search, k=10"], lists10 = once(lambda: neighbors_only(x, 10, execution=execution))
    rows["exact search, k=100 (shortlist)"], lists = once(
        lambda: neighbors_only(x, 100, execution=execution)
    )
    hub = ReferenceHubness.from_neighbors(lists10, 10)
    answers = AnswerNeighbors.from_search(lists10, labels, hub, u)
    rows.update(confidence_costs(answers, labels, repeats))
    prepare: dict[str, float] = {}
    for name, reranker in RERANKERS.items():
        prepare[name], prepared = once(lambda r=reranker: r.prepare(x, lists))
        rows[f"re-rank: {name}"], _ = once(lambda r=reranker, p=prepared: r.rerank(lists, p))
    lines = report(f"SOP scale: {n:,} × {d} against itself", n, rows, "exact search, k=10")
    lines.append(
        "gallery side (prepare, once per gallery, s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in prepare.items())
    )
    print("\n".join(lines), flush=True)
    return {"n": n, "d": d, "seconds": rows, "prepare_seconds": prepare}


def bench_large(
    n: int, d: int, clusters: int, noise: float, n_queries: int, repeats: int
) -> dict[str, object]:
    x, labels = clustered(n + n_queries, d, clusters, noise, seed=1)
    gallery, queries = x[:n], x[n:]
    g_labels, q_labels = labels[:n], labels[n:]
    start = time.perf_counter()
    graph = within_cluster_graph(gallery, g_labels, 20)
    graph_seconds = time.perf_counter() - start
    hub = ReferenceHubness.from_neighbors(graph, 10)
    rows: dict[str, float] = {}
    rows["exact search, k=10"], lists10 = timed(
        lambda: neighbors_only(queries, 10, gallery), repeats
    )
    rows["exact search, k=100 (shortlist)"], lists = timed(
        lambda: neighbors_only(queries, 100, gallery), repeats
    )
    answers = AnswerNeighbors.from_search(lists10, g_labels, hub, torch.rand(n_queries))
    rows.update(confidence_costs(answers, q_labels, repeats))
    prepare: dict[str, float] = {}
    for name, reranker in RERANKERS.items():
        prepare[name], prepared = once(lambda r=reranker: r.prepare(gallery, graph))
        rows[f"re-rank: {name}"], _ = timed(
            lambda r=reranker, p=prepared: r.rerank(lists, p, queries), repeats
        )
    lines = report(
        f"gallery {n:,} × {d}, batch of {n_queries:,} queries",
        n_queries,
        rows,
        "exact search, k=10",
    )
    lines.append(f"gallery graph within clusters (stand-in, index time): {graph_seconds:.1f} s")
    lines.append(
        "gallery side (prepare, once per gallery, s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in prepare.items())
    )
    print("\n".join(lines), flush=True)
    return {"n": n, "d": d, "queries": n_queries, "seconds": rows, "prepare_seconds": prepare}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sop", action="store_true", help="also the SOP-scale same-set setting")
    p.add_argument("--sop-n", type=int, default=60_502)
    p.add_argument("--sop-classes", type=int, default=11_316)
    p.add_argument("--n", type=int, default=1_000_000, help="large gallery size (0: skip)")
    p.add_argument("--dims", type=int, nargs="+", default=[128, 512])
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--noise", type=float, default=1.0, help="noise norm relative to the centre")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    print(
        f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs",
        flush=True,
    )
    results: dict[str, object] = {"load_before": os.getloadavg()[0]}
    if args.sop:
        results["sop"] = bench_sop(args.sop_n, 512, args.sop_classes, args.noise, args.repeats)
    if args.n:
        results["large"] = [
            bench_large(args.n, d, args.clusters, args.noise, args.queries, args.repeats)
            for d in args.dims
        ]
    results["load_after"] = os.getloadavg()[0]
    results["peak_rss_mib"] = rss_mib()
    print(f"\npeak RSS {rss_mib():,.0f} MiB; load average after {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
