"""Cost of answering in ``idml search`` / ``serve``: calibrated confidence, abstention and
re-ranking per query, beside the search itself, through :meth:`idml.app.retrieval.Index.search`.

A synthetic clustered gallery (``--n`` unit vectors of ``--dim`` around ``--clusters`` centres,
labels = cluster ids, as in ``bench_confidence.py``) in an exact index with labels, and held-out
queries of the same clusters. A share ``--label-noise`` of the gallery is labelled as another
cluster: the geometry alone makes every top-1 answer right once clusters hold ~1,000 items (at 1M,
128 or 512 dimensions, noise 1.2), and a calibration needs wrong answers to learn from; a mislabelled
top-1 is also the wrong answer the confidence features can see (its neighbours disagree with it).
It times, for a batch of ``--batch`` queries (median of ``--repeats``) and for single queries
(median of ``--singles``), top-``k`` search with:

* the plain answer (the top-1 similarity, no abstention): the search itself, ``k`` deep;
* the calibrated confidence of ``idml calibrate`` (logistic on top-1, margin@10, agreement@10; the
  search goes 10 deep), with and without ``--target-precision 0.9``;
* αQE, αQE + DBA and k-reciprocal re-ranking of a shortlist of 100, then the calibrated confidence.

Reported apart, once per gallery: fitting the calibration (``idml calibrate`` on
``--calibration-queries`` labelled queries against the index) and each re-ranker's gallery side
(``GalleryReranking.prepare``, what ``idml serve`` does at start-up). The gallery graph DBA and
k-reciprocal read is, as in ``bench_confidence.py``, each item's nearest others *within its
synthetic cluster* (a stand-in: the product searches the whole gallery once at load, exact or with
the index's faiss index; that search's cost is the exact search of ``len(index)`` queries, which
the batch timing scales to). Peak RSS and the load average are printed (timings on a loaded machine
are not results).

Example (the recorded run): ``OMP_NUM_THREADS=1 python benchmarks/bench_answers.py --n 1000000``;
a quick check: ``python benchmarks/bench_answers.py --n 20000 --dim 64 --clusters 200``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import TypedDict

import torch

from bench_confidence import clustered, within_cluster_graph
from bench_retrieval import rss_mib, timed
from idml.app.calibration import CalibrationRecipe, fit_on_embeddings
from idml.app.retrieval import AnswerPolicy, GalleryReranking, Index
from idml.embeddings import Embeddings
from idml.evaluation.reranking import KReciprocal, QueryExpansion, Reranker

RERANKERS: dict[str, Reranker] = {
    "αQE (n 2)": QueryExpansion(query_neighbors=2),
    "αQE + DBA (n 2, 2)": QueryExpansion(query_neighbors=2, database_neighbors=2),
    "k-reciprocal (20, 6, 0.3)": KReciprocal(),
}


class SearchOptions(TypedDict, total=False):
    """The keyword arguments of :meth:`Index.search` a timed step sets."""

    policy: AnswerPolicy
    reranking: GalleryReranking


def mislabel(labels: torch.Tensor, clusters: int, share: float, seed: int) -> torch.Tensor:
    """``labels`` with a random ``share`` of them moved to another cluster (never their own).

    >>> out = mislabel(torch.zeros(1000, dtype=torch.long), 5, 0.1, seed=0)
    >>> int((out != 0).sum()), int(out.max()) <= 4
    (100, True)
    """
    g = torch.Generator().manual_seed(seed)
    out = labels.clone()
    which = torch.randperm(len(labels), generator=g)[: round(share * len(labels))]
    shift = torch.randint(1, clusters, (len(which),), generator=g)
    out[which] = (out[which] + shift) % clusters
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000, help="gallery size")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--noise", type=float, default=1.2, help="noise norm relative to the centre")
    p.add_argument(
        "--label-noise",
        type=float,
        default=0.1,
        help="share of gallery items labelled as a random other cluster (wrong answers)",
    )
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--singles", type=int, default=20)
    p.add_argument("--calibration-queries", type=int, default=2000)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    if not 0.0 <= args.label_noise < 1.0:
        p.error(f"--label-noise must be in [0, 1), got {args.label_noise}")
    total = args.n + args.batch + args.calibration_queries
    points, labels = clustered(total, args.dim, args.clusters, args.noise, seed=0)
    g, q = slice(0, args.n), slice(args.n, args.n + args.batch)
    c = slice(args.n + args.batch, total)
    gallery_labels = mislabel(labels[g], args.clusters, args.label_noise, seed=1)
    index = Index.create(points[g], labels=[str(int(v)) for v in gallery_labels])
    assert index.embeddings is not None  # an exact index keeps its vectors
    queries = points[q].clone()
    results: dict[str, object] = {
        "n": args.n,
        "dim": args.dim,
        "label_noise": args.label_noise,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(results), flush=True)

    once: dict[str, float] = {}
    start = time.perf_counter()
    recipe = CalibrationRecipe()
    calibration, _ = fit_on_embeddings(
        Embeddings(points[c].clone()), labels[c], recipe, {}, (index.embeddings, gallery_labels)
    )
    once["fit the calibration (idml calibrate)"] = time.perf_counter() - start
    del points
    calibrated = AnswerPolicy(calibration, "calibrated")
    abstaining = AnswerPolicy(calibration, "calibrated", threshold=calibration.threshold(0.9))
    graph = None
    rerankings: dict[str, GalleryReranking] = {}
    for name, reranker in RERANKERS.items():
        start = time.perf_counter()
        if reranker.gallery_depth > 0 and graph is None:
            graph = within_cluster_graph(index.embeddings, labels[g], 20)
            once["gallery graph, 20 nearest within each cluster (stand-in)"] = (
                time.perf_counter() - start
            )
            start = time.perf_counter()
        used = None if reranker.gallery_depth == 0 else graph
        rerankings[name] = GalleryReranking(reranker, reranker.prepare(index.embeddings, used))
        once[f"prepare {name}"] = time.perf_counter() - start
    print(json.dumps({"once_s": once}), flush=True)

    steps: dict[str, SearchOptions] = {
        f"search, k={args.k} (top-1 similarity)": {},
        "+ calibrated confidence": {"policy": calibrated},
        "+ calibrated, --target-precision 0.9": {"policy": abstaining},
        **{
            f"+ {name} (shortlist 100), calibrated": {"policy": calibrated, "reranking": r}
            for name, r in rerankings.items()
        },
    }
    rows = {}
    for name, options in steps.items():
        batch_s, result = timed(lambda o=options: index.search(queries, args.k, **o), args.repeats)
        singles = []
        for i in range(args.singles):
            t0 = time.perf_counter()
            index.search(queries[i : i + 1], args.k, **options)
            singles.append(time.perf_counter() - t0)
        rows[name] = {
            "batch_us_per_query": 1e6 * batch_s / len(queries),
            "single_us": 1e6 * statistics.median(singles),
            "answered": float(result.answered.double().mean()),
        }
        print(json.dumps({name: rows[name]}), flush=True)
    base = next(iter(rows.values()))
    print(f"\n{'step':58s} {'µs/query (batch)':>17s} {'× search':>9s} {'µs (single)':>12s}")
    for name, row in rows.items():
        ratio = row["batch_us_per_query"] / base["batch_us_per_query"]
        print(f"{name:58s} {row['batch_us_per_query']:17.1f} {ratio:9.3f} {row['single_us']:12.1f}")
    for name, seconds in once.items():
        print(f"once per gallery: {name}: {seconds:.2f} s")
    print(f"peak RSS {rss_mib():.0f} MiB; load average {os.getloadavg()}")
    results.update({"once_s": once, "per_query": rows, "peak_rss_mib": rss_mib()})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
