"""Evaluation at Stanford-Online-Products scale: idml vs pytorch-metric-learning, same process.

Data: 60,502 × 512 synthetic clustered embeddings with SOP's shape — 11,316 classes of 2–12
images (≈5.35 per class) — class centres plus Gaussian noise, L2-normalised, noise chosen so the
metrics are in a realistic range (R@1 ≈ 0.8, MAP@R ≈ 0.5).

Timed, in this order, in one process:

1. ``floor``: one fp32 pass of the full query × reference similarity product in 2048 × 2048 tiles
   (what computing every score once costs; idml's symmetric search computes each score once for
   *two* queries, so it can run below this floor);
2. ``idml``: :func:`idml.evaluation.evaluate_embeddings` (exact; Recall@K, R-Precision, MAP@R and
   also full MAP, MRR and PR curves, and the confidence assessment), without NMI; then the same
   with pml's metrics only (``ks=(1,)``, ``full_ranking=False``: R@1, R-Precision and MAP@R from
   the exact search's neighbour lists, no confidence assessment);
3. ``pml``: ``AccuracyCalculator(k="max_bin_count", include=(precision_at_1, r_precision,
   mean_average_precision_at_r))`` with its default faiss-cpu kNN;
4. with ``--nmi``: NMI. pml and idml's ``backend="faiss"`` run the same faiss k-means (20
   iterations, seed 1234; faiss stops early once the objective stalls), so their values must be
   equal; idml's ``backend="knn"`` (k-NN-graph k-means on the search's neighbour lists) is the fast
   alternative. Totals "retrieval + NMI" are printed for both idml variants.

With ``--pml-default``: pml's ``AccuracyCalculator(k="max_bin_count")`` with its default metric set
(everything, including NMI and AMI) against idml's default ``evaluate_embeddings`` (every metric;
NMI by the k-means ``"auto"`` picks, at SOP's size the k-NN-graph one). ``--defaults-only`` times
just the floor and these two defaults.

Peak memory of each phase is sampled from ``/proc/self/statm`` (resident set above the level
before the phase). Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_evaluation.py --nmi --pml-default   # recorded run
    OMP_NUM_THREADS=2 python benchmarks/bench_evaluation.py --defaults-only       # the two defaults
    python benchmarks/bench_evaluation.py --n 6000 --classes 1130      # a quick one
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def sop_like(
    n: int, classes: int, dim: int, noise: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` L2-normalised embeddings in ``classes`` classes of 2–12 images (SOP's range)."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(2 + rng.poisson(max(n / classes - 2, 0.0), classes), 12)
    # Adjust sizes one image at a time until they add up to n, staying within 2..12.
    order = rng.permutation(classes)
    i, diff = 0, n - int(sizes.sum())
    while diff != 0:
        c = order[i % classes]
        i += 1
        if diff > 0 and sizes[c] < 12:
            sizes[c] += 1
            diff -= 1
        elif diff < 0 and sizes[c] > 2:
            sizes[c] -= 1
            diff += 1
    labels = rng.permutation(np.repeat(np.arange(classes), sizes))
    centers = rng.standard_normal((classes, dim), dtype=np.float32)
    x = centers[labels] + noise * rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, labels


class PeakRSS:
    """Samples the resident set size in a thread; ``peak`` is the maximum above the start."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()

    def _rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self.page

    def __enter__(self) -> PeakRSS:
        self.start = self._rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.start)
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss() - self.start)


def timed(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    with PeakRSS() as mem:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
    return result, seconds, mem.peak


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def floor_product(x: torch.Tensor, block: int) -> float:
    """One fp32 pass of ``x @ x.T`` in ``block × block`` tiles (each reduced by a max so the work
    cannot be skipped); cache-sized tiles are the fastest way to compute every score once."""
    total = 0.0
    for i in range(0, len(x), block):
        for j in range(0, len(x), block):
            total += float((x[i : i + block] @ x[j : j + block].T).amax())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=60_502)
    parser.add_argument("--classes", type=int, default=11_316)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument(
        "--noise", type=float, default=2.1, help="per-dimension noise / centre scale"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ks", default="1,10,100,1000", help="K of Recall@K (SOP convention)")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=("auto", "torch", "openblas", "faiss", "bf16"),
        help="score products of the exact search (default: measured on this machine)",
    )
    parser.add_argument(
        "--no-pml", action="store_true", help="skip the pytorch-metric-learning run"
    )
    parser.add_argument("--nmi", action="store_true", help="also time NMI (k-means) of both")
    parser.add_argument(
        "--pml-default",
        action="store_true",
        help="also time pml's AccuracyCalculator(k='max_bin_count') with its default metric set "
        "(adds NMI and AMI, MAP and MRR within k) against idml's default evaluate_embeddings "
        "(every metric; NMI by the automatically chosen k-means)",
    )
    parser.add_argument(
        "--defaults-only",
        action="store_true",
        help="only the floor and the two defaults (pml's and idml's): implies --pml-default",
    )
    args = parser.parse_args()
    if args.defaults_only:
        args.pml_default, args.no_pml, args.nmi = True, True, False

    from idml.evaluation import EvaluationSettings, evaluate_embeddings

    threads = torch.get_num_threads()
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, torch threads {threads}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    x_np, y_np = sop_like(args.n, args.classes, args.dim, args.noise, args.seed)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    ks = tuple(int(k) for k in args.ks.split(","))
    counts = np.bincount(y_np)
    print(
        f"data: {args.n:,} × {args.dim}, {args.classes:,} classes, "
        f"{counts.mean():.2f} images per class (min {counts.min()}, max {counts.max()})"
    )

    rows: list[tuple[str, float, int, str]] = []  # (what, seconds, peak bytes, note)
    _, floor_s, floor_mem = timed(lambda: floor_product(x, 2048))
    rows.append(("floor: one fp32 pass of x·xᵀ (2048² tiles)", floor_s, floor_mem, ""))
    print(
        f"floor (one fp32 x @ x.T, 2048² tiles):       {floor_s:8.1f} s  "
        f"(peak +{floor_mem / 2**30:.2f} GiB)"
    )

    if not args.defaults_only:
        report, ours_s, ours_mem = timed(
            lambda: evaluate_embeddings(
                x,
                y,
                EvaluationSettings(
                    ks=ks, nmi=False, block_size=args.block_size, score_kernel=args.kernel
                ),
            )
        )
        ours = report.metrics
        print(f"score kernels: {report.settings['score_kernels']}")
        rows.append(("idml evaluate_embeddings, retrieval metrics", ours_s, ours_mem, ""))
        print(
            f"idml evaluate_embeddings:                     {ours_s:8.1f} s  "
            f"(peak +{ours_mem / 2**30:.2f} GiB)"
        )
        print("  " + ", ".join(f"{k} {v:.6f}" for k, v in ours.items()))
        # pml's metric set alone: Recall@1 (= P@1), R-Precision and MAP@R from the exact
        # search's neighbour lists (no ranking of the whole gallery, no confidence assessment).
        shared_report, same_s, same_mem = timed(
            lambda: evaluate_embeddings(
                x,
                y,
                EvaluationSettings(
                    ks=(1,),
                    nmi=False,
                    block_size=args.block_size,
                    score_kernel=args.kernel,
                    full_ranking=False,
                    confidence=None,
                ),
            )
        )
        same = shared_report.metrics
        rows.append(
            ("idml, pml's metrics only (full_ranking=False, no confidence)", same_s, same_mem, "")
        )
        print(
            f"idml, pml's metrics only (neighbour lists):   {same_s:8.1f} s  "
            f"(peak +{same_mem / 2**30:.2f} GiB)"
        )
        print("  " + ", ".join(f"{k} {v:.6f}" for k, v in same.items()))

    if not args.no_pml:
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        calc = AccuracyCalculator(
            include=("precision_at_1", "r_precision", "mean_average_precision_at_r"),
            k="max_bin_count",
            device=torch.device("cpu"),
        )
        pml, pml_s, pml_mem = timed(lambda: calc.get_accuracy(x, y))
        print(
            f"pml AccuracyCalculator (faiss-cpu):           {pml_s:8.1f} s  "
            f"(peak +{pml_mem / 2**30:.2f} GiB)"
        )
        print("  " + ", ".join(f"{k} {v:.6f}" for k, v in pml.items()))
        pairs = {
            "precision_at_1": "recall@1",
            "r_precision": "r_precision",
            "mean_average_precision_at_r": "map@r",
        }
        worst = max(abs(pml[a] - ours[b]) for a, b in pairs.items())
        worst_same = max(abs(pml[a] - same[b]) for a, b in pairs.items())
        rows.append(
            (
                "pml AccuracyCalculator(k='max_bin_count', include=P@1, RP, MAP@R) + faiss-cpu",
                pml_s,
                pml_mem,
                f"idml every metric {pml_s / ours_s:.2f}x faster, pml's metrics only "
                f"{pml_s / same_s:.2f}x; max |Δ| {max(worst, worst_same):.1e}",
            )
        )
        print(
            f"speed-up idml vs pml: every metric {pml_s / ours_s:.2f}x, pml's metrics only "
            f"{pml_s / same_s:.2f}x; idml vs floor: {ours_s / floor_s:.2f}x and "
            f"{same_s / floor_s:.2f}x; max |Δ| of shared metrics: {worst:.2e} and {worst_same:.2e}"
        )

    if args.nmi:
        from pytorch_metric_learning.utils.inference import FaissKMeans
        from sklearn.metrics import normalized_mutual_info_score

        from idml.evaluation import KMeansSettings, nmi_score

        graph = report.retrieval.neighbor_indices
        exact_nmi, exact_s, exact_mem = timed(lambda: nmi_score(x, y, KMeansSettings("faiss")))
        fast_nmi, fast_s, fast_mem = timed(lambda: nmi_score(x, y, KMeansSettings("knn"), graph))
        clusters, pml_nmi_s, pml_nmi_mem = timed(
            lambda: FaissKMeans(niter=20, gpu=False)(x, int(counts.size))
        )
        pml_nmi = normalized_mutual_info_score(y_np, clusters.numpy())
        rows.append(
            ("NMI: pml's faiss k-means (20 rounds)", pml_nmi_s, pml_nmi_mem, f"NMI {pml_nmi:.6f}")
        )
        rows.append(("NMI: idml backend='faiss'", exact_s, exact_mem, f"NMI {exact_nmi:.6f}"))
        rows.append(
            (
                "NMI: idml backend='knn' (k-NN-graph k-means)",
                fast_s,
                fast_mem,
                f"NMI {fast_nmi:.6f}",
            )
        )
        print(f"NMI pml (faiss k-means):         {pml_nmi:.6f} in {pml_nmi_s:6.1f} s")
        print(f"NMI idml backend='faiss':        {exact_nmi:.6f} in {exact_s:6.1f} s")
        print(
            f"NMI idml backend='knn' (k-NN graph k-means): {fast_nmi:.6f} in {fast_s:6.1f} s "
            f"(peak +{fast_mem / 2**30:.2f} GiB)"
        )
        if not args.no_pml:
            pml_total = pml_s + pml_nmi_s
            print(
                f"retrieval + NMI: pml {pml_total:.1f} s; idml with faiss NMI "
                f"{ours_s + exact_s:.1f} s ({pml_total / (ours_s + exact_s):.2f}x); "
                f"idml with knn NMI {ours_s + fast_s:.1f} s "
                f"({pml_total / (ours_s + fast_s):.2f}x)"
            )
    if args.pml_default:
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        # idml's defaults, as `idml evaluate` runs them: NMI's k-means is chosen by size. Timed
        # and printed first, so a pml run cut short by a time limit still leaves idml's line.
        ours_all, ours_all_s, ours_all_mem = timed(
            lambda: evaluate_embeddings(
                x,
                y,
                EvaluationSettings(ks=ks, block_size=args.block_size, score_kernel=args.kernel),
            )
        )
        print(f"score kernels: {ours_all.settings['score_kernels']}")
        print(
            f"idml default, every metric + NMI:             {ours_all_s:8.1f} s  "
            f"(peak +{ours_all_mem / 2**30:.2f} GiB); NMI: {ours_all.settings['nmi_method']}",
            flush=True,
        )
        print("  " + ", ".join(f"{k} {v:.6f}" for k, v in ours_all.metrics.items()), flush=True)
        full = AccuracyCalculator(k="max_bin_count", device=torch.device("cpu"))
        pml_all, pml_all_s, pml_all_mem = timed(lambda: full.get_accuracy(x, y))
        print(
            f"pml default AccuracyCalculator (all metrics): {pml_all_s:8.1f} s  "
            f"(peak +{pml_all_mem / 2**30:.2f} GiB)"
        )
        print("  " + ", ".join(f"{k} {v:.6f}" for k, v in pml_all.items()))
        print(
            f"speed-up idml vs pml default: {pml_all_s / ours_all_s:.2f}x "
            f"(pml default = {pml_all_s / floor_s:.2f} floors)"
        )
        shared = {
            "precision_at_1": "recall@1",
            "r_precision": "r_precision",
            "mean_average_precision_at_r": "map@r",
        }
        worst_all = max(abs(pml_all[a] - ours_all.metrics[b]) for a, b in shared.items())
        rows.append(
            (
                "pml AccuracyCalculator(k='max_bin_count'), default metric set (adds NMI, AMI, "
                "MAP, MRR)",
                pml_all_s,
                pml_all_mem,
                "",
            )
        )
        rows.append(
            (
                "idml evaluate_embeddings default, every metric + NMI "
                f"({ours_all.settings['nmi_method']})",
                ours_all_s,
                ours_all_mem,
                f"{pml_all_s / ours_all_s:.2f}x faster than pml default; max |Δ| {worst_all:.1e}",
            )
        )
    print(f"load average at the end: {os.getloadavg()[0]:.2f}\n")
    print("| phase | time | vs floor | peak memory above start | note |")
    print("| --- | --- | --- | --- | --- |")
    for what, seconds, peak, note in rows:
        print(
            f"| {what} | {seconds:.1f} s | {seconds / floor_s:.2f}× | +{peak / 2**30:.2f} GiB "
            f"| {note} |"
        )


if __name__ == "__main__":
    main()
