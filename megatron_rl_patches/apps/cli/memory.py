"""`megatron-rl-patches memory`: per-rank bytes of training state (grad buffer, fp32 main params,
Adam m and v) that an inference-only build of a frozen model does not allocate."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import tempfile
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

from megatron_rl_patches.apps.cli._common import OK, UsageError
from megatron_rl_patches.apps.cli.memory_head import run_with_heads
from megatron_rl_patches.apps.cli.memory_hf import run_hf
from megatron_rl_patches.apps.cli.memory_teacher import run_teacher
from megatron_rl_patches.apps.presentation import memory_report, residency_table
from megatron_rl_patches.inference.loading.hf.checkpoint_config import CONFIG, checkpoint_dir
from megatron_rl_patches.inference.sizing.memory import training_state_bytes
from megatron_rl_patches.inference.sizing.residency_plan import MODES, residency_plan
from megatron_rl_patches.ops.scoring_plan import positive_int
from megatron_rl_patches.settings import ascii_int

_SUFFIXES = {"": 0, "k": 3, "m": 6, "b": 9, "g": 9, "t": 12}  # powers of ten
_MAX_DIGITS = 30  # a count beyond 10**30 parameters is a typo (and 1e999999999 must not be expanded)
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)

# the head dtypes `TeacherHead` takes (teachers.head.teacher_head.DTYPES; named here: that module imports torch)
HEAD_DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse_param_count(text: str) -> int:
    """'27e9', '27B', '7b', '1.5M', '70000000000' -> a whole number of parameters."""
    match = _COUNT.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid parameter count {text!r}: use a number such as 27e9, 27B, 7.5B or 1500M"
        )
    # Exact, not float: 8.03 * 1e9 is 8030000000.000001 in binary floating point.
    number, power = Decimal(match.group(1)), _SUFFIXES[match.group(2).lower()]
    if number.adjusted() + power >= _MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"invalid parameter count {text!r}: must be below 1e{_MAX_DIGITS}")
    value = Fraction(number) * 10**power if number and number.adjusted() + power >= 0 else Fraction(0)  # < 1 anyway
    if value < 1 or value.denominator != 1:
        raise argparse.ArgumentTypeError(f"invalid parameter count {text!r}: must be a whole number >= 1")
    return int(value)


def _positive(text: str) -> int:
    try:
        return positive_int("--dp", ascii_int(text.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid data-parallel size {text!r}: must be an integer >= 1") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params", type=parse_param_count, metavar="N",
        help="number of model parameters, e.g. 27e9 or 27B (or --hf)",
    )
    parser.add_argument(
        "--hf", metavar="PATH", default=None,
        help="a Hugging Face checkpoint directory (its config.json alone will do): per-GPU weights at "
             "--tp/--pp/--ep by residency mode, from the config alone",
    )
    parser.add_argument("--dp", type=_positive, default=1, help="data-parallel size")
    parser.add_argument(
        "--distributed-optimizer", action="store_true",
        help="optimizer state sharded over the data-parallel ranks (Megatron's distributed optimizer)",
    )
    parser.add_argument(
        "--param-dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="weights"
    )
    parser.add_argument(
        "--grad-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
        help="grad buffer: fp32 (Megatron's grad_reduce_in_fp32) or the weights' dtype",
    )
    parser.add_argument(
        "--residency", choices=MODES, default=None,
        help="also print the weights' device and host bytes per residency mode (this one marked); needs --layers",
    )
    parser.add_argument("--layers", type=_count("--layers"), default=None, help="transformer layers (with --residency)")
    parser.add_argument("--prefetch", type=_count("--prefetch", minimum=0), default=None,
                        help="layers copied ahead when streaming (with --residency; default 1)")
    parser.add_argument("--vocab", type=_count("--vocab"), default=None,
                        help="vocabulary size (with --residency and --hidden)")
    parser.add_argument("--hidden", type=_count("--hidden"), default=None,
                        help="hidden size (with --residency and --vocab)")
    parser.add_argument("--tied", action="store_true",
                        help="input and output embeddings share one weight (with --residency)")
    parser.add_argument("--tp", type=_count("--tp"), default=None,
                        help="tensor-parallel size, each rank holds a shard (with --residency; default 1)")
    parser.add_argument("--pp", type=_count("--pp"), default=1, help="pipeline-parallel size (with --hf)")
    parser.add_argument("--ep", type=_count("--ep"), default=1, help="expert-parallel size (with --hf)")
    parser.add_argument("--teacher-tp", type=_count("--teacher-tp"), default=None,
                        help="with --hf: the teacher at its own tensor-parallel size over the student's "
                             "--tp x --pp x --dp ranks (per-GPU and host bytes per rank, beside the student's layout)")
    parser.add_argument("--teacher-pp", type=_count("--teacher-pp"), default=1,
                        help="with --hf: the teacher's own pipeline-parallel size (beside --teacher-tp, default 1)")
    parser.add_argument("--teacher-ep", type=_count("--teacher-ep"), default=1,
                        help="the teacher's own expert-parallel size (with --teacher-tp; only 1 is served)")
    parser.add_argument("--head", action="append", default=[], metavar="DIR",
                        help="a served teacher's Hugging Face checkpoint (repeatable): its output layer's bytes per "
                             "rank on the trainer at the student's --tp (default 1), from config.json alone; "
                             "alone or beside --params / --hf")
    parser.add_argument("--head-dtype", choices=HEAD_DTYPES, default=None,
                        help="the heads' dtype (with --head; default: each checkpoint's own)")
    parser.add_argument("--json", action="store_true", help="print a JSON object (bytes)")


def _count(flag: str, minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`, the error naming `flag`."""
    def parse(text: str) -> int:
        value = ascii_int(text.strip())
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"invalid {flag} {text!r}: must be an integer >= {minimum}")
        return value

    return parse


# The options only the residency plan reads: without --residency each is a usage error, not ignored.
RESIDENCY_OPTIONS = ("--layers", "--prefetch", "--vocab", "--hidden", "--tied", "--tp")


def _planned_from(args: argparse.Namespace, plan: Callable[[argparse.Namespace], int]) -> int:
    """`plan(args)`; a config file given to --hf (a published config.json saved under its model's name,
    as docs/recipes.md's fixtures) is planned as its directory's config.json: the plan reads nothing
    else, and the output names the file. A file named config.json is a checkpoint's own: refused naming
    its directory, by the check every entry point makes (round 7's one rule for a checkpoint's path)."""
    given = Path(args.hf).expanduser()
    if given.name == CONFIG:
        try:
            checkpoint_dir(given, "--hf")
        except (TypeError, ValueError, FileNotFoundError) as exc:
            raise UsageError(str(exc)) from None
    if not (given.is_file() and given.suffix == ".json"):
        return plan(args)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").symlink_to(given.resolve())
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                code = plan(argparse.Namespace(**{**vars(args), "hf": folder}))
        except UsageError as exc:
            raise UsageError(str(exc).replace(folder, args.hf)) from None
    print(printed.getvalue().replace(folder, args.hf), end="")
    return code


def run(args: argparse.Namespace) -> int:
    if args.head_dtype is not None and not args.head:
        raise UsageError("--head-dtype sizes a teacher's head: add --head DIR (the teacher's checkpoint)")
    if not args.head:
        return _plan(args)
    if args.params is None and args.hf is None:
        given = [flag for flag in (*RESIDENCY_OPTIONS[:-1], "--residency", "--teacher-tp")
                 if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)}: --head DIR alone sizes the teachers' heads (at --tp); "
                             "add --params N or --hf PATH for the rest")
        return run_with_heads(args, None)
    return run_with_heads(args, _plan)


def _plan(args: argparse.Namespace) -> int:
    """The training-state / residency / Hugging Face plan (--params or --hf)."""
    if (args.params is None) == (args.hf is None):
        raise UsageError("give --params N (a parameter count) or --hf PATH (a Hugging Face checkpoint), one of them")
    if args.hf is not None:
        given = [flag for flag in ("--layers", "--vocab", "--hidden", "--tied")
                 if getattr(args, flag[2:]) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)}: --hf PATH reads the model's shape from its config.json; drop them")

        args.tp, args.prefetch = args.tp or 1, 1 if args.prefetch is None else args.prefetch
        if args.teacher_tp is not None or (args.teacher_pp, args.teacher_ep) != (1, 1):
            args.teacher_tp = args.teacher_tp or 1  # --teacher-pp N alone: a teacher at TP=1 x PP=N
        return _planned_from(args, run_teacher if args.teacher_tp is not None else run_hf)
    if args.teacher_tp is not None or (args.teacher_pp, args.teacher_ep) != (1, 1):
        raise UsageError("--teacher-tp / --teacher-pp / --teacher-ep need --hf PATH (the teacher's checkpoint)")
    if (args.pp, args.ep) != (1, 1):
        raise UsageError("--pp and --ep need --hf PATH (the layers and experts come from its config.json)")
    if args.residency is None:
        sized = RESIDENCY_OPTIONS[:-1] if args.head else RESIDENCY_OPTIONS  # --tp also sizes the heads
        given = [flag for flag in sized if getattr(args, flag[2:]) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} only size{'s' if len(given) == 1 else ''} the residency plan: "
                             "add --residency resident|swap|stream (and --layers N)")
    try:
        report = training_state_bytes(
            args.params,
            dp=args.dp,
            distributed_optimizer=args.distributed_optimizer,
            param_dtype=args.param_dtype,
            grad_dtype=args.grad_dtype,
        )
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if args.residency is None:
        print(json.dumps(report.as_dict(), indent=2) if args.json else memory_report(report))
        return OK
    if args.layers is None:
        raise UsageError("--residency needs --layers N (the model's transformer layers)")
    try:
        plan = residency_plan(args.params, layers=args.layers, prefetch=1 if args.prefetch is None else args.prefetch,
                              param_dtype=args.param_dtype, vocab_size=args.vocab, hidden_size=args.hidden,
                              tied=args.tied, tp=args.tp or 1)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({**report.as_dict(), "residency": args.residency, "residency_plan": plan.as_dict()}, indent=2))
    else:
        print(memory_report(report) + "\n\n" + residency_table(plan, args.residency))
    return OK
