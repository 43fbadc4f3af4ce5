"""Command-line interface: parses arguments and calls the library. No logic lives here.

Each sub-command has one ``_add_<name>`` function that registers its parser and one ``_run_<name>``
function that calls into the library.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="idml", description="Deep metric learning with IDML and SSR."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_evaluate, _add_embed, _add_demo):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"idml {args.command}: error: {err}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- evaluate
def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="retrieval metrics of embeddings or of a trained run")
    p.set_defaults(run=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    raise NotImplementedError("evaluate is being built")


# --------------------------------------------------------------------------- train
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train (and evaluate) a model from a YAML config")
    p.add_argument("config", type=Path, help="YAML config, e.g. configs/idml/cub_proxy_anchor.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optim.epochs=10 (repeatable)",
    )
    p.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<name>)")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from idml.config import load_config
    from idml.training import Trainer

    cfg = load_config(args.config, args.overrides)
    out = args.out or Path("runs") / cfg.name
    result = Trainer(cfg, out, progress=not args.no_progress).fit(resume=args.resume)
    print(format_metrics(f"{cfg.name}: final", result.final_metrics))
    if result.best_epoch >= 0:
        print(format_metrics(f"best epoch {result.best_epoch + 1}", result.best_metrics))
    print(f"run folder: {result.run_dir}")
    return 0


# --------------------------------------------------------------------------- embed
def _add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="export semantic embeddings and uncertainty levels of images")
    p.add_argument("--checkpoint", type=Path, required=True, help="run folder or checkpoint folder")
    p.add_argument("--images", type=Path, required=True, help="image folder or CSV (path[,label])")
    p.add_argument("--out", type=Path, required=True, help=".npz, .pt or .safetensors file")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--which", choices=["best", "latest"], default="best")
    p.set_defaults(run=_run_embed)


def _run_embed(args: argparse.Namespace) -> int:
    from idml.export import embed_images, load_trained_model

    cfg, model = load_trained_model(args.checkpoint, which=args.which)
    n = embed_images(cfg, model, args.images, args.out, batch_size=args.batch_size)
    print(f"wrote {n} embeddings to {args.out}")
    return 0


# --------------------------------------------------------------------------- demo
def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="baseline vs IDML on the bundled digits (no download)")
    p.add_argument("--epochs", type=int, default=12, help="training epochs of each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from idml.demo import run_demo

    result = run_demo(args.out, epochs=args.epochs, seed=args.seed, progress=not args.no_progress)
    print("Digits 0-4 train, unseen digits 5-9 test; small CNN, Multi-Similarity loss")
    print(result.table())
    print(f"runs: {args.out}/baseline, {args.out}/idml")
    return 0


def format_metrics(title: str, metrics: dict[str, float]) -> str:
    """A two-column table of metric values."""
    width = max((len(k) for k in metrics), default=6)
    lines = [title] + [f"  {k.ljust(width)}  {v:.4f}" for k, v in metrics.items()]
    return "\n".join(lines)
