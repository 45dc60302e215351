"""`megatron-rl-patches shared-prefix check`: before booking GPUs, what MEGATRON_RL_PATCHES_SHARED_PREFIX=1
does with a model at a layout, per framework and per pass: "shared", "packed whole, because ..." or
"refused, because ..." (under MEGATRON_RL_PATCHES_STRICT=1, or a hand-written loop's
`check_shared_prefix`), with the flag to change in that framework's words. From the model's config alone
(`--hf-config DIR`: a Hugging Face config.json; `--megatron-args FILE`: a run script's Megatron flags,
`shared_prefix_model`), no weights, in seconds: the verdicts are the doors' own
(`integrations/shared_prefix_doors`). Exit code 0 when every pass shares, 1 otherwise."""
from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

from megatron_rl_patches import settings
from megatron_rl_patches.apps.cli._common import OK, PROBLEM, UsageError
from megatron_rl_patches.apps.cli.shared_prefix_model import args_model, hf_model, layout_of
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import FRAMEWORKS, MEGATRON
from megatron_rl_patches.integrations.shared_prefix_doors.offline import (
    MEGATRON_CORE,
    ModelFacts,
    Parallel,
    offline_verdicts,
)
from megatron_rl_patches.integrations.shared_prefix_doors.table import SHARED


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="what each framework's passes do with a model at a layout, from its config",
                           description=__doc__)
    source = check.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", metavar="DIR", help="a Hugging Face model folder (its config.json)")
    source.add_argument("--megatron-args", metavar="FILE",
                        help="a file of Megatron arguments as a slime / Megatron-LM run script passes them")
    for name, what in (("tp", "tensor"), ("cp", "context"), ("pp", "pipeline"), ("ep", "expert"),
                       ("vpp", "virtual pipeline")):
        check.add_argument(f"--{name}", type=int, default=None, metavar="N", help=f"the {what}-parallel size")
    check.add_argument("--framework", choices=sorted(FRAMEWORKS), default=None,
                       help="one framework (default: each of slime, verl, nemo-rl, megatron)")
    check.add_argument("--megatron-core", metavar="VERSION", default=None,
                       help="the megatron-core the job runs (default: the framework's: slime 0.16, verl 0.18, "
                            "NeMo-RL 0.20, a hand-written loop the one installed here)")
    check.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="a model config field as the job sets it (repeatable), e.g. apply_rope_fusion=False")
    check.add_argument("--strict", action="store_true",
                       help=f"as under {settings.STRICT}=1 (also read from the environment): refused, not packed whole")
    check.add_argument("--json", action="store_true", help="print a JSON object")


def _field_value(word: str) -> tuple[str, Any]:
    name, equals, text = word.partition("=")
    if not equals or not name.isidentifier():
        raise UsageError(f"--set {word!r}: write FIELD=VALUE, e.g. apply_rope_fusion=False")
    value: Any = {"true": True, "false": False, "none": None}.get(text.lower(), text)
    if isinstance(value, str):
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                pass
    return name, value


def _installed_megatron_core() -> str | None:
    from megatron_rl_patches.integrations.megatron.version import megatron_info  # lazy: import cost (its probe)

    return megatron_info().version


def report(model: ModelFacts, parallel: Parallel, frameworks: list[str], strict: bool,
           version: str | None) -> dict[str, Any]:
    """Every framework's verdicts, as the JSON the command prints."""
    out: dict[str, Any] = {"model": model.name, "kinds": list(model.kinds), "layout": vars(parallel), "frameworks": {}}
    for key in frameworks:
        used = version or (_installed_megatron_core() if key == MEGATRON else None) or MEGATRON_CORE[key] or "0.16"
        verdicts = offline_verdicts(key, model, parallel, strict=strict, version=used)
        out["frameworks"][key] = {
            "title": FRAMEWORKS[key].title, "megatron_core": used,
            "passes": {name: {"outcome": v.outcome, "said": v.said(),
                              "reasons": [{"why": r.why, "change": r.change} for r in v.reasons]}
                       for name, v in verdicts.items()}}
    return out


def text_of(result: dict[str, Any]) -> str:
    layout = result["layout"]
    sizes = ", ".join(f"{name.upper()} = {layout[name]}" for name in ("tp", "cp", "pp", "ep", "vpp")
                      if layout[name] not in (None, 1))
    extra = [f"CP cut {layout['cp_layout']}"] if layout["cp"] > 1 else []
    extra += ["SP"] if layout["sp"] else []
    extra += ["routing replay"] if layout["routing_replay"] else []
    lines = [f"model: {result['model']}" + (f": {', '.join(result['kinds'])}" if result["kinds"] else ""),
             f"layout: {sizes or 'one rank'}" + (f" ({', '.join(extra)})" if extra else "")]
    for framework in result["frameworks"].values():
        lines.append(f"{framework['title']} (megatron-core {framework['megatron_core']}):")
        alike: dict[str, list[str]] = {}  # passes with the same verdict said once
        for name, verdict in framework["passes"].items():
            alike.setdefault(verdict["said"], []).append(name)
        lines += [f"  {', '.join(names)}: {said}" for said, names in alike.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    items: dict[str, Any] = {}
    if args.hf_config is not None:
        model = hf_model(args.hf_config)
    else:
        model, items = args_model(args.megatron_args)
    fields = dict(model.fields)
    fields.update(_field_value(word) for word in args.set)
    model = ModelFacts(model.name, fields, model.gated_delta_net, model.sparse_attention, model.vision, model.kinds)
    parallel = layout_of(items, {"tp": args.tp, "cp": args.cp, "pp": args.pp, "ep": args.ep, "vpp": args.vpp})
    frameworks = [args.framework] if args.framework else list(FRAMEWORKS)
    with warnings.catch_warnings():  # megatron-core's import-time advice (no Transformer Engine, no Apex): not ours
        warnings.simplefilter("ignore")
        result = report(model, parallel, frameworks, args.strict or settings.strict(), args.megatron_core)
    print(json.dumps(result, indent=2) if args.json else text_of(result))
    shared = all(p["outcome"] == SHARED for f in result["frameworks"].values() for p in f["passes"].values())
    return OK if shared else PROBLEM
