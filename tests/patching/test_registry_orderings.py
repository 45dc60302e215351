"""Every order of import / apply / revert / re-apply, one fresh process per order (when the target
modules are imported is the point), for every target of every patch in the default registry:
megatron-core's (`ddp_hooks`, `gpt_output_processor`), Megatron-LM's (`train_reentry` on
megatron.training, megatron-core >= 0.17) and slime's (`train_reentry`, `inference_roles`,
`slime_logprobs`, on the stand-in tests/standins/slime).

The child (this file run as a script) records what it sees after each step; the parent compares
it, target by target, with a model of the expected state: one wrapper layer per patch, exact revert,
re-apply, captured references following the state, statuses pending/applied/skipped (one layer per
patch where several patches wrap one target: slime's forward_only).
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.megatron

ORDERINGS = [  # every interleaving of the import with apply < revert < re-apply, then a final revert
    ("import", "apply", "revert", "apply", "revert"),
    ("apply", "import", "revert", "apply", "revert"),
    ("apply", "revert", "import", "apply", "revert"),
    ("apply", "revert", "apply", "import", "revert"),
]
# A target whose module binds another target's attribute at its own import (`from x import f`),
# as slime's loss module does with ppo_utils' function: imported while patched, it holds the
# other target's wrapper (a captured reference) and must not get a second layer.
ALIASES = {
    "slime.backends.megatron_utils.actor:forward_only": "slime.backends.megatron_utils.model:forward_only",
    "slime.backends.megatron_utils.loss:calculate_log_probs_and_entropy":
        "slime.utils.ppo_utils:calculate_log_probs_and_entropy",
    "verl.models.mcore.registry:fused_forward_model_engine":
        "verl.models.mcore.model_forward_fused:fused_forward_model_engine",
    "megatron.core.models.gpt.gpt_model:process_mtp_loss":
        "megatron.core.transformer.multi_token_prediction:process_mtp_loss",
    "megatron.core.models.hybrid.hybrid_model:process_mtp_loss":
        "megatron.core.transformer.multi_token_prediction:process_mtp_loss",
}
# Target modules a lane may lack, and why (anything else failing to import is an error).
MAY_BE_MISSING = {"megatron.training": "megatron.training ships in the megatron-core wheel from 0.17 on",
                  "megatron.core.models.hybrid": "HybridModel ships in megatron-core from 0.18 on",
                  "verl.": "verl is installed only in the verl lane (make test-verl)",
                  "nemo_rl.": "NeMo-RL's source is on the path only in the NeMo-RL lane (make test-nemo)"}


def records():
    from megatron_rl_patches.integrations import all_patches

    return all_patches()


def group_of(patch) -> str:
    """One test per patch and framework: e.g. train_reentry@megatron.training, train_reentry@slime."""
    parts = patch.module.split(".")
    return f"{patch.name}@{'.'.join(parts[:2] if parts[0] == 'megatron' else parts[:1])}"


GROUPS = sorted({group_of(p) for p in records()})


# ----------------------------------------------------------------------------- child side


class _Probe:
    def __getattr__(self, name):  # the original methods read attributes of self first
        raise LookupError("original")


def _child(steps: list[str]) -> None:
    import wrapt

    from megatron_rl_patches.patching.registry import Registry
    from megatron_rl_patches.patching.wrappers import patch_key

    def spy(wrapped, instance, args, kwargs):
        return "spy"

    # The real records, every wrapper resolved to the spy: this checks the machinery, not the wrappers.
    registry = Registry(records, resolve=lambda ref: spy)
    patches = registry.patches()
    names = registry.patch_names()
    modules = list(dict.fromkeys(p.module for p in patches))
    unavailable: dict[str, str] = {}

    def owner_of(patch):
        module = sys.modules.get(patch.module)
        if module is None:
            return None, ""
        path, _, attribute = patch.qualname.rpartition(".")
        owner = functools.reduce(getattr, path.split("."), module) if path else module
        return owner, attribute

    def call(fn, is_method):
        """'spy' when our wrapper is active, else 'original': the originals, called without their
        arguments (or on a probe instance), raise before doing anything, or (verl's
        `fused_forward_model_engine(vision_model=False)`) only build a closure."""
        try:
            out = fn(_Probe()) if is_method else fn()
        except (TypeError, LookupError):
            return "original"
        return out if out == "spy" else "original"  # an original with defaults for every argument

    def ours(entry):
        return patch_key(entry) is not None

    def innermost(obj):
        while ours(obj):
            obj = obj.__wrapped__
        return obj

    originals: dict[str, object] = {}
    captured: dict[str, list] = {p.target: [] for p in patches}  # (wrapped when captured, reference)
    observations = []
    by_target = list({p.target: p for p in reversed(patches)}.values())  # one per target (several may share one)
    for step in steps:
        if step == "import":
            for name in modules:
                try:
                    importlib.import_module(name)
                except ImportError as exc:
                    unavailable[name] = f"{type(exc).__name__}: {exc}"
        elif step == "apply":
            for _ in range(3):
                registry.apply(only=names)
        elif step == "revert":
            for _ in range(2):
                registry.revert()
        status = {s.target: s.status for s in registry.applied()}
        targets = {}
        for patch in by_target:
            seen = {"status": status[patch.target]}
            owner, attribute = owner_of(patch)
            if owner is not None and attribute not in vars(owner):  # an optional target this version lacks
                seen["absent"] = True
            elif owner is not None:
                is_method = isinstance(owner, type)
                obj = vars(owner)[attribute]  # the function, or our wrapper around it
                original = originals.setdefault(patch.target, innermost(obj))
                captured[patch.target].append((ours(obj), obj))
                seen.update(
                    layers=sum(ours(entry) for entry in wrapt.wrapper_chain(obj)),
                    inner_is_original=innermost(obj) is original,
                    raw_is_original=obj is original,
                    behaves=call(getattr(owner, attribute), is_method),
                    captured=[[was, call(ref, is_method)] for was, ref in captured[patch.target]],
                )
            targets[patch.target] = seen
        observations.append({"step": step, "targets": targets})
    print(json.dumps({"unavailable": unavailable, "observations": observations}))


# ----------------------------------------------------------------------------- parent side


def expected(steps, wraps: bool = True, alias: bool = False, records: int = 1):
    """What one target should show after each step. `wraps`: False when the installed version
    provides the feature itself (nothing is wrapped); `alias`: the target's module binds another
    target's attribute at import (see ALIASES); `records`: how many patches wrap the target (slime's
    forward_only: `inference_roles` and `slime_fused`), one layer each."""
    active = imported = bound_wrapped = False
    wrapped_captures = []
    out = []
    for step in steps:
        if step == "import":
            imported = True
            bound_wrapped = alias and active and wraps  # it bound the other target's wrapper
        elif step == "apply":
            active = True
        elif step == "revert":
            active = False
        if active:
            status = "applied" if imported and wraps else ("skipped" if imported else "pending")
        else:
            status = "skipped"
        seen = {"status": status}
        if imported:
            live = active and wraps
            held = live or bound_wrapped  # our wrapper is what the module holds
            wrapped_captures.append(held)
            seen.update(
                # live: one layer per patch; an alias's bound chain after revert: one inert layer is left
                layers=records if live else int(held),
                inner_is_original=True,
                raw_is_original=not held,
                behaves="spy" if live else "original",
                # a reference captured while wrapped follows the switch; one captured unwrapped
                # is the original function forever (the documented limit of monkeypatching)
                captured=[[was, "spy" if (was and live) else "original"] for was in wrapped_captures],
            )
        out.append(seen)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, slime_standin_writer):
    """Start every ordering at once (each import of megatron takes seconds), all patches in each."""
    root = slime_standin_writer(tmp_path_factory.mktemp("slime_standin"))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), environ.get("PYTHONPATH")]))
    environ["PYTHONWARNINGS"] = "ignore"
    procs = {
        steps: subprocess.Popen(
            [sys.executable, __file__, *steps], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for steps in ORDERINGS
    }
    results = {}
    for steps, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[steps] = (proc.returncode, out, err)
    return results


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("steps", ORDERINGS, ids=lambda s: "-".join(s))
def test_ordering(runs, steps, group):
    from megatron_rl_patches.patching.registry import native_version

    code, out, err = runs[steps]
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    patches = [p for p in records() if group_of(p) == group]
    missing = {p.module: result["unavailable"][p.module] for p in patches if p.module in result["unavailable"]}
    for module, error in missing.items():
        reason = next((why for prefix, why in MAY_BE_MISSING.items() if module.startswith(prefix)), None)
        assert reason, f"{module} did not import: {error}"
        pytest.skip(f"{module} is not importable here ({reason}): {error}")
    for patch in patches:
        observed = [{"step": o["step"], **o["targets"][patch.target]} for o in result["observations"]]
        if any(o.get("absent") for o in observed):  # optional and absent here: skipped once imported, never wrapped
            assert patch.optional, patch.target
            model = [{"status": seen["status"]} for seen in expected(steps, wraps=False)]
            assert [o["status"] for o in observed] == [m["status"] for m in model], patch.target
            continue
        sharing = sum(p.target == patch.target for p in records())
        model = expected(steps, wraps=native_version(patch) is None, alias=patch.target in ALIASES, records=sharing)
        assert observed == [{"step": step, **seen} for step, seen in zip(steps, model)], patch.target


def test_every_patch_of_the_default_registry_is_covered():
    from megatron_rl_patches.integrations import default_registry

    names = default_registry().patch_names()
    assert {"ddp_hooks", "train_reentry", "inference_roles", "slime_logprobs", "gpt_output_processor"} <= set(names)
    assert {group.split("@")[0] for group in GROUPS} == set(names)
    targets = {p.target for p in records()}
    assert set(ALIASES) | set(ALIASES.values()) <= targets


def test_expected_model_sanity():
    # The model itself: a patch that lands at import shows one layer right after the import.
    model = expected(("apply", "import", "revert", "apply", "revert"))
    assert model[1]["status"] == "applied" and model[1]["layers"] == 1
    assert model[2]["captured"] == [[True, "original"], [False, "original"]]
    assert model[3]["captured"][0] == [True, "spy"] and model[3]["captured"][1] == [False, "original"]
    assert model[4]["raw_is_original"] is True
    # a version that provides the feature: pending, then skipped at import; never wrapped
    native = expected(("apply", "import", "revert", "apply", "revert"), wraps=False)
    assert [m["status"] for m in native] == ["pending", "skipped", "skipped", "skipped", "skipped"]
    assert {m["layers"] for m in native[1:]} == {0}
    # an alias imported while patched keeps the other target's (inert after revert) wrapper
    alias = expected(("apply", "import", "revert", "apply", "revert"), alias=True)
    assert [m["layers"] for m in alias[1:]] == [1, 1, 1, 1]
    assert [m["behaves"] for m in alias[1:]] == ["spy", "original", "spy", "original"]


if __name__ == "__main__":
    _child(sys.argv[1:])
