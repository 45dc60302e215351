"""`megatron-rl-patches demo`: a real tiny megatron-core RL loop, with and without the patches.

The actor is a tiny GPTModel in real DDP (overlap-grad-reduce, distributed optimizer,
overlap-param-gather) trained by a Megatron-style train() called once per rollout; the teachers
are built inference-only; every log-prob, entropy and top-k bucket comes from hidden states through
the fused output processors. `--no-patches` runs the same loop as a user without the package writes
it (plain builds, losses on full logits): rollout 1 matches, rollout 2 hits the re-entry crash.
On CPU it runs megatron-core through the test kit's shims (never used by library code).
"""
# lazy imports: import cost: `demo`'s usage errors come before torch (tests/apps/cli/test_light_usage_errors.py)
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace

from megatron_rl_patches.apps.cli._common import OK, PROBLEM, UsageError
from megatron_rl_patches.apps.demo.config import DemoConfig
from megatron_rl_patches.apps.demo.report import format_comparison, format_summary

ROUTES = ("both", "package", "plain")
# Without the package the loop fails on its second train() call: two rollouts show it.
PLAIN_ROLLOUTS_IN_BOTH = 2
SEEDS = 2**32  # --seed in [0, SEEDS): every seed the demo derives from it fits torch's generators


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    parser.add_argument("--rollouts", type=int, default=defaults.rollouts, help="train() calls (>= 1)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps per rollout")
    parser.add_argument("--teachers", type=int, default=defaults.teachers, help="inference-only teachers")
    parser.add_argument("--topk", type=int, default=defaults.topk, help="k of the top-k OPD term")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the models and the data")
    parser.add_argument("--ids-from", choices=("student", "union", "teacher"), default=defaults.ids_from,
                        help="the OPD buckets' ids: the student's top-k (as MEGATRON_RL_PATCHES_OPD_IDS_FROM's "
                             "default), the union with the first teacher's, or the first teacher's alone (the "
                             "demo only: slime_opd offers student and union)")
    parser.add_argument(
        "--route", choices=ROUTES, default="both",
        help="both: first without the package (up to the rollout that crashes), then with it; "
             "package: with it only; plain: without it only",
    )
    parser.add_argument(
        "--no-patches", action="store_true",
        help="the same as --route plain: no patch applied, teachers built as trainable DDP models, "
             "losses in plain torch on full logits (only the CPU test kit's shims remain)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def heading(route: str, rollouts: int) -> str:
    """The line shown before a route runs (and before its progress bars)."""
    if route == "plain":
        return (f"== without the package: up to {rollouts} rollout(s) of the loop as written without it "
                f"(rollout 2 is expected to crash) ==")
    return f"== with the package: {rollouts} rollout(s) of the same loop, patched =="


def _status(line: str) -> None:
    """A progress line on stderr, where the bars are, at once (stdout may be a JSON report)."""
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    overrides = {f.name: getattr(args, f.name) for f in fields(DemoConfig) if hasattr(args, f.name)}
    cfg = DemoConfig(**overrides)
    if cfg.rollouts < 1 or cfg.steps < 1 or cfg.teachers < 1 or not 0 < cfg.topk < cfg.vocab_size:
        raise UsageError(
            f"need --rollouts >= 1, --steps >= 1, --teachers >= 1 and 0 < --topk < {cfg.vocab_size}"
        )
    if not 0 <= cfg.seed < SEEDS:
        raise UsageError(f"--seed must be in 0 .. 2**32 - 1 (got {cfg.seed}): pass a smaller seed")
    route = "plain" if args.no_patches else args.route
    if args.no_patches and args.route not in ("both", "plain"):
        raise UsageError(f"--no-patches contradicts --route {args.route}")
    # on screen at once: the imports below take seconds (torch, megatron-core)
    _status("starting megatron-core on CPU (the first imports take about 10 s) ...")
    from megatron_rl_patches.apps.demo.session import run_demo

    if route != "both":
        _status(heading(route, cfg.rollouts))
        summary = run_demo(cfg, patches=route == "package", progress=True)
        print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
        return OK if summary["ok"] else PROBLEM
    plain_cfg = replace(cfg, rollouts=min(cfg.rollouts, PLAIN_ROLLOUTS_IN_BOTH))
    _status(heading("plain", plain_cfg.rollouts))
    plain = run_demo(plain_cfg, patches=False, progress=True)
    if not args.json:
        print(format_summary(plain, real_models=False) + "\n", flush=True)
    _status(heading("package", cfg.rollouts))
    package = run_demo(cfg, patches=True, progress=True)
    if args.json:
        print(json.dumps({"without_package": plain, "with_package": package}, indent=2))
    else:
        print(format_summary(package) + "\n\n" + format_comparison(plain, package))
    return OK if package["ok"] else PROBLEM
