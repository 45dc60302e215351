"""Every order of import / apply / revert / re-apply, each in a fresh process (when the target
module is imported is the point), for a real megatron-core target (`ddp_hooks` on
DistributedDataParallel.enable_forward_pre_hook) and a stand-in slime module (`train_reentry`).

The child (this file run as a script) records what it sees after each step; the parent compares
it with a model of the expected state: one wrapper layer at most, exact revert, captured
references following the state, statuses pending/applied/skipped.
"""
from __future__ import annotations

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
KINDS = {
    "mcore": {
        "patch": "ddp_hooks",
        "module": "megatron.core.distributed.distributed_data_parallel",
        "target": "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.enable_forward_pre_hook",
    },
    "slime": {
        "patch": "train_reentry",
        "module": "slime.backends.megatron_utils.model",
        "target": "slime.backends.megatron_utils.model:train",
    },
}


# ----------------------------------------------------------------------------- child side


def _child(kind: str, steps: list[str]) -> None:
    import importlib

    import wrapt

    from megatron_rl_patches.integrations import all_patches
    from megatron_rl_patches.patching.registry import Registry

    spec = KINDS[kind]

    def spy(wrapped, instance, args, kwargs):
        return "spy"

    # The real records, every wrapper resolved to the spy: this checks the machinery, not the wrappers.
    registry = Registry(all_patches, resolve=lambda ref: spy)

    class Probe:
        def __getattr__(self, name):  # the original enable_forward_pre_hook reads self.use_forward_hook
            raise LookupError("original")

    def module():
        return sys.modules.get(spec["module"])

    if kind == "mcore":

        def do_import():
            importlib.import_module("megatron.core.distributed")  # how users reach the class

        def raw():  # what `vars(cls)[name]` holds: the function, or our wrapper around it
            return vars(module().DistributedDataParallel)["enable_forward_pre_hook"]

        def attribute():
            return module().DistributedDataParallel.enable_forward_pre_hook

        def call(fn):
            try:
                return fn(Probe())
            except LookupError:
                return "original"

    else:

        def do_import():
            importlib.import_module(spec["module"])

        def raw():
            return vars(module())["train"]

        attribute = raw

        def call(fn):
            return fn(1, [], None, None, None, 1, [4])

    def ours(entry):
        return getattr(getattr(entry, "_self_wrapper", None), "__mrp_key__", None) is not None

    def innermost(obj):
        while ours(obj):
            obj = obj.__wrapped__
        return obj

    original = None
    captured = []  # (was_wrapped_when_captured, reference): like `from module import name`
    observations = []
    for step in steps:
        if step == "import":
            do_import()
        elif step == "apply":
            for _ in range(3):
                registry.apply(only=spec["patch"])
        elif step == "revert":
            for _ in range(2):
                registry.revert()
        seen = {"step": step, "status": {s.target: s.status for s in registry.applied()}[spec["target"]]}
        if module() is not None:
            obj = raw()
            if original is None:
                original = innermost(obj)
            captured.append((ours(obj), obj))
            seen.update(
                layers=sum(ours(entry) for entry in wrapt.wrapper_chain(obj)),
                inner_is_original=innermost(obj) is original,
                raw_is_original=obj is original,
                behaves=call(attribute()),
                captured=[[was, call(ref)] for was, ref in captured],
            )
        observations.append(seen)
    print(json.dumps(observations))


# ----------------------------------------------------------------------------- parent side


def expected(steps):
    active = imported = False
    wrapped_captures = []
    out = []
    for step in steps:
        if step == "import":
            imported = True
        elif step == "apply":
            active = True
        elif step == "revert":
            active = False
        if active:
            status = "applied" if imported else "pending"
        else:
            status = "skipped"
        seen = {"step": step, "status": status}
        if imported:
            wrapped_captures.append(active)
            seen.update(
                layers=int(active),
                inner_is_original=True,
                raw_is_original=not active,
                behaves="spy" if active else "original",
                # a reference captured while wrapped follows the switch; one captured unwrapped
                # is the original function forever (the documented limit of monkeypatching)
                captured=[[was, "spy" if (was and active) else "original"] for was in wrapped_captures],
            )
        out.append(seen)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fake_slime_writer):
    """Start every ordering of both kinds at once (each import of megatron takes seconds)."""
    root = fake_slime_writer(tmp_path_factory.mktemp("fake_slime"))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), environ.get("PYTHONPATH")]))
    environ["PYTHONWARNINGS"] = "ignore"
    procs = {
        (kind, steps): subprocess.Popen(
            [sys.executable, __file__, kind, *steps],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kind in KINDS
        for steps in ORDERINGS
    }
    results = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[key] = (proc.returncode, out, err)
    return results


@pytest.mark.parametrize("steps", ORDERINGS, ids=lambda s: "-".join(s))
@pytest.mark.parametrize("kind", list(KINDS))
def test_ordering(runs, kind, steps):
    code, out, err = runs[(kind, steps)]
    assert code == 0, err
    observed = json.loads(out.strip().splitlines()[-1])
    assert observed == expected(steps)


def test_expected_model_sanity():
    # The model itself: a patch that lands at import shows one layer right after the import.
    model = expected(("apply", "import", "revert", "apply", "revert"))
    assert model[1]["status"] == "applied" and model[1]["layers"] == 1
    assert model[2]["captured"] == [[True, "original"], [False, "original"]]
    assert model[3]["captured"][0] == [True, "spy"] and model[3]["captured"][1] == [False, "original"]
    assert model[4]["raw_is_original"] is True


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2:])
