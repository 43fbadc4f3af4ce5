"""Gallery search: idml's exact index against faiss-cpu ``IndexFlatIP``, and faiss HNSW, side by side.

A synthetic clustered gallery (``--clusters`` centres on the unit sphere, points = centre + noise,
L2-normalised, float32) and held-out queries drawn the same way. For batches of 1 and of
``--batch`` queries, top-``k``:

* *ours exact*: :meth:`idml.app.retrieval.Index.search` (the blocked exact engine of the evaluation);
* *faiss flat*: ``faiss.IndexFlatIP`` on the same vectors;
* *faiss HNSW*: ``IndexHNSWFlat(d, M, METRIC_INNER_PRODUCT)`` through an idml index
  (``backend="faiss"``), recall@k against the exact neighbours and its speed-up over ours.

It prints times, queries/s and the ratios, and checks that exact neighbours are identical (a
position where the two lists differ counts as a tie when both similarities agree within 1e-6: two
float32 sums of 512 products in different orders). Also reported: the index build time and peak
RSS from embeddings (create + save), and, with ``--images N``, end-to-end images/s of
``idml index`` on a folder of N JPEGs with the small model (an untrained small-CNN run).

Example (the recorded run): ``python benchmarks/bench_retrieval.py --n 1000000``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict, TypeVar

import numpy as np
import torch


def rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def clustered(n: int, d: int, clusters: int, noise: float, seed: int) -> torch.Tensor:
    """``n`` unit vectors around ``clusters`` random unit centres, generated in chunks (bounded
    temporary memory at 1M × 512)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(clusters, d, generator=g), dim=1)
    out = torch.empty(n, d)
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        which = torch.randint(0, clusters, (stop - start,), generator=g)
        x = centres[which] + noise * torch.randn(stop - start, d, generator=g) / d**0.5
        out[start:stop] = torch.nn.functional.normalize(x, dim=1)
    return out


T = TypeVar("T")


class ExactRow(TypedDict):
    """One batch size of the exact search: ours against faiss flat."""

    queries: str
    ours_s: float
    faiss_flat_s: float
    ours_qps: float
    faiss_qps: float
    ours_over_faiss_time: float


def timed(fn: Callable[..., T], repeats: int) -> tuple[float, T]:
    """Median wall time of ``repeats`` calls of ``fn()`` (after one warm-up) and the last result.

    (``Callable[..., T]``: mypy infers no type for a ``lambda q=q: ...`` passed as
    ``Callable[[], T]``.)
    """
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def compare(ours_ids, ours_sims, ref_ids, ref_sims) -> dict[str, int]:
    """Positions where the lists differ, and how many of those are float ties (|Δsim| ≤ 1e-6)."""
    ours_ids, ref_ids = np.asarray(ours_ids), np.asarray(ref_ids)
    differ = ours_ids != ref_ids
    ties = differ & (np.abs(np.asarray(ours_sims) - np.asarray(ref_sims)) <= 1e-6)
    return {"positions": int(ours_ids.size), "differ": int(differ.sum()), "ties": int(ties.sum())}


def recall_at_k(approx: np.ndarray, exact: np.ndarray) -> float:
    hits = [len(set(a.tolist()) & set(e.tolist())) for a, e in zip(approx, exact)]
    return float(np.sum(hits) / exact.size)


def bench_images(count: int, root: Path) -> dict[str, float]:
    """End-to-end ``idml index`` on ``count`` 64×64 JPEGs with an untrained small-CNN run."""
    from PIL import Image

    from idml.app.cli import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_run import train_tiny

    train_tiny(root, ["data.image_size=32", "model.embedding_dim=128"])
    folder = root / "jpegs"
    rng = np.random.default_rng(0)
    for i in range(count):
        sub = folder / f"class{i % 10}"
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(sub / f"{i}.jpg")
    start = time.perf_counter()
    out, run = str(root / "img-index"), str(root / "run")
    rc = main(["index", str(folder), "--out", out, "--checkpoint", run, "--batch-size", "128"])
    elapsed = time.perf_counter() - start
    assert rc == 0
    return {"images": count, "seconds": elapsed, "images_per_s": count / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000, help="gallery size")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--noise", type=float, default=1.0, help="noise norm relative to the centre")
    p.add_argument("--batch", type=int, default=1000, help="queries of the batched search")
    p.add_argument("--singles", type=int, default=20, help="single-query searches timed")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the batched search")
    p.add_argument("--hnsw-m", type=int, default=32)
    p.add_argument(
        "--ef-search",
        default="128",
        help="HNSW efSearch values, comma-separated: one build, then every value is measured",
    )
    p.add_argument(
        "--ef-construction", type=int, default=None, help="HNSW efConstruction (faiss default 40)"
    )
    p.add_argument("--no-hnsw", action="store_true")
    p.add_argument("--images", type=int, default=0, help="also time `idml index` on N JPEGs")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()

    import faiss

    from idml.app.retrieval import Index

    info: dict[str, object] = {
        "n": args.n,
        "dim": args.dim,
        "k": args.k,
        "torch_threads": torch.get_num_threads(),
        "faiss_threads": faiss.omp_get_max_threads(),
        "faiss": faiss.__version__,
        "torch": torch.__version__,
    }
    print(json.dumps(info))
    base_rss = rss_mib()
    # One draw, split: the queries are held-out points of the same clusters.
    points = clustered(args.n + args.batch, args.dim, args.clusters, args.noise, seed=0)
    gallery, queries = points[: args.n], points[args.n :].clone()
    del points
    print(f"data: gallery {tuple(gallery.shape)}, queries {tuple(queries.shape)}", flush=True)
    results: dict[str, object] = {"setup": info}

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rss_before = rss_mib()
        start = time.perf_counter()
        index = Index.create(gallery, torch.zeros(args.n), ids=None)
        created = time.perf_counter() - start
        del gallery  # the index holds its own normalised copy; keep peak memory to what it needs
        index.save(root / "index")
        saved = time.perf_counter() - start
        start = time.perf_counter()
        index = Index.load(root / "index")
        loaded = time.perf_counter() - start
        assert index.embeddings is not None  # an exact index keeps its vectors
        results["build"] = {
            "create_s": created,
            "create_and_save_s": saved,
            "load_verify_s": loaded,
            "peak_rss_mib_before": rss_before,
            "peak_rss_mib_after": rss_mib(),
            "gallery_mib": index.embeddings.numel() * 4 / 2**20,
            "process_start_rss_mib": base_rss,
        }
        print("build", json.dumps(results["build"]), flush=True)

        flat = faiss.IndexFlatIP(args.dim)
        g_np = index.embeddings.numpy()
        flat.add(g_np)
        q_np = torch.nn.functional.normalize(queries, dim=1).numpy()

        rows: list[ExactRow] = []
        for label, q, repeats in (
            ("batch 1", None, args.singles),
            (f"batch {args.batch}", q_np, args.repeats),
        ):
            if q is None:  # single queries, one call each; median over `singles` queries
                ours_t, faiss_t = [], []
                for i in range(args.singles):
                    one = q_np[i : i + 1]
                    t0 = time.perf_counter()
                    index.search(torch.from_numpy(one), args.k)
                    ours_t.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    flat.search(one, args.k)
                    faiss_t.append(time.perf_counter() - t0)
                t_ours, t_faiss = statistics.median(ours_t), statistics.median(faiss_t)
                n_q = 1
            else:
                t_ours, _ = timed(lambda q=q: index.search(torch.from_numpy(q), args.k), repeats)
                t_faiss, _ = timed(lambda q=q, f=flat: f.search(q, args.k), repeats)
                n_q = len(q)
            row: ExactRow = {
                "queries": label,
                "ours_s": t_ours,
                "faiss_flat_s": t_faiss,
                "ours_qps": n_q / t_ours,
                "faiss_qps": n_q / t_faiss,
                "ours_over_faiss_time": t_ours / t_faiss,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        results["exact"] = rows
        ours = index.search(torch.from_numpy(q_np), args.k)
        f_sims, f_ids = flat.search(q_np, args.k)
        results["identical"] = compare(
            ours.indices.numpy(), ours.similarities.numpy(), f_ids, f_sims
        )
        print("exact neighbours vs faiss flat", json.dumps(results["identical"]), flush=True)
        del flat

        if not args.no_hnsw:
            start = time.perf_counter()
            build = f"efConstruction={args.ef_construction}" if args.ef_construction else None
            hnsw = Index.create(
                index.embeddings,
                backend="faiss",
                faiss_factory=f"HNSW{args.hnsw_m}",
                search_parameters=build,
            )
            build_hnsw = time.perf_counter() - start
            print(f"hnsw build {build_hnsw:.1f} s, rss {rss_mib() - base_rss:.0f} MiB", flush=True)
            exact_rows = {r["queries"]: r["ours_s"] for r in rows}
            hnsw_rows: list[dict[str, object]] = []
            results["hnsw"] = hnsw_rows
            for ef in [int(v) for v in args.ef_search.split(",")]:
                hnsw.set_search_parameters(f"efSearch={ef}")
                t_hnsw, approx = timed(lambda: hnsw.search(torch.from_numpy(q_np), args.k), 3)
                singles = []
                for i in range(args.singles):
                    t0 = time.perf_counter()
                    hnsw.search(torch.from_numpy(q_np[i : i + 1]), args.k)
                    singles.append(time.perf_counter() - t0)
                t_one = statistics.median(singles)
                point = {
                    "factory": f"HNSW{args.hnsw_m}",
                    "efConstruction": hnsw.faiss_index.hnsw.efConstruction,
                    "efSearch": ef,
                    "build_s": build_hnsw,
                    f"recall@{args.k}": recall_at_k(approx.indices.numpy(), ours.indices.numpy()),
                    "batch_s": t_hnsw,
                    "speedup_over_exact_batch": exact_rows[f"batch {args.batch}"] / t_hnsw,
                    "single_s": t_one,
                    "speedup_over_exact_single": exact_rows["batch 1"] / max(t_one, 1e-9),
                }
                hnsw_rows.append(point)
                print("hnsw", json.dumps(point), flush=True)

        if args.images:
            results["images"] = bench_images(args.images, root)
            print("idml index on JPEGs", json.dumps(results["images"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
