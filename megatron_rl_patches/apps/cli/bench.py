"""`megatron-rl-patches bench [logprobs|topk|reentrant|fused|windows|distill|residency|teacher-layout|share-scores|
hidden-dtypes|context|self-teacher|shared-prefix|shared-prefix-attention|load|gpu|all]
[--quick] [--out DIR] [--only PART]`; `bench ops [--baseline REV] [--T N] [--V N] [--H N] [--runs N]
[--invariant [--threads N]]`.
An option of one benchmark given to another is a usage error (exit 2), never silently ignored.

`bench gpu` (not part of `all`) needs a CUDA device; without one it says so in one line and
exits non-zero. `bench load` (not part of `all`: it writes a ~3 GB checkpoint under the temporary
folder, deleted afterwards) times Hugging Face checkpoint loading against transformers.
`bench teacher-layout`, `bench share-scores` (each spawns a world of 2 ranks), `bench
hidden-dtypes` (a transformers model), `bench context` and `bench self-teacher` (a privileged
context: the teacher pass with one against without; the live self-teacher against a snapshot) and
`bench shared-prefix` (a group's prompt once against each sample whole) are part of `all` but not of
`all --quick` (half a minute each even on tiny shapes)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tempfile

from megatron_rl_patches.apps.bench import gpu, ops
from megatron_rl_patches.apps.bench.progress import HEARTBEAT_S, ticking
from megatron_rl_patches.apps.bench.shared_prefix_shapes import ALL_SHAPES as SHARED_PREFIX_SHAPES
from megatron_rl_patches.apps.bench.shared_prefix_shapes import duration as shared_prefix_duration
from megatron_rl_patches.apps.cli._common import OK, PROBLEM, UsageError, say
from megatron_rl_patches.settings import ascii_int

BENCHMARKS = {
    "logprobs": "megatron_rl_patches.apps.bench.logprobs",
    "topk": "megatron_rl_patches.apps.bench.topk",
    "reentrant": "megatron_rl_patches.apps.bench.reentrant",
    "fused": "megatron_rl_patches.apps.bench.fused",
    "windows": "megatron_rl_patches.apps.bench.windows",
    "distill": "megatron_rl_patches.apps.bench.distill",
    "residency": "megatron_rl_patches.apps.bench.residency",
    "teacher-layout": "megatron_rl_patches.apps.bench.teacher_layout",
    "share-scores": "megatron_rl_patches.apps.bench.share_scores",
    "hidden-dtypes": "megatron_rl_patches.apps.bench.hidden_dtypes",
    "context": "megatron_rl_patches.apps.bench.context_pass",
    "self-teacher": "megatron_rl_patches.apps.bench.live_teacher",
    "shared-prefix": "megatron_rl_patches.apps.bench.shared_prefix_shapes",
    "grouping": "megatron_rl_patches.apps.bench.grouping",
}
# Left out of `bench all --quick` (make test runs it): a spawned world's start-up alone takes half
# a minute on a busy 2-core machine, and so does transformers' model (hidden-dtypes); the
# privileged-context benchmarks (a GPTModel world, a case worker) are run by their own test;
# `bench NAME --quick` still runs each.
NOT_IN_QUICK_ALL = ("teacher-layout", "share-scores", "hidden-dtypes", "context", "self-teacher", "shared-prefix")
# Run only when named (not part of `all`): `load` writes and reads a checkpoint of several GB.
SEPARATE = {"load": "megatron_rl_patches.apps.bench.hf_load",
            # the shared-prefix plan's CUDA attention route against each sample whole (tools/gpu-check)
            "shared-prefix-attention": "megatron_rl_patches.apps.bench.shared_prefix_attention"}
# `bench ops` only: (flag, default, meaning); every other benchmark refuses them
OPS_OPTIONS = (("--T", 1024, "tokens"), ("--V", 8192, "vocabulary"), ("--H", 256, "hidden size"),
               ("--runs", 3, "interleaved runs per op and side (medians)"))
# Rough wall time of each full benchmark on an idle 2-core CPU (docs/benchmarks.md); --quick takes seconds.
# `shared-prefix`: each shape its own (`shared_prefix_shapes.DURATIONS`).
DURATIONS = {"logprobs": "2-4 min", "topk": "1-2 min", "reentrant": "1 min", "fused": "5-6 min",
             "windows": "1 min", "distill": "2-3 min", "residency": "1-2 min", "teacher-layout": "3-5 min",
             "share-scores": "3-6 min", "hidden-dtypes": "3-5 min", "load": "3-4 min",
             "context": "2-3 min", "self-teacher": "2-3 min", "grouping": "20-40 s",
             "shared-prefix-attention": "1 min on a GPU"}
# `bench fused --only PART` (megatron_rl_patches.apps.bench.fused.PARTS, kept here so --help imports no torch)
FUSED_PARTS = ("logprob", "opd", "invariant")
# `bench logprobs --only PART` (megatron_rl_patches.apps.bench.logprobs.PARTS)
LOGPROBS_PARTS = ("invariant",)


def _count(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = ascii_int(text.strip()) or 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: must be an integer >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # `gpu` (every implementation on a CUDA device) is not part of `all`
    parser.add_argument("which", nargs="?", default="all", choices=[*BENCHMARKS, *SEPARATE, "gpu", "ops", "all"],
                        help="which benchmark (`ops`: today's vocabulary ops against --baseline REV; `load`: "
                             "Hugging Face checkpoint loading; `gpu`: every implementation on a CUDA device, which "
                             "it needs (torch with CUDA); `shared-prefix-attention`: the shared-prefix plan's CUDA "
                             "attention route; none of the four in `all`)")
    parser.epilog = (f"`bench all --quick` leaves out {', '.join(NOT_IN_QUICK_ALL)} (about 30 s each even on tiny "
                     f"shapes: a spawned world or a model; it names them when it starts): `bench NAME --quick` runs "
                     f"one. `bench gpu` needs a CUDA device: without one it says so in one line (exit 1).")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: seconds, for smoke tests")
    parser.add_argument("--out", metavar="DIR", help="write CSV files and PNG plots (needs the [bench] extra) here")
    parser.add_argument("--slow", action="store_true",
                        help="bench gpu: also the rows that take minutes at the largest T (the torch tiles)")
    parser.add_argument("--only", choices=FUSED_PARTS, metavar="PART",
                        help=f"bench fused: run one part, {' or '.join(FUSED_PARTS)} "
                             "(log-prob + entropy, the top-k OPD step with 1 and 2 teachers, or the default "
                             "against the invariant mode at V = 151,936); bench logprobs: invariant")
    parser.add_argument("--shape", choices=SHARED_PREFIX_SHAPES, default=None,
                        help="bench shared-prefix: GRPO groups (default) or an agent's multi-turn trace (4 turns "
                             "branching 4 x 4, and one sample per turn), shared at every level against one level "
                             "only; hybrid (gated delta nets 3:1), deepseek (MLA + MoE + MTP), cp2 (context "
                             "parallelism 2: 2 ranks), models (those three in one table); all: every shape")
    ops = parser.add_argument_group("bench ops")
    ops.add_argument("--baseline", metavar="REV", help="bench ops: the git revision to compare with (e.g. main)")
    ops.add_argument("--invariant", action="store_true",
                     help="bench ops: log-prob + entropy (logits op, fused head; fp32, bf16) in the default mode, "
                          "the invariant mode and --baseline's invariant mode (default V = 151,936)")
    ops.add_argument("--threads", type=_count, default=None, metavar="N",
                     help="bench ops --invariant: torch's threads (default 1: thread CPU time; more: wall time)")
    for flag, default, meaning in OPS_OPTIONS:
        # default None: a value given to any other benchmark is a usage error, not silently ignored
        ops.add_argument(flag, type=_count, default=None, metavar="N", help=f"bench ops: {meaning} (default {default})")


def check_output_folder(path: str) -> None:
    """Create `path` if needed and prove a file can be written there, before any benchmark runs."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out {path}: not a folder; pass a folder for the CSV files and plots")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot write there ({exc.strerror or exc}); pass a writable folder") from None


def check_options(args: argparse.Namespace) -> None:
    """Options that belong to one benchmark are refused (exit 2) by every other one."""
    if args.only is not None and not (args.which == "fused" or (args.which == "logprobs"
                                                                 and args.only in LOGPROBS_PARTS)):
        raise UsageError(f"--only {args.only} selects a part of `bench fused`"
                         + (" or `bench logprobs`" if args.only in LOGPROBS_PARTS else "")
                         + f"; run `bench fused --only {args.only}`")
    if args.shape is not None and args.which != "shared-prefix":
        raise UsageError(f"--shape belongs to `bench shared-prefix`; `bench {args.which}` has one shape")
    if args.slow and args.which != "gpu":
        raise UsageError(f"--slow belongs to `bench gpu`; `bench {args.which}` runs every row it has")
    if args.which == "ops":
        if args.quick:
            raise UsageError("bench ops has no --quick: make it smaller with --T, --V, --H and --runs")
        return
    given = [flag for flag, *_ in OPS_OPTIONS if getattr(args, flag[2:]) is not None]
    given += ["--baseline"] if args.baseline is not None else []
    given += ["--invariant"] if args.invariant else []
    given += ["--threads"] if args.threads is not None else []
    if given:
        raise UsageError(f"{', '.join(given)} belong{'s' if len(given) == 1 else ''} to `bench ops`; "
                         f"`bench {args.which}` takes --quick, --out and (bench fused) --only")


def run(args: argparse.Namespace) -> int:
    check_options(args)
    if args.which == "gpu":
        return _run_gpu(args)
    if args.which == "ops":
        return _run_ops(args)
    if args.which == "shared-prefix-attention" and not args.quick and gpu.cuda_missing() is not None:
        say("bench shared-prefix-attention", f"{gpu.cuda_missing()} (FlexAttention's backward runs on CUDA only; "
            "--quick runs its forward on CPU to check the harness)")
        return PROBLEM
    if args.out:
        check_output_folder(args.out)
    names = ([name for name in BENCHMARKS if not (args.quick and name in NOT_IN_QUICK_ALL)]
             if args.which == "all" else [args.which])
    if args.which == "all" and args.quick:
        print(f"bench all --quick: {len(names)} benchmarks; leaves out {', '.join(NOT_IN_QUICK_ALL)} (about 30 s "
              f"each even on tiny shapes): `bench NAME --quick` runs one", file=sys.stderr, flush=True)
    failed = []
    for name in names:
        options = {"only": args.only} if args.only is not None else {}
        if args.shape is not None:
            options["shape"] = args.shape
        full = shared_prefix_duration(args.shape) if name == "shared-prefix" else DURATIONS[name]
        took = (f"about {full} on an idle 2-core CPU; --quick takes seconds" if not args.quick
                else "about 30 s: a spawned world or a model" if name in NOT_IN_QUICK_ALL else "seconds")
        print(f"bench {name}: running ({took}); a line per case as it ends, and one at least every "
              f"{HEARTBEAT_S:.0f} s", file=sys.stderr, flush=True)
        module = importlib.import_module({**BENCHMARKS, **SEPARATE}[name])
        with ticking(f"bench {name}", every=HEARTBEAT_S):
            rows = module.run(quick=args.quick, out_dir=args.out, **options)
        errors = [row["error"] for row in rows if row.get("error")]
        if errors:
            failed.append(name)
            print(f"bench {name}: {len(errors)} case(s) failed: {errors[0]}", file=sys.stderr)
        print()
    if args.out:
        plots = importlib.util.find_spec("matplotlib") is not None
        print(f"CSV files{' and PNG plots' if plots else ''} written to {args.out}"
              + ("" if plots else " (no plots: install the [bench] extra for matplotlib)"))
    else:
        print("no files written: add --out DIR for CSV files and PNG plots")
    return PROBLEM if failed else OK


def _run_gpu(args: argparse.Namespace) -> int:
    """`bench gpu`: refuses in one line without CUDA, before anything else."""
    why = gpu.cuda_missing()
    if why is not None:
        say("bench gpu", why)
        return PROBLEM
    if args.out:
        check_output_folder(args.out)
    with ticking("bench gpu", every=HEARTBEAT_S):
        rows = gpu.run(quick=args.quick, out_dir=args.out, slow=args.slow)
    errors = [row["note"] for row in rows if str(row.get("note", "")).startswith("error")]
    for error in errors[:3]:
        say("bench gpu", error)
    return PROBLEM if errors else OK


def _run_ops(args: argparse.Namespace) -> int:
    """`bench ops`: interleaved per-op times of today's package and --baseline's."""
    if args.out:
        check_output_folder(args.out)
    given = {flag[2:]: getattr(args, flag[2:]) for flag, *_ in OPS_OPTIONS}
    value = {flag[2:]: given[flag[2:]] if given[flag[2:]] is not None else default for flag, default, _ in OPS_OPTIONS}
    shape = {"T": value["T"], "V": value["V"], "H": value["H"], "k": 8}
    if args.threads is not None and not args.invariant:
        raise UsageError("--threads belongs to `bench ops --invariant`")
    try:
        with ticking("bench ops", every=HEARTBEAT_S):
            if args.invariant:
                shape["V"] = given["V"] if given["V"] is not None else ops.INVARIANT_SHAPE["V"]
                rows = ops.run_invariant(args.baseline, shape, value["runs"], args.out, args.threads or 1)
                return PROBLEM if any(row["invariant_s"] is None for row in rows) else OK
            rows = ops.run_ops(args.baseline, shape, value["runs"], args.out)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return PROBLEM if any(row["today_s"] is None for row in rows) else OK
