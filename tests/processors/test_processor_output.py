"""ProcessorOutput is the dict it subclasses for torch's own tools: `torch.load` with its default
weights_only=True reads a saved one back (a plain dict loads; the subclass did not), and torch's
pytree walks into its values (it was one leaf) — while `.device` stays for megatron-core."""
from __future__ import annotations

import io

import torch
from torch.utils import _pytree as pytree

from megatron_rl_patches.processors.output import ProcessorOutput


def _output() -> ProcessorOutput:
    return ProcessorOutput(log_probs=torch.randn(2, 3), entropy=torch.rand(2, 3))


def test_torch_load_with_its_defaults_reads_a_saved_output():
    out = _output()
    buffer = io.BytesIO()
    torch.save(out, buffer)
    buffer.seek(0)
    back = torch.load(buffer)  # weights_only=True
    assert type(back) is ProcessorOutput and back.keys() == out.keys()
    assert all(torch.equal(back[name], out[name]) for name in out)
    assert back.device == torch.device("cpu")


def test_pytree_sees_the_tensors_as_a_dict_does():
    out = _output()
    assert len(pytree.tree_leaves(out)) == len(pytree.tree_leaves(dict(out))) == 2
    doubled = pytree.tree_map(lambda t: t * 2, out)
    assert type(doubled) is ProcessorOutput and torch.equal(doubled["entropy"], out["entropy"] * 2)
    paths = [path for path, _ in pytree.tree_flatten_with_path(out)[0]]
    assert paths == [(pytree.MappingKey("log_probs"),), (pytree.MappingKey("entropy"),)]


def test_registered_once():
    """Importing the module again (as the package's own imports do) registers nothing twice."""
    import importlib

    import megatron_rl_patches.processors.output as module

    importlib.import_module("megatron_rl_patches.processors.output")
    assert torch.serialization.get_safe_globals().count(module.ProcessorOutput) == 1
