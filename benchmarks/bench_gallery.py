"""A gallery past one machine's memory: compressed faiss indexes through ``idml.app.retrieval.Index``
beside faiss used directly with the same factory string.

Data: ``--n`` synthetic unit vectors of dimension ``--dim`` around ``--n / 100`` random centres,
each a centre plus Gaussian noise of ``--spread`` times its norm (1: a cluster's members have
cosines of about 0.5 with each other, so a query's ten nearest are mostly, not only, its cluster's:
clustered as embeddings of a trained model are, neither the isotropic worst case of a quantiser
nor clusters so tight that their members are ties), and ``--queries`` queries drawn the same way
(not in the gallery). Ground truth: the exact top-10 of every query by idml's blocked exact
search.

For each factory string (default ``IVF4096,PQ32`` and ``IVF4096_HNSW32,PQ32``: 32-byte codes, a
flat or an HNSW coarse quantiser) and each ``nprobe``:

* **build**: idml's ``Index.create(..., backend="faiss", store_vectors=False)`` (normalising,
  training on the default evenly spaced sample, adding in slices), and faiss's ``index_factory``
  + ``train`` on the same sample + ``add``;
* **bytes per item**: the serialised faiss index over ``--n``; for idml also the whole saved index
  folder (codes, ids, ``||u||``, manifest) over ``--n``;
* **recall@10** against the exact top-10, **batch** throughput (all queries in one call) and the
  median **single-query** latency (``--single`` queries one at a time).

Usage::

    python benchmarks/bench_gallery.py --n 10000000 --dim 128 --queries 10000 --truth truth-10m.pt
    python benchmarks/bench_gallery.py --n 200000 --queries 1000                # a quick one
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def clustered_unit_vectors(
    n: int, dim: int, centres: torch.Tensor, spread: float, seed: int, chunk: int = 1 << 20
) -> torch.Tensor:
    """``n`` unit vectors, each a random centre plus Gaussian noise, written chunk by chunk."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, dim)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        which = torch.randint(0, len(centres), (rows,), generator=g)
        block = centres[which] + spread * torch.randn(rows, dim, generator=g)
        out[start : start + rows] = torch.nn.functional.normalize(block, dim=1)
    return out


def exact_top10(
    queries: torch.Tensor, gallery: torch.Tensor, search, chunk: int = 1 << 20
) -> torch.Tensor:
    """The exact top-10 of every query, the gallery searched a slice at a time (the search
    normalises a copy of what it is given) and the slices' lists merged by (score, index)."""
    scores, ids = [], []
    for start in range(0, len(gallery), chunk):
        found = search(queries, 10, gallery[start : start + chunk])
        scores.append(found.scores)
        ids.append(found.indices + start)
    scores_all, ids_all = torch.cat(scores, dim=1), torch.cat(ids, dim=1)
    order = torch.argsort(ids_all, dim=1, stable=True)  # ties: the lower index first
    scores_all, ids_all = scores_all.gather(1, order), ids_all.gather(1, order)
    best = torch.argsort(-scores_all, dim=1, stable=True)[:, :10]
    return ids_all.gather(1, best)


def recall_at_10(found: torch.Tensor, truth: torch.Tensor) -> float:
    hits = (found.unsqueeze(2) == truth.unsqueeze(1)).any(dim=2).sum(dim=1)
    return float(hits.double().mean() / truth.shape[1])


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def sweep(search, set_parameters, queries: torch.Tensor, truth: torch.Tensor, args) -> list[str]:
    """Per ``nprobe``: ``nprobe | recall@10 | batch queries/s | median single-query ms`` of
    ``search(queries, 10)`` (whose result, or its ``.indices``, are item positions)."""
    lines = []
    for nprobe in args.nprobe.split(","):
        set_parameters(f"nprobe={nprobe}")
        start = time.perf_counter()
        found = search(queries, 10)
        batch_s = time.perf_counter() - start
        if not isinstance(found, torch.Tensor):  # idml's SearchResult (a Tensor has .indices too)
            found = found.indices
        times = []
        for q in queries[: args.single]:
            start = time.perf_counter()
            search(q.unsqueeze(0), 10)
            times.append(time.perf_counter() - start)
        lines.append(
            f"{nprobe} | {recall_at_10(found, truth):.4f} | {len(queries) / batch_s:,.0f} | "
            f"{1000 * statistics.median(times):.2f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--single", type=int, default=200, help="queries timed one at a time")
    parser.add_argument("--factories", default="IVF4096,PQ32;IVF4096_HNSW32,PQ32")
    parser.add_argument("--nprobe", default="8,32,128")
    parser.add_argument(
        "--spread",
        type=float,
        default=1.0,
        help="noise norm / centre norm (1: cosine ~0.5 within a cluster)",
    )
    parser.add_argument("--no-faiss", action="store_true", help="skip faiss used directly")
    parser.add_argument(
        "--truth",
        type=Path,
        default=None,
        help="file of the exact top-10 (written when missing, read when it matches the run's "
        "--n, --dim, --queries and --spread): the exact search is the longest step at 10M",
    )
    args = parser.parse_args()

    import faiss

    from idml.app.retrieval import Index
    from idml.evaluation.search import neighbors_only
    from idml.evaluation.search.faiss_backend import training_positions

    print(
        f"{args.n:,} × {args.dim} gallery, {args.queries:,} queries; torch threads "
        f"{torch.get_num_threads()}, faiss threads {faiss.omp_get_max_threads()}, load average "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(max(args.n // 100, 1), args.dim, generator=g) / args.dim**0.5
    start = time.perf_counter()
    gallery = clustered_unit_vectors(args.n, args.dim, centres, args.spread / args.dim**0.5, 1)
    queries = clustered_unit_vectors(
        args.queries, args.dim, centres, args.spread / args.dim**0.5, 2
    )
    print(f"data: {time.perf_counter() - start:.0f} s", flush=True)
    key = {"n": args.n, "dim": args.dim, "queries": args.queries, "spread": args.spread}
    stored = torch.load(args.truth) if args.truth is not None and args.truth.is_file() else None
    if stored is not None and stored["key"] == key:
        truth, exact_s = stored["truth"], stored["seconds"]
        print(f"exact top-10 read from {args.truth} (computed in {exact_s:.0f} s)", flush=True)
    else:
        start = time.perf_counter()
        truth = exact_top10(queries, gallery, neighbors_only)
        exact_s = time.perf_counter() - start
        if args.truth is not None:
            torch.save({"key": key, "truth": truth, "seconds": exact_s}, args.truth)
        print(
            f"exact top-10 (idml blocked exact search): {exact_s:.0f} s, "
            f"{args.queries / exact_s:,.1f} queries/s",
            flush=True,
        )
    rows: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="idml-gallery-"))
    try:
        for factory in args.factories.split(";"):
            start = time.perf_counter()
            index = Index.create(
                gallery, backend="faiss", faiss_factory=factory, store_vectors=False
            )
            build_s = time.perf_counter() - start
            faiss_bytes = len(faiss.serialize_index(index.faiss_index))
            index.save(work / "index")
            disk = folder_bytes(work / "index")
            shutil.rmtree(work / "index")
            print(f"idml {factory}: built in {build_s:.0f} s", flush=True)
            # The first search builds each item's class for the answers (a one-time cost that
            # `idml serve` pays at start-up): timed apart, so that the sweep is the steady state.
            start = time.perf_counter()
            index.search(queries[:1], 10)
            print(f"idml {factory}: first search {time.perf_counter() - start:.2f} s", flush=True)
            size = f"{faiss_bytes / args.n:.1f} ({disk / args.n:.1f} saved)"
            for line in sweep(index.search, index.set_search_parameters, queries, truth, args):
                rows.append(f"| {factory} | idml Index | {build_s:.0f} s | {size} | {line} |")
                print(rows[-1], flush=True)
            del index
            if args.no_faiss:
                continue
            start = time.perf_counter()
            raw = faiss.index_factory(args.dim, factory, faiss.METRIC_INNER_PRODUCT)
            raw.train(gallery[training_positions(args.n, raw)].numpy())
            for s in range(0, args.n, 1 << 20):
                raw.add(gallery[s : s + (1 << 20)].numpy())
            build_s = time.perf_counter() - start
            size = f"{len(faiss.serialize_index(raw)) / args.n:.1f}"
            ivf = faiss.extract_index_ivf(raw)

            def search_numpy(q: torch.Tensor, k: int, raw=raw) -> torch.Tensor:
                return torch.from_numpy(raw.search(q.numpy(), k)[1])

            def set_nprobe(text: str, ivf=ivf) -> None:
                ivf.nprobe = int(text.split("=")[1])

            for line in sweep(search_numpy, set_nprobe, queries, truth, args):
                rows.append(f"| {factory} | faiss directly | {build_s:.0f} s | {size} | {line} |")
                print(rows[-1], flush=True)
            del raw
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}\n")
    print(
        "| factory | through | build | bytes per item | nprobe | recall@10 | batch queries/s "
        "| single query (ms) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\nexact search of the {args.queries:,} queries: {exact_s:.0f} s")


if __name__ == "__main__":
    main()
