"""``idml evaluate`` on embedding files of every supported format."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from idml.app.cli import main
from idml.evaluation import EvaluationSettings, evaluate_embeddings


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(6), 5)
    centers = rng.standard_normal((6, 8))
    x = (centers[labels] + 0.8 * rng.standard_normal((30, 8))).astype(np.float32)
    u = rng.random((30, 4)).astype(np.float32)
    return x, labels, u


def _write(path: Path, fmt: str, entries: dict[str, np.ndarray]) -> Path:
    if fmt == "npz":
        # To mypy a **dict could also fill savez's `allow_pickle: bool`; these keys only name
        # arrays (and naming allow_pickle would store it as an array on numpy < 2.1).
        arrays: dict[str, Any] = entries
        np.savez(path, **arrays)
    elif fmt == "pt":
        torch.save({k: torch.from_numpy(v) for k, v in entries.items()}, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in entries.items()}, path)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("fmt", ["npz", "pt", "safetensors"])
def test_keyed_files_json(fmt: str, tmp_path: Path, data, capsys) -> None:
    x, labels, u = data
    path = _write(tmp_path / f"emb.{fmt}", fmt, {"semantic": x, "uncertainty": u, "labels": labels})
    code, out, _ = _run(capsys, "evaluate", "--embeddings", str(path), "--ks", "1,2,4", "--json")
    assert code == 0
    result = json.loads(out)
    expected = evaluate_embeddings(
        x, labels, EvaluationSettings(ks=(1, 2, 4)), uncertainty=u
    ).metrics
    # The CLI computes the same float64 means of per-query fractions from the same float32 data (the
    # file round trip and JSON's repr are lossless): equal up to a reordered sum, ~1e-16; 1e-12.
    assert result["metrics"] == pytest.approx(expected, abs=1e-12)
    # float32 norms of 4 entries (≤ 2ε apart between torch and numpy), then numpy's float32 mean of
    # 30 vs the library's float64 mean (≤ ~7ε): ≤ ~10ε ≈ 1.2e-6 relative, so rel 2e-6.
    assert result["uncertainty"]["mean"] == pytest.approx(
        float(np.linalg.norm(u, axis=1).mean()), rel=2e-6
    )


def test_npy_embeddings_and_labels_table(tmp_path: Path, data, capsys) -> None:
    x, labels, _ = data
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", labels)
    code, out, _ = _run(
        capsys,
        "evaluate",
        "--embeddings",
        str(tmp_path / "x.npy"),
        "--labels",
        str(tmp_path / "y.npy"),
        "--no-nmi",
        "--per-class",
        "2",
    )
    assert code == 0
    expected = evaluate_embeddings(x, labels, EvaluationSettings(nmi=False)).metrics
    assert "30 queries against themselves" in out
    assert re.search(rf"recall@1 +{expected['recall@1']:.4f}\n", out)
    # NMI is not computed, and the table says so rather than leaving the reader to guess.
    assert "map@r" in out and re.search(r"\nnmi +skipped\n", out)
    assert "lowest recall@1" in out


def test_per_class_results_are_keyed_by_the_files_class_names(tmp_path: Path, data, capsys) -> None:
    """A file that names its classes (``classes``, as ``idml embed`` writes) keys the per-class
    results by name and says so; a file without names keys them by label, and says that."""
    x, labels, _ = data
    names = np.array(["ant", "bee", "cat", "dog", "eel", "fox"])
    named = _write(
        tmp_path / "named.npz", "npz", {"embeddings": x, "labels": labels, "classes": names}
    )
    plain = _write(tmp_path / "plain.npz", "npz", {"embeddings": x, "labels": labels})
    expected = evaluate_embeddings(x, labels, EvaluationSettings(nmi=False)).retrieval.per_class
    args = ["--no-nmi", "--per-class", "2"]
    code, out, _ = _run(capsys, "evaluate", "--embeddings", str(named), *args, "--json")
    result = json.loads(out)
    assert code == 0 and result["per_class_keys"] == "class names"
    # The same computation on the same float32 data: the same float64 means, bit for bit.
    assert result["per_class"] == {str(names[c]): row for c, row in expected.items()}
    code, out, _ = _run(capsys, "evaluate", "--embeddings", str(plain), *args, "--json")
    result = json.loads(out)
    assert result["per_class_keys"] == "labels" and set(result["per_class"]) == set("012345")
    # The table: the worst two classes by name (the lowest R@1; ties by label).
    worst = sorted(expected, key=lambda c: (expected[c]["recall@1"], c))[:2]
    code, out, _ = _run(capsys, "evaluate", "--embeddings", str(named), *args)
    lines = out.split("classes with the lowest recall@1 (by class name):\n")[1].splitlines()
    assert [line.split(":")[0].strip() for line in lines[:2]] == [names[c] for c in worst]
    # A separate labels file numbers the classes its own way: the file's names do not apply.
    np.save(tmp_path / "y.npy", labels)
    code, out, _ = _run(
        capsys, "evaluate", "--embeddings", str(named), "--labels", str(tmp_path / "y.npy"),
        *args, "--json",
    )  # fmt: skip
    assert json.loads(out)["per_class_keys"] == "labels"


def test_separate_query_set_and_euclidean(tmp_path: Path, data, capsys) -> None:
    x, labels, _ = data
    q = np.arange(30) % 5 == 0  # one query per class, the rest is the gallery
    _write(tmp_path / "g.npz", "npz", {"embeddings": x[~q], "labels": labels[~q]})
    _write(tmp_path / "q.npz", "npz", {"embeddings": x[q], "labels": labels[q]})
    code, out, _ = _run(
        capsys,
        "evaluate",
        "--embeddings",
        str(tmp_path / "g.npz"),
        "--query-embeddings",
        str(tmp_path / "q.npz"),
        "--metric",
        "euclidean",
        "--no-nmi",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    expected = evaluate_embeddings(
        x[~q],
        labels[~q],
        EvaluationSettings(metric="euclidean", nmi=False),
        query=(x[q], labels[q]),
    ).metrics
    # Same float64 computation from the same float32 data (lossless file and JSON round trips): 1e-12.
    assert result["metrics"] == pytest.approx(expected, abs=1e-12)
    assert result["num_queries"] == 6 and result["same_set"] is False


def test_introspective_ranking_flag(tmp_path: Path, data, capsys) -> None:
    x, labels, u = data
    path = _write(tmp_path / "e.npz", "npz", {"semantic": x, "uncertainty": u, "labels": labels})
    code, out, _ = _run(
        capsys,
        "evaluate",
        "--embeddings",
        str(path),
        "--introspective",
        "--gamma",
        "0.5",
        "--no-nmi",
        "--json",
    )
    assert code == 0
    assert json.loads(out)["metric"].startswith("introspective(CosineSimilarity")


def test_missing_key_lists_the_keys_found(tmp_path: Path, data, capsys) -> None:
    x, labels, _ = data
    path = _write(tmp_path / "e.npz", "npz", {"feats": x, "labels": labels})
    code, _, err = _run(capsys, "evaluate", "--embeddings", str(path))
    assert code == 2
    assert "no embeddings entry" in err and "'feats' (30, 8)" in err and "'labels' (30,)" in err
    code, out, _ = _run(
        capsys, "evaluate", "--embeddings", str(path), "--embeddings-key", "feats", "--no-nmi"
    )
    assert code == 0 and "recall@1" in out


def test_missing_labels_and_files_are_clear_errors(tmp_path: Path, data, capsys) -> None:
    x, _, _ = data
    np.save(tmp_path / "x.npy", x)
    code, _, err = _run(capsys, "evaluate", "--embeddings", str(tmp_path / "x.npy"))
    assert code == 2 and "no labels entry" in err
    code, _, err = _run(capsys, "evaluate", "--embeddings", str(tmp_path / "nope.npz"))
    assert code == 2 and "no such file" in err
    code, _, err = _run(capsys, "evaluate")
    assert code == 2 and "--embeddings" in err
    (tmp_path / "x.csv").write_text("1,2\n")
    code, _, err = _run(capsys, "evaluate", "--embeddings", str(tmp_path / "x.csv"))
    assert code == 2 and "unsupported file type" in err


def test_non_finite_values_in_a_file_name_the_file_and_rows(tmp_path: Path, data, capsys) -> None:
    x, labels, _ = data
    broken = x.copy()
    broken[[3, 7]] = np.nan
    path = _write(tmp_path / "e.npz", "npz", {"embeddings": broken, "labels": labels})
    code, _, err = _run(capsys, "evaluate", "--embeddings", str(path))
    assert (
        code == 2 and f"{path}: 'embeddings' holds NaN or inf in 2 rows (the first: [3, 7])" in err
    )
    levels = np.ones(len(x), np.float32)
    levels[5] = np.inf
    path = _write(
        tmp_path / "u.npz", "npz", {"embeddings": x, "uncertainty": levels, "labels": labels}
    )
    code, _, err = _run(capsys, "evaluate", "--embeddings", str(path))
    assert code == 2 and f"{path}: 'uncertainty' holds NaN or inf in 1 row (the first: [5])" in err


def test_bad_ks_is_rejected_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["evaluate", "--embeddings", "x.npy", "--ks", "1,two"])
    assert "expected integers" in capsys.readouterr().err


def test_fast_nmi_backend_flag(tmp_path: Path, data, capsys) -> None:
    x, labels, _ = data
    path = _write(tmp_path / "e.npz", "npz", {"embeddings": x, "labels": labels})
    code, out, _ = _run(
        capsys, "evaluate", "--embeddings", str(path), "--nmi-backend", "knn", "--json"
    )
    assert code == 0
    result = json.loads(out)
    assert result["settings"]["nmi_backend"] == "knn"
    # Same k-NN NMI on the same float32 data through the CLI: a reordered float64 sum at most, 1e-12.
    assert result["metrics"]["nmi"] == pytest.approx(
        evaluate_embeddings(x, labels, EvaluationSettings(nmi_backend="knn")).nmi, abs=1e-12
    )


def test_no_full_ranking_flag_gives_the_lists_metrics(tmp_path: Path, data, capsys) -> None:
    x, labels, _ = data
    path = _write(tmp_path / "e.npz", "npz", {"embeddings": x, "labels": labels})
    argv = ["evaluate", "--embeddings", str(path), "--no-nmi", "--ks", "1,2", "--json"]
    full = json.loads(_run(capsys, *argv)[1])
    code, out, _ = _run(capsys, *argv, "--no-full-ranking")
    assert code == 0
    lists = json.loads(out)
    assert lists["settings"]["full_ranking"] is False
    assert "map" not in lists["metrics"] and "mrr@10" in lists["metrics"]
    # The same per-query values from the lists as from the full ranking (no ties here): equal.
    for key in ("recall@1", "recall@2", "r_precision", "map@r"):
        assert lists["metrics"][key] == full["metrics"][key], key


def test_a_baseline_embedding_file_has_no_uncertainty_rows(tmp_path: Path, data, capsys) -> None:
    """``idml embed`` of a model without an uncertainty head writes ``||u||`` = 0 for every image:
    the report must not summarise that constant (quartiles of nothing, an AUROC of 0.5)."""
    x, labels, u = data
    levels = np.linalg.norm(u, axis=1).astype(np.float32)
    baseline = _write(tmp_path / "baseline.npz", "npz", {
        "embeddings": x, "uncertainty": np.zeros(len(x), np.float32), "labels": labels,
    })  # fmt: skip
    idml = _write(tmp_path / "idml.npz", "npz", {
        "embeddings": x, "uncertainty": levels, "labels": labels,
    })  # fmt: skip
    code, out, _ = _run(capsys, "evaluate", "--embeddings", str(baseline))
    assert code == 0
    assert "||u||" not in out and "r_auroc_norm_u" not in out and "aurc_norm_u" not in out
    assert "r_auroc_top1" in out  # the uncertainty-free confidence score stays
    code, out, _ = _run(capsys, "evaluate", "--embeddings", str(idml), "--json")
    report = json.loads(out)
    assert "r_auroc_norm_u" in report["metrics"] and "uncertainty" in report
    code, out, _ = _run(capsys, "evaluate", "--embeddings", str(baseline), "--json")
    report = json.loads(out)
    assert "r_auroc_norm_u" not in report["metrics"] and "uncertainty" not in report


def test_the_nmi_method_stands_on_the_nmi_row(tmp_path: Path, data, capsys) -> None:
    x, labels, _ = data
    path = _write(tmp_path / "e.npz", "npz", {"embeddings": x, "labels": labels})
    code, out, _ = _run(capsys, "evaluate", "--embeddings", str(path))
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "k-means" in rows["nmi"]
    assert "k-means" not in rows["aurc_oracle"] and rows["aurc_oracle"].split()[1:] == [
        rows["aurc_oracle"].split()[1]
    ]
