"""Data-parallel training: 2 gloo CPU processes against 1 process, sharded sampling and evaluation.

The multi-process tests start ``tests/distributed_worker.py`` twice (ranks 0 and 1 of a gloo group
joined through a ``file://`` rendezvous) and once alone, then compare what they wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from idml.app import build
from idml.app.config import load_config
from idml.app.distributed import (
    DistributedContext,
    ShardPlan,
    contiguous_shard,
    derived_seed,
    init_distributed,
    merge_rows,
    rank_generator,
    rank_seed,
)
from idml.augment import Mixup, MixupMode
from idml.data import build_batch_sampler
from idml.relations import PAD
from tiny_run import IDML, TINY, subprocess_env

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "distributed_worker.py"
# Cases whose random draws depend on the shard layout are compared with one process computing the
# same 2 shards; ProxyAnchor + ISM draws nothing, so it is compared with the plain 1-process run.
REFERENCE_CASES = (
    "ms_ism_mixup:2,pa_ism:1,ssr_joint:2,ssr_alternating:2,interpolate:2,warmup:2,"
    "classification_cutmix:2"
)
TRAINING_CASES = [
    "ms_ism_mixup",
    "pa_ism",
    "ssr_joint",
    "ssr_alternating",
    "interpolate",
    "warmup",
    "classification_cutmix",
]
# Everything runs in float64 (ε ≈ 2.2e-16); two ranks sum the batch's losses and gradients in another
# order than one process, so each value differs by ~(number of terms)·ε·|terms|. Losses are sums of
# O(10²) terms of O(1): ~1e-14, LOSS_TOLERANCE 1e-9 leaves a wide margin yet is far below what a
# wrong shard weighting (a factor 2) or a missing pair changes. Gradients: O(1e-3..1) entries summed
# over ~10⁴ products through the network, ~1e-12, GRADIENT_TOLERANCE 1e-8. Weights after 3 Adam
# steps: Adam divides by √v + 1e-8, so a gradient near zero turns its 1e-12 difference into up to
# lr·1e-12/1e-8 = 1e-7 per step at lr 1e-3 (tiny_run), ~3e-7 in all; WEIGHT_TOLERANCE 1e-5 leaves
# 30× for gradients that differ by more than 1e-12, still ≪ the > 1e-4 the weights move.
WEIGHT_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-8
LOSS_TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the 2-process job and the 1-process reference concurrently; load their outputs."""
    out = tmp_path_factory.mktemp("distributed")
    init = out / "rendezvous"
    pair = ["--world-size", "2", "--init-file", str(init)]
    commands = [
        [sys.executable, str(WORKER), str(out), "--tag", "two", "--rank", str(rank), *pair]
        for rank in (0, 1)
    ]
    commands.append(
        [sys.executable, str(WORKER), str(out), "--tag", "one", "--cases", REFERENCE_CASES]
    )
    procs = [
        subprocess.Popen(
            c, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for c in commands
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]

    def load(name: str) -> dict[str, Any]:
        return torch.load(out / name, weights_only=False)

    return {
        "rank0": load("two_rank0.pt"),
        "rank1": load("two_rank1.pt"),
        "one": load("one_rank0.pt"),
    }


# --------------------------------------------------------------------------- multi-process
@pytest.mark.slow
def test_workers_joined_one_gloo_group(results: dict[str, Any]) -> None:
    assert results["rank0"]["context"] == (0, 2, "gloo")
    assert results["rank1"]["context"] == (1, 2, "gloo")
    assert results["one"]["context"] == (0, 1, None)


@pytest.mark.slow
@pytest.mark.parametrize("rank", ["rank0", "rank1"])
def test_gather_keeps_rank_order_and_sums_gradients_over_ranks(
    results: dict[str, Any], rank: str
) -> None:
    g = results[rank]["gather"]
    # Rank 0 holds 3 rows and rank 1 holds 2: padding for the collective is cut off again.
    assert torch.equal(g["gathered"], g["expected"])
    # Every rank computes the same loss; the all-gather backward sums the R copies' gradients, so
    # the local gradient is R = 2 times one process's gradient of that loss...
    assert torch.allclose(g["grad_ratio"], torch.full_like(g["grad_ratio"], 2.0), atol=1e-12)
    # ...and DDP's average over ranks turns that back into one process's gradient, unscaled.
    assert torch.allclose(g["ddp_grad"], g["single_grad"], atol=1e-12, rtol=0)


@pytest.mark.slow
def test_small_collectives(results: dict[str, Any]) -> None:
    for rank in ("rank0", "rank1"):
        g = results[rank]["gather"]
        assert g["mean"] == {"a": 0.5, "b": 1.5}
        assert g["broadcast"] == {"rank": 0}
        assert g["eval_labels"].tolist() == [0, 1, 2, 0, 1]
        assert torch.equal(g["eval_semantic"], g["expected"])
        assert torch.equal(g["eval_uncertainty"], 2 * g["expected"])


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAINING_CASES)
def test_two_processes_train_like_one(results: dict[str, Any], case: str) -> None:
    one, rank0, rank1 = (results[k][case] for k in ("one", "rank0", "rank1"))
    # Same loss values (global batch), step by step: metric, ranking parts, total, ||u|| levels.
    assert len(one["parts"]) == 3
    for step, (ref, got0, got1) in enumerate(zip(one["parts"], rank0["parts"], rank1["parts"])):
        assert set(got0) == set(ref) == set(got1), step
        for key, value in ref.items():
            assert got0[key] == pytest.approx(value, abs=LOSS_TOLERANCE), (step, key)
            assert got1[key] == got0[key], (step, key)
    # Same weights after 3 optimizer steps (model, proxies, SSR head), on both ranks, and the same
    # gradients in the last step (Adam's update is blind to a gradient's scale; these are not).
    assert set(rank0["state"]) == set(one["state"])
    assert any(k.startswith("grad.model.") for k in one["state"])
    moved = max(
        float((one["state"][k].double() - one["initial"][k].double()).abs().max())
        for k in one["initial"]
    )
    assert moved > 1e-4, "the weights did not change, so the comparison would prove nothing"
    for key, value in one["state"].items():
        tolerance = GRADIENT_TOLERANCE if key.startswith("grad.") else WEIGHT_TOLERANCE
        assert torch.allclose(rank0["state"][key], value, atol=tolerance, rtol=0), key
        assert torch.equal(rank1["state"][key], rank0["state"][key]), key


@pytest.mark.slow
def test_warm_up_leaves_the_frozen_backbone_alone_on_every_rank(results: dict[str, Any]) -> None:
    # DDP finds the backbone unused on every rank and leaves its gradients None, so AdamW skips it
    # (no weight decay, no momentum) exactly as in one process.
    for run in (results["one"]["warmup"], results["rank0"]["warmup"], results["rank1"]["warmup"]):
        backbone = [k for k in run["initial"] if k.startswith("model.backbone.")]
        assert backbone and not any(k.startswith("grad.model.backbone.") for k in run["state"])
        assert all(torch.equal(run["state"][k], run["initial"][k]) for k in backbone)


@pytest.mark.slow
def test_distributed_evaluation_equals_single_process(results: dict[str, Any]) -> None:
    for rank in ("rank0", "rank1"):
        ev = results[rank]["evaluation"]
        # 195 test images: shards of 98 and 97, gathered in dataset order, no padding row left.
        assert ev["semantic"].shape[0] == 195
        assert torch.equal(ev["labels"], ev["whole_labels"])
        # One process embedding the same two parts in the same batches runs the same kernels on the
        # same inputs: the gathered embeddings are bit-identical to it on any CPU.
        assert torch.equal(ev["labels"], ev["layout_labels"])
        assert torch.equal(ev["semantic"], ev["layout_semantic"])
        # The whole set in batches of 64 instead of 98 + 97 images: oneDNN may choose other
        # convolution kernels (another summation order) for other batch sizes. float32 rounding
        # through the small CNN's few layers stays orders of magnitude below 1e-5 on unit vectors.
        assert torch.allclose(ev["semantic"], ev["whole_semantic"], atol=1e-5, rtol=0)
        if "metrics" in ev:
            # Metrics of identical embeddings through the same code: equal, not close. (Metrics of
            # the whole-set embeddings are not compared: a 1e-6 change can swap two neighbours at a
            # near tie and move MAP by far more, so no tolerance would be justified.)
            assert ev["metrics"] == ev["layout_metrics"]
    # Independently of the evaluation engine: the same nearest neighbours, so the same Recall@1.
    ev = results["rank0"]["evaluation"]
    assert _recall_at_1(ev["semantic"], ev["labels"]) == _recall_at_1(
        ev["layout_semantic"], ev["layout_labels"]
    )


def _recall_at_1(x: torch.Tensor, labels: torch.Tensor) -> float:
    sim = x @ x.T
    sim.fill_diagonal_(-float("inf"))
    return float((labels[sim.argmax(1)] == labels).double().mean())


@pytest.mark.slow
def test_torchrun_cli_trains_on_two_processes_and_resumes_on_one(tmp_path: Path) -> None:
    overrides = [
        *TINY,
        *IDML,
        "data.samples_per_class=20",
        "sampler.classes_per_batch=4",
        "loss.name=proxy_anchor",
        "device=cpu",
    ]
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny-ddp\n")
    run_dir = tmp_path / "run"
    args = ["-m", "idml", "train", str(config), "--out", str(run_dir), "--no-progress"]
    for item in overrides:
        args += ["--set", item]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*torchrun, *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Only rank 0 prints, logs and checkpoints.
    assert done.stdout.count("tiny-ddp: final") == 1, done.stdout
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["steps"] == 2
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch_0001"

    # Resume the 2-process run in one process for a second epoch: the global batches are the same.
    resumed = subprocess.run(
        [sys.executable, *args, "--resume", "--set", "optim.epochs=2"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch_0002"


# --------------------------------------------------------------------------- single process
def test_single_process_context_without_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    context = init_distributed(device="cpu")
    assert (context.rank, context.world_size, context.is_main, context.backend) == (
        0,
        1,
        True,
        None,
    )
    assert context.device == torch.device("cpu")
    assert context.mean({"a": 2.0}) == {"a": 2.0}
    assert context.broadcast_object([1]) == [1]


def test_partial_or_bad_environment_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"\['LOCAL_RANK', 'WORLD_SIZE'\] are not"):
        init_distributed(device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' must be an integer"):
        init_distributed(device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="backend must be"):
        init_distributed(backend="mpi", device="cpu")
    with pytest.raises(ValueError, match="needs CUDA"):
        init_distributed(backend="nccl", device="cpu")


def test_class_balanced_shards_rebuild_the_single_process_batches() -> None:
    labels = torch.arange(12).repeat_interleave(6)  # 12 classes × 6 images
    single = build_batch_sampler("class_balanced", labels, 24, images_per_class=3, seed=5)
    shards = [
        build_batch_sampler(
            "class_balanced", labels, 24, images_per_class=3, seed=5, num_replicas=2, rank=r
        )
        for r in (0, 1)
    ]
    for s in (single, *shards):
        s.set_epoch(3)
    reference = list(single)
    per_rank = [list(s) for s in shards]
    assert len(per_rank[0]) == len(per_rank[1]) == len(reference) == 72 // 24
    covered = set()
    for batch, part0, part1 in zip(reference, *per_rank):
        # Rank 0 then rank 1 is the global batch, index for index.
        assert part0 + part1 == batch
        for part in (part0, part1):
            rows = labels[part].view(4, 3)  # P/R = 4 whole classes × K = 3 images per rank
            assert bool((rows == rows[:, :1]).all()) and rows[:, 0].unique().numel() == 4
        assert not set(labels[part0].tolist()) & set(labels[part1].tolist())
        assert len(set(batch)) == 24
        covered |= set(batch)
    assert covered == set().union(*reference)


def test_train_loader_shards_by_rank() -> None:
    cfg = load_config(
        None,
        [
            "data.dataset=digits",
            "data.image_size=8",
            "data.resize_size=null",
            "data.num_workers=0",
            "data.samples_per_class=12",
            "sampler.classes_per_batch=4",
            "sampler.images_per_class=3",
        ],
    )
    data = build.build_data(cfg)
    generator = torch.Generator().manual_seed(0)
    single = [idx.tolist() for _, _, idx in build.train_loader(cfg, data, 2, generator)]
    ranks = [
        [
            idx.tolist()
            for _, _, idx in build.train_loader(cfg, data, 2, generator, num_replicas=2, rank=r)
        ]
        for r in (0, 1)
    ]
    assert single and [a + b for a, b in zip(*ranks)] == single


def test_random_sampler_shards_rebuild_the_single_process_batches() -> None:
    single = build_batch_sampler("random", torch.zeros(50), 10, seed=1)
    shards = [
        build_batch_sampler("random", torch.zeros(50), 10, seed=1, num_replicas=2, rank=r)
        for r in (0, 1)
    ]
    assert [a + b for a, b in zip(*(list(s) for s in shards))] == list(single)


def test_contiguous_shards_cover_the_test_set_once() -> None:
    data = TensorDataset(torch.arange(7))
    parts = []
    for r in range(3):
        shard = contiguous_shard(data, DistributedContext(rank=r, world_size=3))
        assert isinstance(shard, Sized)
        parts.append([int(shard[i][0]) for i in range(len(shard))])
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]


def test_sharding_an_unsized_dataset_says_it_needs_a_length() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    with pytest.raises(
        TypeError,
        match=r"sharding evaluation over 2 processes needs a map-style dataset.*a Stream has no length",
    ):
        contiguous_shard(Stream(), DistributedContext(rank=0, world_size=2))


def test_shard_plan_layout_and_generators() -> None:
    plan = ShardPlan.create(DistributedContext(), num_shards=3)
    assert plan.owned == (0, 1, 2)
    base = torch.Generator().manual_seed(9)
    gens = plan.generators(base)
    draws = [torch.rand(3, generator=g) for g in gens]
    assert not torch.equal(draws[0], draws[1])
    # Rank 1 of a 3-process job draws exactly what shard 1 draws in one process.
    rank1 = ShardPlan.create(DistributedContext(rank=1, world_size=3))
    assert rank1.owned == (1,)
    (g1,) = rank1.generators(torch.Generator().manual_seed(9))
    assert torch.equal(torch.rand(3, generator=g1), draws[1])
    shared = plan.generators(torch.Generator().manual_seed(9), shared=True)
    assert len({float(torch.rand((), generator=g)) for g in shared}) == 1
    # One shard keeps the caller's generator itself: single-process runs are unchanged.
    assert ShardPlan.create(DistributedContext()).generators(base) == [base]
    with pytest.raises(ValueError, match="leave num_shards unset"):
        ShardPlan.create(DistributedContext(rank=0, world_size=2), num_shards=3)


def test_rank_seeds_differ_except_rank_0() -> None:
    assert rank_seed(17, 0) == 17
    assert len({rank_seed(17, r) for r in range(4)}) == 4
    base = torch.Generator().manual_seed(17)
    assert rank_generator(base, 0) is base
    assert rank_generator(base, 2).initial_seed() == derived_seed(17, 2)


def test_ranking_shares_average_to_the_mean_over_all_images() -> None:
    one = ShardPlan.create(DistributedContext(), num_shards=2)
    assert one.ranking_shares(6, 16) == [(3, 0.5), (3, 0.5)]
    # 5 images over 2 processes: 3 and 2, weighted 2·3/5 and 2·2/5 (DDP then averages).
    shares = [
        ShardPlan.create(DistributedContext(rank=r, world_size=2)).ranking_shares(5, 8)
        for r in (0, 1)
    ]
    assert shares == [[(3, 1.2)], [(2, 0.8)]]
    # A shard smaller than its share gives all its images, as select_images does.
    assert one.ranking_shares(20, 6) == [(3, 0.5), (3, 0.5)]
    assert ShardPlan.create(DistributedContext()).ranking_shares(20, 16) == [(16, 1.0)]
    with pytest.raises(ValueError, match="without ranking images"):
        ShardPlan.create(DistributedContext(), num_shards=3).ranking_shares(2, 9)


def test_draw_images_matches_select_images() -> None:
    from idml.ranking import SelfSupervisedRanking, SSRConfig, draw_images

    images = torch.rand(10, 3, 4, 4)
    ssr = SelfSupervisedRanking(8, SSRConfig(num_images=4, hidden_dim=8, out_dim=4))
    expected = ssr.select_images(images, torch.Generator().manual_seed(3))
    assert torch.equal(draw_images(images, 4, torch.Generator().manual_seed(3)), expected)
    assert draw_images(images, 12, None) is images


def test_sharded_mixup_merges_originals_first_with_shifted_partners() -> None:
    plan = ShardPlan.create(DistributedContext(), num_shards=2)
    images = torch.rand(8, 1, 2, 2)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    gens = plan.generators(torch.Generator().manual_seed(4))
    batch = plan.augment(Mixup(fraction=0.5), images, labels, gens)
    assert batch.mixed.tolist() == [False] * 8 + [True] * 4
    assert torch.equal(batch.images[:8], images)
    info = batch.mixup
    assert info is not None
    # Partners stay inside their shard: rows 0-3 mix among themselves, rows 4-7 likewise.
    assert bool((info.index_a[:2] < 4).all() and (info.index_b[:2] < 4).all())
    assert bool((info.index_a[2:] >= 4).all() and (info.index_b[2:] >= 4).all())
    lam = info.lam.view(-1, 1, 1, 1)
    expected = lam * images[info.index_a] + (1 - lam) * images[info.index_b]
    # float32 blend of values in [0, 1], possibly rounded in another order by the library: ~2ε,
    # inside allclose's rtol 1e-5 + atol 1e-8.
    assert torch.allclose(batch.images[8:], expected)
    assert torch.equal(batch.labels.labels[8:, 0], labels[info.index_a])
    second = batch.labels.labels[8:, 1]
    same = labels[info.index_a] == labels[info.index_b]
    assert torch.equal(
        second, torch.where(same, torch.full_like(second, PAD), labels[info.index_b])
    )


def test_interpolate_mode_refuses_shards_with_different_lambdas() -> None:
    mix = Mixup(mode=MixupMode.INTERPOLATE)
    images, labels = torch.rand(4, 1, 2, 2), torch.tensor([0, 0, 1, 1])
    a = mix(images, labels, torch.Generator().manual_seed(1))
    b = mix(images, labels, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="one λ"):
        merge_rows([a, b])
    assert merge_rows([a, a]).mixup is not None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], False),
        (["optim.warmup_epochs=1"], True),
        (["ssr.enabled=true", "ssr.task.p_task=1.0"], False),
        (["ssr.enabled=true", "ssr.task.p_task=0.8"], True),
        (["ssr.enabled=true", "ssr.task.p_task=1.0", "ssr.task.update=alternating"], True),
        (["model.uncertainty.enabled=true"], True),
        (["model.uncertainty.enabled=true", "metric.introspective=true"], False),
    ],
)
def test_unused_parameter_search_only_when_needed(overrides: list[str], expected: bool) -> None:
    cfg = load_config(None, ["optim.warmup_epochs=0", *overrides])
    assert build.needs_unused_parameter_search(cfg) is expected
