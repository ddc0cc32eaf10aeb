"""`coordinator start | status | stop | report` — the project's main job.

`start` validates the whole config before any process starts (a bad value prints one line and exits with
status 2). Without addresses it runs embedded: a private redis-server (AOF), the trainer and one rollout
replica as child processes on loopback, stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from coordinator.config import FIELDS, CoordinatorConfig, public_name
from fp8rl.config import ConfigError, add_config_flags, config_from_cli, load_config
from fp8rl.devices import prefer_huge_pages
from fp8rl.recipes import RECIPE_NAMES

# Flags beyond the fields users write (FIELDS, one flag each): shortcuts to a field of a section.
SHORTCUTS = {
    "lr": "embedded.learner.optimizer.lr",
    "consistency": "run.precision.consistency",
    "high_precision_first_layers": "run.precision.high_precision_first_layers",
    "high_precision_last_layers": "run.precision.high_precision_last_layers",
    "ray_address": "embedded.ray.address",
    "replicas": "embedded.ray.replicas",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The command line, and the flags that set config fields (argparse dest -> field: config_from_cli;
    scripts/config_reference.py documents them)."""
    parser = argparse.ArgumentParser(prog="coordinator", description="FP8 GRPO driver")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start (or resume, with the same --run-id) a run")
    # Help and defaults from the slice field each flag sets; the value goes in under the name users write.
    flags = {
        dest: public_name(path)
        for dest, path in add_config_flags(start, CoordinatorConfig, FIELDS | SHORTCUTS).items()
    }
    compare = sub.add_parser(
        "compare", help="run several recipes from the same base and seed; compare.md + plots"
    )
    compare.add_argument("--recipes", required=True, help=f"comma-separated, from {', '.join(RECIPE_NAMES)}")
    compare.add_argument(
        "--model", type=Path, help="HF checkpoint directory for every run (default: the shipped tiny model)"
    )
    compare.add_argument("--steps", type=int)
    compare.add_argument("--seed", type=int)
    compare.add_argument("--no-is", action="store_true", help="turn importance sampling off in every run")
    compare.add_argument("--out", type=Path, help="output directory; default runs/compare-<time>")
    compare.add_argument("--config", type=Path, help="YAML file with CoordinatorConfig fields")
    compare.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    for name, text in (
        ("status", "the run's state and last metrics"),
        ("stop", "stop at the next step boundary"),
        ("report", "write PNG plots to the run directory"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--run-id", required=name != "status")
        p.add_argument("--run-dir", type=Path)
        p.add_argument("--redis-url")
    return parser, flags


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser, flags = build_parser()
    return parser.parse_args(argv), flags


def main(argv: list[str] | None = None) -> None:
    prefer_huge_pages()
    args, flags = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "start":
        from coordinator.run import start

        raise SystemExit(start(config_from_cli(CoordinatorConfig, "coordinator", args, flags)))
    if args.command == "compare":
        raise SystemExit(run_compare(args))
    from coordinator import inspect_run

    raise SystemExit(getattr(inspect_run, args.command)(args.run_id, args.run_dir, args.redis_url))


def run_compare(args: argparse.Namespace) -> int:
    from coordinator.compare import compare

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPE_NAMES]
    if unknown or not recipes:
        print(
            f"coordinator: unknown recipes {unknown}; choose from {', '.join(RECIPE_NAMES)}", file=sys.stderr
        )
        return 2
    try:
        base = load_config(
            CoordinatorConfig,
            args.config,
            {"model": args.model, "steps": args.steps, "seed": args.seed},
            args.set,
        )
    except ConfigError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    return compare(base, recipes, args.no_is, args.out)


if __name__ == "__main__":
    main()
