"""Retrieval metrics: golden values, pytorch-metric-learning parity, NMI, ||u||, reports, bad input."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch

from idml.embeddings import Embeddings
from idml.evaluation import (
    EvaluationSettings,
    KMeansSettings,
    evaluate_embeddings,
    faiss_search,
    nmi_score,
    per_query_metrics,
    summarize_uncertainty,
)
from idml.evaluation.clustering import faiss_available
from idml.evaluation.retrieval_metrics import (
    RankAccumulator,
    interpolated_precision,
    ranks_from_neighbors,
)
from idml.evaluation.search.kernels import KernelName
from synthetic import clustered

pytestmark = pytest.mark.numerics  # compares numbers across runs/processes/implementations

needs_faiss = pytest.mark.skipif(not faiss_available(), reason="faiss is not installed")


# ----------------------------------------------------------------------------- golden values
def test_golden_map_at_r_and_r_precision() -> None:
    # R = 3, ranked relevance [1, 0, 1, 0, 1] -> relevant at positions 1, 3, 5.
    m = per_query_metrics(torch.tensor([[1, 3, 5]]), torch.tensor([3]))
    # float64, values ≤ 1 from a handful of divisions and a sum of 3: a few ε ≈ 1e-15.
    assert m["map@r"].item() == pytest.approx((1 + 2 / 3) / 3, abs=1e-15)
    assert m["r_precision"].item() == pytest.approx(2 / 3, abs=1e-15)
    assert m["map"].item() == pytest.approx((1 + 2 / 3 + 3 / 5) / 3, abs=1e-15)
    assert m["mrr"].item() == 1.0


def test_golden_interpolated_precision_and_cutoffs() -> None:
    ranks, r = torch.tensor([[2, 3, 10]]), torch.tensor([3])
    # precision at hits: 1/2, 2/3, 3/10; suffix max: 2/3, 2/3, 3/10
    p = interpolated_precision(ranks, r, (0.0, 0.3, 1 / 3, 0.5, 0.7, 1.0))[0].tolist()
    # float64 fractions ≤ 1, one division and a max each: 1e-15 (approx's rel 1e-6 was far looser).
    assert p == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2 / 3, 3 / 10, 3 / 10], abs=1e-15)
    acc = RankAccumulator(1, (1, 2), (1, 3, 10))
    acc.add(torch.tensor([0]), ranks, r)
    curve = acc.pr_curve()
    # float64 fractions ≤ 1 (one count divided by c or R, one query): 1e-15.
    assert curve.precision_at_cutoff == pytest.approx([0.0, 2 / 3, 3 / 10], abs=1e-15)
    assert curve.recall_at_cutoff == pytest.approx([0.0, 2 / 3, 1.0], abs=1e-15)
    assert acc.means()["recall@1"] == 0.0 and acc.means()["recall@2"] == 1.0


def test_ranks_from_truncated_neighbour_lists() -> None:
    # Neighbour labels of a class-0 query with R = 3: hits at 2 and 4, the third beyond k = 4.
    ranks = ranks_from_neighbors(torch.tensor([[1, 0, 2, 0]]), torch.tensor([0]), torch.tensor([3]))
    assert ranks.tolist() == [[2, 4, 5]]
    m = per_query_metrics(ranks, torch.tensor([3]))
    # float64, one query: a division or two, 1e-15.
    assert m["r_precision"].item() == pytest.approx(1 / 3, abs=1e-15)
    assert m["map@r"].item() == pytest.approx((1 / 2) / 3, abs=1e-15)


# ----------------------------------------------------------------------------- pml parity
def _pml(query, q_labels, reference=None, r_labels=None):
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    calc = AccuracyCalculator(
        include=("precision_at_1", "r_precision", "mean_average_precision_at_r"),
        k="max_bin_count",
        device=torch.device("cpu"),
    )
    return calc.get_accuracy(query, q_labels, reference, r_labels, reference is None)


@pytest.mark.parametrize("full_ranking", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_pytorch_metric_learning_on_clustered_data(seed: int, full_ranking: bool) -> None:
    x, y = clustered(600, 40, 16, 1.3, seed)
    x[0] = x[1]  # a duplicate pair
    y[5] = 1000  # a lone query
    xn = torch.nn.functional.normalize(torch.from_numpy(x), dim=1)
    pml = _pml(xn, torch.from_numpy(y))
    settings = EvaluationSettings(
        ks=(1, 2, 4, 8), nmi=False, block_size=128, full_ranking=full_ranking
    )
    report = evaluate_embeddings(x, y, settings)
    # Same float32 neighbours (the only exact tie, the duplicate pair, shares a label), so the
    # per-query values agree; the means differ only by pml's float32 averaging of 600 values in
    # [0, 1] (~1e-7 typical; measured equal), hence 1e-6. Recall@1 is a count: float64-exact.
    assert report.metrics["recall@1"] == pytest.approx(pml["precision_at_1"], abs=1e-12)
    assert report.metrics["r_precision"] == pytest.approx(pml["r_precision"], abs=1e-6)
    assert report.metrics["map@r"] == pytest.approx(pml["mean_average_precision_at_r"], abs=1e-6)
    assert report.retrieval.num_lone_queries == 1


@pytest.mark.parametrize("full_ranking", [True, False])
def test_matches_pytorch_metric_learning_with_separate_gallery(full_ranking: bool) -> None:
    q, qy = clustered(150, 20, 12, 1.2, seed=4)
    g, gy = clustered(400, 20, 12, 1.2, seed=4)
    qn = torch.nn.functional.normalize(torch.from_numpy(q), dim=1)
    gn = torch.nn.functional.normalize(torch.from_numpy(g), dim=1)
    pml = _pml(qn, torch.from_numpy(qy), gn, torch.from_numpy(gy))
    settings = EvaluationSettings(nmi=False, block_size=64, full_ranking=full_ranking)
    report = evaluate_embeddings(g, gy, settings, query=(q, qy))
    assert not report.retrieval.same_set
    # As above: the same float32 neighbours, float64-exact counts for recall@1, and pml's float32
    # pairwise mean of 150 values in [0, 1] (≲ log2(150)·ε ≈ 9e-7 bound) for the others: 1e-6.
    assert report.metrics["recall@1"] == pytest.approx(pml["precision_at_1"], abs=1e-12)
    assert report.metrics["r_precision"] == pytest.approx(pml["r_precision"], abs=1e-6)
    assert report.metrics["map@r"] == pytest.approx(pml["mean_average_precision_at_r"], abs=1e-6)


@pytest.mark.parametrize("kernel", ["torch", "bf16"])
@pytest.mark.parametrize("same_set", [True, False])
def test_neighbour_lists_give_the_full_rankings_top_metrics(
    same_set: bool, kernel: KernelName
) -> None:
    # full_ranking=False: the exact search's lists, as deep as max(ks) and the largest class,
    # give Recall@K, R-Precision and MAP@R equal to the full ranking's (no ties in this data);
    # MAP and MRR over the whole gallery are replaced by MRR within the lists.
    x, y = clustered(1300, 60, 12, 1.4, seed=8)
    query = None if same_set else (x[:300], y[:300])
    gallery, gallery_y = (x, y) if same_set else (x[300:], y[300:])
    reports = {
        full: evaluate_embeddings(
            gallery,
            gallery_y,
            EvaluationSettings(
                ks=(1, 3, 30), nmi=False, block_size=256, score_kernel=kernel, full_ranking=full
            ),
            query=query,
        )
        for full in (True, False)
    }
    full, lists = reports[True].metrics, reports[False].metrics
    for key in ("recall@1", "recall@3", "recall@30", "r_precision", "map@r"):
        assert lists[key] == full[key], key  # the same float64 sums of the same per-query values
    assert "map" not in lists and "mrr" not in lists
    (mrr_at,) = (key for key in lists if key.startswith("mrr@"))
    assert int(mrr_at.removeprefix("mrr@")) >= 30
    assert lists[mrr_at] <= full["mrr"]
    assert reports[False].settings["knn_backend"].startswith("exact")


# ----------------------------------------------------------------------------- NMI
def test_nmi_is_reproducible_and_in_range() -> None:
    x, y = clustered(300, 8, 8, 0.8, seed=2)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for backend in ("sklearn", *(("faiss",) if faiss_available() else ())):
        a = nmi_score(xt, yt, KMeansSettings(backend, seed=3))
        assert a == nmi_score(xt, yt, KMeansSettings(backend, seed=3))
        assert 0.5 < a <= 1.0  # well-separated clusters
    noise = nmi_score(torch.randn(300, 8), yt, KMeansSettings("sklearn", seed=0))
    assert 0.0 <= noise < 0.3


@needs_faiss
def test_nmi_with_faiss_equals_pytorch_metric_learning() -> None:
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    x, y = clustered(400, 12, 8, 1.0, seed=6)
    xn = torch.nn.functional.normalize(torch.from_numpy(x), dim=1)
    calc = AccuracyCalculator(include=("NMI",), device=torch.device("cpu"))
    pml = calc.get_accuracy(xn, torch.from_numpy(y))["NMI"]
    report = evaluate_embeddings(x, y, EvaluationSettings(nmi_backend="faiss"))
    # Same faiss k-means on the same float32 input (same seed), so the same clusters; NMI from the
    # same contingency counts in float64: a reordered sum at most, ~1e-15, so 1e-12.
    assert report.nmi == pytest.approx(pml, abs=1e-12)
    sk = evaluate_embeddings(x, y, EvaluationSettings(nmi_backend="sklearn")).nmi
    assert sk == pytest.approx(pml, abs=0.1)  # another k-means, same value range


def test_knn_graph_kmeans_close_to_lloyd_and_reproducible() -> None:
    from idml.evaluation import exact_search

    x, y = clustered(500, 25, 8, 0.9, seed=12)
    xt, yt = torch.nn.functional.normalize(torch.from_numpy(x), dim=1), torch.from_numpy(y)
    graph = exact_search(xt, yt, 10).neighbors.indices
    fast = nmi_score(xt, yt, KMeansSettings("knn", seed=5), graph)
    assert fast == nmi_score(xt, yt, KMeansSettings("knn", seed=5), graph)
    lloyd = nmi_score(xt, yt, KMeansSettings("sklearn", seed=5))
    assert abs(fast - lloyd) < 0.05
    report = evaluate_embeddings(x, y, EvaluationSettings(nmi_backend="knn", seed=5))
    assert report.nmi == pytest.approx(fast, abs=1e-12)  # same neighbours, same k-means
    separate = evaluate_embeddings(
        x[100:], y[100:], EvaluationSettings(nmi_backend="knn"), query=(x[:100], y[:100])
    )
    assert separate.nmi is not None and 0.0 < separate.nmi <= 1.0
    # The graph is the search's first 10 neighbours however many lists are returned.
    for num_neighbors in (0, 1, 30):
        other = evaluate_embeddings(
            x, y, EvaluationSettings(nmi_backend="knn", seed=5, num_neighbors=num_neighbors)
        )
        assert other.nmi == report.nmi
        assert other.retrieval.neighbor_indices.shape == (500, num_neighbors)


def test_search_depth_is_num_neighbors_or_the_confidence_depth_whatever_the_nmi_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import idml.evaluation.evaluate as evaluate_module

    depths: list[int] = []
    search = evaluate_module.exact_search

    def recording(*args: object, **kwargs: object):
        depths.append(int(args[2]))  # type: ignore[call-overload]
        return search(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(evaluate_module, "exact_search", recording)
    x, y = clustered(120, 6, 8, 0.9, seed=4)
    for backend in ("knn", "sklearn"):
        for num_neighbors in (0, 3, 25):
            settings = EvaluationSettings(nmi_backend=backend, num_neighbors=num_neighbors)
            report = evaluate_embeddings(x, y, settings)
            # The confidence scores read 10 neighbours (margin@10, agreement@10, csls@10).
            assert depths.pop() == max(num_neighbors, 10)
            assert report.retrieval.neighbor_indices.shape == (120, num_neighbors)
            unscored = EvaluationSettings(
                nmi_backend=backend, num_neighbors=num_neighbors, confidence=None
            )
            evaluate_embeddings(x, y, unscored)
            assert depths.pop() == num_neighbors


def test_auto_nmi_backend_picks_by_points_times_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    from idml.evaluation import clustering

    # Below the work limit "auto" is full k-means; above it, the k-NN-graph approximation. The
    # decision depends on N × C only, so SOP (60,502 × 11,316) and CUB (5,924 × 100) land apart.
    assert clustering.resolve_backend("auto", 5_924, 100) in ("faiss", "sklearn")
    assert clustering.resolve_backend("auto", 60_502, 11_316) == "knn"
    assert clustering.resolve_backend("sklearn", 60_502, 11_316) == "sklearn"  # explicit wins
    x, y = clustered(200, 10, 8, 0.9, seed=3)
    small = evaluate_embeddings(x, y, EvaluationSettings(seed=5))
    assert small.settings["nmi_method"].startswith("full k-means")
    monkeypatch.setattr(clustering, "AUTO_FULL_KMEANS_MAX_WORK", 200 * 10 - 1)
    large = evaluate_embeddings(x, y, EvaluationSettings(seed=5))
    assert large.settings["nmi_backend"] == "knn"
    assert large.settings["nmi_method"].startswith("k-NN-graph k-means (approximation")
    assert large.nmi == evaluate_embeddings(x, y, EvaluationSettings(seed=5, nmi_backend="knn")).nmi
    assert "k-NN-graph k-means" in large.format_table()
    assert json.loads(large.to_json())["settings"]["nmi_method"] == large.settings["nmi_method"]
    assert (
        evaluate_embeddings(x, y, EvaluationSettings(nmi=False)).settings["nmi_method"] == "skipped"
    )


def test_bad_nmi_backend_fails_before_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    import idml.evaluation.evaluate as evaluate_module

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("searched before validating nmi_backend")

    monkeypatch.setattr(evaluate_module, "exact_search", no_search)
    x, y = clustered(20, 3, 4, 0.5, seed=1)
    with pytest.raises(ValueError, match="k-means backend"):
        evaluate_embeddings(x, y, EvaluationSettings(nmi_backend="bogus"))  # type: ignore[arg-type]


def test_knn_graph_kmeans_without_neighbours_is_nearest_seed() -> None:
    from idml.evaluation.clustering import knn_kmeans

    torch.manual_seed(0)
    x = torch.randn(60, 3)
    no_graph = torch.full((60, 4), -1)
    got = knn_kmeans(x, 7, no_graph, seed=9, iterations=5)
    # Independent reference: the same seeded draw, then each point to its nearest seed.
    seeds = torch.randperm(60, generator=torch.Generator().manual_seed(9))[:7]
    expected = torch.cdist(x.double(), x[seeds].double()).argmin(1)
    assert got.tolist() == expected.tolist()


def test_knn_backend_requires_neighbours() -> None:
    with pytest.raises(ValueError, match="needs neighbour lists"):
        nmi_score(torch.randn(10, 2), torch.arange(10) % 2, KMeansSettings("knn"))


# ----------------------------------------------------------------------------- uncertainty
def test_uncertainty_summary_values() -> None:
    levels = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    recall = torch.tensor([1.0, 1.0, 1.0, math.nan, 0.0, 1.0, 0.0, 0.0])
    s = summarize_uncertainty(levels, labels, quantiles=(0.0, 0.5, 1.0), recall_at_1=recall)
    assert (s.count, s.mean, s.min, s.max) == (8, 4.5, 1.0, 8.0)
    # numpy's float32 std vs our float64 one: levels 1..8 make every step exact but the final √5.25,
    # rounded to float32 there: ≤ ε/2 ≈ 6e-8 relative, inside approx's default rel 1e-6.
    assert s.std == pytest.approx(float(np.std(levels.numpy())))
    assert s.quantiles == {0.0: 1.0, 0.5: 4.5, 1.0: 8.0}
    assert s.per_class_mean == {0: 2.5, 1: 6.5}
    # NaN (lone) skipped: levels 1,2,3,5,6,7,8 -> quartiles [1,2], [3,5], [6,7], [8]
    assert s.recall_at_1_by_quartile == [1.0, 0.5, 0.5, 0.0]


def test_report_carries_uncertainty_from_embeddings() -> None:
    x, y = clustered(40, 4, 6, 0.7, seed=1)
    u = torch.rand(40, 3)
    report = evaluate_embeddings(
        Embeddings(torch.from_numpy(x), u), y, EvaluationSettings(nmi=False)
    )
    assert report.uncertainty is not None
    # The same float32 norms (same torch op); our float64 mean vs torch's float32 mean of 40 values
    # (vectorised: ≲ 8 roundings of ε/2 relative to the total, ≈ 5e-7): rel 1e-6.
    assert report.uncertainty.mean == pytest.approx(float(u.norm(dim=1).mean()), rel=1e-6)
    assert "uncertainty ||u||" in report.format_table()


# ----------------------------------------------------------------------------- report
SCORES_WITHOUT_U = ("top1", "margin@10", "agreement@5", "agreement@10", "csls@10")


def test_report_json_and_table() -> None:
    x, y = clustered(50, 5, 6, 0.8, seed=8)
    report = evaluate_embeddings(x, y, EvaluationSettings(ks=(1, 4), nmi_backend="sklearn", seed=0))
    data = json.loads(report.to_json(per_class=True))
    assert set(data["metrics"]) == {
        "recall@1",
        "recall@4",
        "r_precision",
        "map@r",
        "map",
        "mrr",
        "nmi",
        # How well each confidence score ranks right top-1 answers above wrong ones (R-AUROC),
        # their AURC and its floor, and selective R@1 of the (uncalibrated) top-1 similarity.
        *(f"{m}_{s}" for m in ("r_auroc", "aurc") for s in SCORES_WITHOUT_U),
        "aurc_oracle",
        "selective_recall@1_cov50",
        "selective_recall@1_cov80",
        "selective_recall@1_cov90",
    }
    assert data["metrics"]["recall@1"] == report.metrics["recall@1"]
    assert len(data["per_class"]) == 5
    assert data["pr_curve"]["cutoffs"][-1] == 49
    table = report.format_table(per_class=2)
    assert "recall@4" in table and "nmi" in table and "lowest recall@1" in table
    assert report.pr_curve.recall == report.retrieval.pr_curve.recall_at_cutoff


def test_neighbor_values_are_distances_for_euclidean() -> None:
    x = torch.tensor([[3.0, 0.0], [0.0, 4.0], [3.0, 1.0]])
    report = evaluate_embeddings(
        x,
        [0, 0, 1],
        EvaluationSettings(metric="euclidean", normalize=False, nmi=False, num_neighbors=2),
    )
    r = report.retrieval
    assert not r.values_are_similarities
    assert r.neighbor_indices[0].tolist() == [2, 1]
    # float32 distances between small-integer points: exact directly, a few ε via |a|²+|b|²-2a·b; rel 1e-6.
    assert r.neighbor_values[0].tolist() == pytest.approx([1.0, 5.0])


@needs_faiss
def test_faiss_backend_flat_index_gives_exact_truncated_metrics() -> None:
    x, y = clustered(200, 10, 8, 1.0, seed=3)
    exact = evaluate_embeddings(x, y, EvaluationSettings(ks=(1, 2), nmi=False))
    approx = evaluate_embeddings(
        x, y, EvaluationSettings(ks=(1, 2), nmi=False, knn_backend="faiss", faiss_index="Flat")
    )
    # A Flat index is exhaustive: the same neighbours (no float32 near-ties in this data), so the
    # metrics are float64 means of identical per-query values, equal up to a reordered sum: 1e-12.
    for key in ("recall@1", "recall@2", "r_precision", "map@r"):
        assert approx.metrics[key] == pytest.approx(exact.metrics[key], abs=1e-12)
    assert "map" not in approx.metrics and approx.retrieval.backend == "faiss:Flat"
    hnsw = faiss_search(torch.from_numpy(x), 5, index_factory="HNSW16")
    assert hnsw.indices.shape == (200, 5)
    assert not (hnsw.indices == torch.arange(200).unsqueeze(1)).any()


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"labels": [0, 1, 0]}, "labels has 3 entries but there are 4"),
        ({"ks": (1, 0)}, "ks must be positive integers"),
        ({"ks": (-2,)}, "ks must be positive integers"),
        ({"ks": ()}, "at least one K"),
        ({"labels": [5, 5, 5, 5]}, "same label"),
        ({"labels": [0.5, 1, 0, 1]}, "integer class ids"),
        ({"query": (torch.randn(2, 3), [0, 1])}, "dimension 3"),
        ({"query": (torch.randn(2, 2), [7, 8])}, "no query has a same-class reference"),
        ({"metric": "manhattan"}, "metric must be"),
        ({"num_neighbors": -1}, "num_neighbors"),
        *([({"device": "cuda"}, "CUDA is not available")] if not torch.cuda.is_available() else []),
    ],
)
def test_bad_input_raises_clear_errors(kwargs: dict, match: str) -> None:
    # Any: the cases deliberately give values of the wrong type or range.
    args: dict[str, Any] = {"embeddings": torch.randn(4, 2), "labels": [0, 1, 0, 1], "nmi": False}
    args.update(kwargs)
    fields = set(EvaluationSettings.__dataclass_fields__)
    with pytest.raises(ValueError, match=match):
        settings = EvaluationSettings(**{k: v for k, v in args.items() if k in fields})
        evaluate_embeddings(settings=settings, **{k: v for k, v in args.items() if k not in fields})


def test_pair_scorer_kinds_and_their_orientation() -> None:
    from idml.evaluation.scoring import PairScorer
    from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric

    # Names are case-insensitive at run time (a YAML config may write them either way).
    cosine: Any = "Cosine"
    euclidean: Any = "EUCLIDEAN"
    assert PairScorer.from_spec(cosine).kind == "cosine"
    assert PairScorer.from_spec("cosine").is_similarity
    assert not PairScorer.from_spec(euclidean).is_similarity
    ism = PairScorer.from_spec(IntrospectiveMetric(CosineSimilarity()))
    assert ism.kind == "metric" and ism.is_similarity
    assert not PairScorer.from_spec(IntrospectiveMetric(EuclideanDistance())).is_similarity
    with pytest.raises(ValueError, match="a metric exactly when kind is 'metric'"):
        PairScorer("metric", True)
    with pytest.raises(ValueError, match="a metric exactly when kind is 'metric'"):
        PairScorer("cosine", True, metric=CosineSimilarity())


def test_nan_rows_are_named() -> None:
    x = torch.randn(5, 3)
    x[2, 1] = math.nan
    with pytest.raises(ValueError, match=r"embeddings contains NaN or inf \(rows \[2\]"):
        evaluate_embeddings(x, [0, 0, 1, 1, 1], EvaluationSettings(nmi=False))


def test_ism_without_uncertainty_is_rejected() -> None:
    from idml.metrics import CosineSimilarity, IntrospectiveMetric

    with pytest.raises(ValueError, match="needs uncertainty embeddings"):
        evaluate_embeddings(
            torch.randn(4, 2),
            [0, 1, 0, 1],
            EvaluationSettings(nmi=False),
            introspective_metric=IntrospectiveMetric(CosineSimilarity()),
        )
