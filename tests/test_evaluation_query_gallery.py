"""Query/gallery roles (open-metric-learning's retrieval format): the blocked search of the queries
against the gallery only, against a brute-force reference, and through embedding files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from idml.evaluation import EvaluationSettings, evaluate_embeddings, evaluate_files
from synthetic import clustered

pytestmark = pytest.mark.numerics


def _brute_force(x: np.ndarray, labels: np.ndarray, roles: np.ndarray, ks: tuple[int, ...]):
    """Every metric from the dense Q × G cosine matrix in float64, one query at a time."""
    unit = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    queries, gallery = np.flatnonzero(roles == "query"), np.flatnonzero(roles == "gallery")
    per_query: dict[str, list[float]] = {
        **{f"recall@{k}": [] for k in ks},
        "r_precision": [],
        "map@r": [],
        "map": [],
        "mrr": [],
    }
    top1 = []
    for q in queries:
        scores = unit[gallery] @ unit[q]
        # Ties (none expected in random floats) would put relevant items last: sort by score only.
        order = np.argsort(-scores, kind="stable")
        relevant = labels[gallery][order] == labels[q]
        top1.append(gallery[order[0]])
        r = int(relevant.sum())
        if r == 0:
            continue  # a lone query: excluded from the metrics
        hits = np.flatnonzero(relevant) + 1  # 1-based ranks of the relevant items
        precision_at_hits = np.arange(1, r + 1) / hits
        for k in ks:
            per_query[f"recall@{k}"].append(float(hits[0] <= k))
        per_query["r_precision"].append(float((hits <= r).sum()) / r)
        per_query["map@r"].append(float(precision_at_hits[hits <= r].sum()) / r)
        per_query["map"].append(float(precision_at_hits.mean()))
        per_query["mrr"].append(1.0 / hits[0])
    return {k: float(np.mean(v)) for k, v in per_query.items()}, np.array(top1), queries, gallery


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_query_gallery_metrics_match_brute_force(seed: int) -> None:
    x, labels = clustered(173, 9, 12, 1.5, seed=seed)
    rng = np.random.default_rng(seed)
    roles = rng.choice(np.array(["query", "gallery", ""], dtype=object), 173, p=[0.3, 0.6, 0.1])
    ks = (1, 2, 4, 8)
    # A block of 16 puts the 52-odd queries and 100-odd gallery items over several tiles.
    settings = EvaluationSettings(ks=ks, nmi=False, block_size=16)
    report = evaluate_embeddings(x, labels, settings, roles=roles)
    expected, top1, queries, gallery = _brute_force(x, labels, roles, ks)
    r = report.retrieval
    assert (r.num_queries, r.num_references, r.same_set) == (len(queries), len(gallery), False)
    assert r.query_rows is not None  # a query/gallery split lists its query rows
    assert r.query_rows.tolist() == queries.tolist()
    # Neighbours are rows of the embeddings given, all gallery rows, the nearest one first.
    assert r.neighbor_indices[:, 0].tolist() == top1.tolist()
    assert set(r.neighbor_indices.flatten().tolist()) <= set(gallery.tolist())
    for name, value in expected.items():
        # float64 means of per-query fractions from float32 scores vs float64 ones: the ranks are
        # identical (no near-ties in this data), so only the summation order differs: 1e-12.
        assert report.metrics[name] == pytest.approx(value, abs=1e-12), name


def test_roles_equal_a_separate_query_set() -> None:
    x, labels = clustered(60, 4, 8, 1.0, seed=5)
    roles = np.array(["query" if i % 3 == 0 else "gallery" for i in range(60)], dtype=object)
    q, g = roles == "query", roles == "gallery"
    settings = EvaluationSettings(ks=(1, 2), nmi=False)
    by_roles = evaluate_embeddings(x, labels, settings, roles=roles)
    separate = evaluate_embeddings(x[g], labels[g], settings, query=(x[q], labels[q]))
    assert by_roles.metrics == separate.metrics


def test_roles_are_checked() -> None:
    x, labels = clustered(10, 2, 4, 1.0, seed=0)
    with pytest.raises(ValueError, match="roles mark no query row"):
        evaluate_embeddings(x, labels, roles=["gallery"] * 10)
    with pytest.raises(ValueError, match=r"roles must be 'query', 'gallery' or '', got \['both'\]"):
        evaluate_embeddings(x, labels, roles=["both"] * 10)
    with pytest.raises(ValueError, match="roles has 3 entries but there are 10"):
        evaluate_embeddings(x, labels, roles=["query", "gallery", "query"])
    with pytest.raises(ValueError, match="either roles or a separate query set"):
        evaluate_embeddings(x, labels, roles=["query"] * 5 + ["gallery"] * 5, query=(x, labels))


def test_an_embedding_file_with_roles_is_evaluated_by_them(tmp_path: Path) -> None:
    x, labels = clustered(40, 3, 6, 1.0, seed=2)
    roles = np.array(["query" if i < 10 else "gallery" for i in range(40)])
    path = tmp_path / "emb.npz"
    np.savez(path, embeddings=x, labels=labels, roles=roles)
    settings = EvaluationSettings(ks=(1,), nmi=False)
    report = evaluate_files(path, settings=settings)
    expected = evaluate_embeddings(x, labels, settings, roles=roles)
    assert report.metrics == expected.metrics and report.retrieval.num_queries == 10
    torch.save({"embeddings": torch.from_numpy(x), "roles": ["query"] * 39}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"'roles' has 39 entries but there are 40 embeddings"):
        evaluate_files(tmp_path / "bad.pt", tmp_path / "emb.npz", settings=settings)
