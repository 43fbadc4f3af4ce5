"""Running the study: a :class:`Job` per run, trained (or reused) on worker processes, and the
grid that ``run`` trains (the main arms or the degraded ones): each run's overrides in order, all
checked before the first trains, seed by seed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from idml_study.design import ARMS, DEGRADATION_ARMS, DEGRADATION_LOSS, DEGRADATIONS, MATCHED_TO
from idml_study.ledger import Ledger, study_ledger
from idml_study.mechanism import (
    control_overrides,
    idle_control,
    rematch,
    stale_match,
    write_mechanism,
)
from idml_study.recipes import LEGACY_LAYOUT, grid_recipe, setting_overrides, study_overrides
from idml_study.results import run_files


@dataclass(frozen=True)
class Job:
    """One run: a folder, the overrides of its config, and whether to write ``mechanism.json``."""

    folder: Path
    overrides: tuple[str, ...]
    mechanism: bool
    match_controls: bool = False


def reuse_overrides(job: Job) -> list[str]:
    """``job``'s overrides, but a run that finished before layouts were pinned is reused as it is:
    it says ``optim.channels_last: auto``, which on the CPU meant the contiguous layout its folder
    is pinned to (:data:`recipes.LEGACY_LAYOUT`), so it is the same run and must not be trained
    again."""
    overrides = list(job.overrides)
    if LEGACY_LAYOUT not in overrides:
        return overrides
    for result in job.folder.glob("cells/*/seed*/result.json"):
        if not re.fullmatch(r"seed\d+", result.parent.name):
            continue  # a run moved aside (``seed0.replaced-…``) is not the one reused
        stored = json.loads(result.read_text()).get("config", {})
        if stored.get("optim", {}).get("channels_last") == "auto":
            return [o for o in overrides if o != LEGACY_LAYOUT]
    return overrides


def run_job(job: Job) -> tuple[str, float]:
    """Train (or reuse) one run, then its mechanism diagnostics; ``(folder, seconds)``."""
    import torch

    torch.set_num_threads(1)
    from idml.app.ablation import parse_grid, run_ablation

    start = time.perf_counter()
    result = run_ablation(
        None, parse_grid([]), 1, job.folder, overrides=reuse_overrides(job), log=lambda _: None
    )
    run_dir = result.cells[0].runs[0].run_dir
    mechanism = run_dir / "mechanism.json"
    if job.mechanism and not mechanism.is_file():
        write_mechanism(run_dir, job.match_controls)
    elif job.match_controls and stale_match(run_dir):
        rematch(run_dir)
    return str(job.folder), time.perf_counter() - start


def has_run_file(job: Job, name: str) -> bool:
    """Whether ``job``'s run folder holds ``name``."""
    # run_files lists an arm's files as <arm>/sN/cells/base/seedN/<name>.
    return any(path.parents[3] == job.folder for path in run_files(job.folder.parent, name))


def finished(job: Job) -> bool:
    """Whether ``job``'s run already has its result (:func:`run_job` then reuses it at once)."""
    return has_run_file(job, "result.json")


def part_trained(job: Job) -> bool:
    """Whether ``job``'s run was stopped part-way (it has logged epochs but no result): it resumes
    from its last checkpoint, so its time says little of a whole run's."""
    return not finished(job) and has_run_file(job, "metrics.jsonl")


def time_left(trained: Mapping[str, Sequence[float]], left: Sequence[str], workers: int) -> str:
    """What a progress line says of the time a grid has left: each run still to train (named by
    its arm in ``left``) at the mean time of its arm's runs trained so far in this call, or of all
    of them where its arm has none yet, ``workers`` at a time; nothing before a run has trained or
    once none is left. Arms differ (one with Mixup trains half a batch more), and a grid trained
    seed by seed has timed every arm after its first seed.

    >>> time_left({"baseline": [250.0], "idml": [400.0]}, ["baseline", "idml"] * 9, 2)
    '; about 48.8 min left'
    >>> time_left({"a": [1500.0, 1700.0]}, ["a"] * 66, 1), time_left({"a": [200.0]}, ["b"] * 3, 2)
    ('; about 29.3 h left', '; about 5.0 min left')
    >>> time_left({}, ["a"] * 5, 1), time_left({"a": [90.0]}, [], 1)
    ('', '')
    """
    times = [t for arm_times in trained.values() for t in arm_times]
    if not times or not left:
        return ""
    overall = sum(times) / len(times)
    seconds = sum(
        sum(trained[arm]) / len(trained[arm]) if trained.get(arm) else overall for arm in left
    ) / max(1, workers)
    if seconds >= 5400:
        return f"; about {seconds / 3600:.1f} h left"
    return f"; about {seconds / 60:.1f} min left"


def run_jobs(jobs: Sequence[Job], workers: int, ledger: Ledger | None = None) -> None:
    """Run ``jobs`` on ``workers`` processes (one thread each), printing a line per finished run
    with the time the rest should take (:func:`time_left`), and copying its record into
    ``ledger`` at once (a chain stopped mid-grid keeps every run that finished)."""
    total = len(jobs)
    start = time.perf_counter()
    # A grid resumed across sessions reuses its finished runs in no time and finishes the runs a
    # stop cut off in part of one: only whole runs trained here estimate the time of the rest.
    # Each run still to train, with its arm's folder (a run's folder is <arm>/sN).
    to_train = {str(job.folder): str(job.folder.parent) for job in jobs if not finished(job)}
    resumed = {str(job.folder) for job in jobs if part_trained(job)}
    trained: dict[str, list[float]] = {}

    def report(results: Iterator[tuple[str, float]]) -> None:
        for done, (folder, seconds) in enumerate(results, start=1):
            if ledger is not None:
                ledger.record_run(Path(folder))
            arm = to_train.pop(folder, None)
            if arm is not None and folder not in resumed:
                trained.setdefault(arm, []).append(seconds)
            elapsed = (time.perf_counter() - start) / 60
            left = time_left(trained, list(to_train.values()), workers)
            print(
                f"[{done}/{total}] {folder} ({seconds:.0f} s; {elapsed:.1f} min so far{left})",
                flush=True,
            )

    if not total:
        return
    if workers <= 1:
        report(map(run_job, jobs))
        return
    with multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=8) as pool:
        report(pool.imap_unordered(run_job, jobs))


def key_of(override: str) -> str:
    return override.partition("=")[0].strip()


PER_RUN_KEYS = frozenset({"loss.name", "seed"})
"""Keys the study sets for each run itself (from ``--losses`` and ``--seeds``): never an
``--override``."""


def arm_config(
    base: Sequence[str],
    loss: str,
    recipe: Sequence[str],
    study: Sequence[str],
    arm: str,
    own: Sequence[str],
) -> tuple[str, ...]:
    """One arm's overrides in the order that lets the later win: the setting's, the loss, its
    recipe, the study's ``--override`` values, then what makes the arm itself (``own``: its
    method, a matched control's value, a degradation). A study override of a key the arm sets
    would make two arms the same run, so it stops the command.

    >>> arm_config(["optim.epochs=8"], "contrastive", ["optim.epochs=16"], ["optim.lr=1e-4"],
    ...            "mixup", ["mixup.enabled=true"])[1:]
    ('loss.name=contrastive', 'optim.epochs=16', 'optim.lr=1e-4', 'mixup.enabled=true')
    """
    sets = {key_of(o): o for o in own}
    clash = [o for o in study if key_of(o) in sets]
    if clash:
        raise SystemExit(
            f"--override {' '.join(clash)}: the arm {arm!r} sets "
            f"{', '.join(sets[key_of(o)] for o in clash)} itself; override setting or recipe "
            "keys only (optim.*, data.*, model.* that no arm sets)"
        )
    return (*base, f"loss.name={loss}", *recipe, *study, *own)


def checked_jobs(args: argparse.Namespace, jobs: list[Job]) -> list[Job]:
    """``jobs``, once every one's config validates and passes the trainer's preflight, and then the
    folder's ``--override`` values pinned (:func:`recipes.study_overrides`): a misspelt key, a value
    out of range or a loss that refuses its hyper-parameters (a matched margin past m_neg) stops the
    command before the first run trains, with the config's own message, and pins nothing."""
    from idml.app.config import ConfigError, load_config
    from idml.app.preflight import check_run_config

    for job in jobs:
        try:
            check_run_config(load_config(None, list(job.overrides)))
        except ConfigError as error:
            raise SystemExit(f"{job.folder}: its config does not validate: {error}") from None
    study_overrides(args, pin=True)
    return jobs


def main_jobs(args: argparse.Namespace, matched: bool) -> list[Job]:
    setting = args.setting
    base = setting_overrides(args)
    study = study_overrides(args, pin=False)
    jobs = []
    for loss in args.losses:
        chosen = grid_recipe(args, loss, args.out / setting / loss)
        for name in args.arms:
            arm = ARMS[name]
            if arm.matched != matched or not arm.trains_with(loss):
                continue
            arms_folder = args.out / setting / loss
            if idle := idle_control(arms_folder, arm):
                print(f"{arms_folder / name}: not trained: {idle}")
                continue
            extra = control_overrides(arms_folder, arm)
            own = (*arm.overrides, *extra)
            for seed in range(args.seeds):
                config = (*arm_config(base, loss, chosen, study, name, own), f"seed={seed}")
                folder = args.out / setting / loss / name / f"s{seed}"
                jobs.append(Job(folder, config, arm.has_head, match_controls=name in MATCHED_TO))
    return jobs


def degradation_jobs(args: argparse.Namespace, matched: bool) -> list[Job]:
    setting, loss = args.setting, DEGRADATION_LOSS
    base = setting_overrides(args)
    study = study_overrides(args, pin=False)
    # The degraded arms are compared with this loss's clean baseline of the main grid.
    chosen = grid_recipe(args, loss, args.out / setting / loss)
    jobs = []
    for degradation in args.kinds:
        knob = DEGRADATIONS[degradation]
        folder = args.out / setting / "degradations" / degradation
        for name in args.arms:
            arm = DEGRADATION_ARMS[name]
            if arm.matched != matched:
                continue
            extra = control_overrides(folder, arm)
            for seed in range(args.seeds):
                config = arm_config(base, loss, chosen, study, name, (*arm.overrides, knob, *extra))
                jobs.append(
                    Job(
                        folder / name / f"s{seed}",
                        (*config, f"seed={seed}"),
                        arm.has_head,
                        match_controls=name in MATCHED_TO,
                    )
                )
    return jobs


def seed_major(jobs: Sequence[Job]) -> list[Job]:
    """``jobs`` seed by seed: every arm's seed 0, then every arm's seed 1, and so on (arms and
    groups in their order within a seed). A grid of a day's CPU time outlives the session that
    starts it; stopped anywhere, it leaves every arm with the same seeds or one fewer, so its
    tables already pair all arms, where arm after arm left the last arms with no seed at all.

    >>> names = [Job(Path(a) / f"s{s}", (), False) for a in "ab" for s in range(2)]
    >>> [str(job.folder) for job in seed_major(names)]
    ['a/s0', 'b/s0', 'a/s1', 'b/s1']
    """
    return sorted(jobs, key=lambda job: int(job.folder.name.removeprefix("s")))


def run(args: argparse.Namespace) -> None:
    """Trains the arms that stand alone, then the controls matched to their runs, each phase seed
    by seed (:func:`seed_major`). The first phase pins each grid's recipe; the second trains at
    that pin, so a grid finishes at the recipe it started with even when ``converge --adopt``
    moves the validated recipe on while it runs."""
    jobs = degradation_jobs if args.degradations else main_jobs
    first = seed_major(jobs(args, matched=False))
    run_jobs(checked_jobs(args, first), args.workers, study_ledger(args))
    started = argparse.Namespace(**{**vars(args), "recipe": "pinned"})
    matched = seed_major(jobs(started, matched=True))
    run_jobs(checked_jobs(args, matched), args.workers, study_ledger(args))
