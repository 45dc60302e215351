"""slime's fused route runs the log-prob processor and the top-k processor (two ops) in one output
processor (`with_topk`): on a real tiny GPTModel the row mask is selected once for the three ops
(one host sync, one tensor-parallel check), the scalar temperature checked once by each op (the
processor call adds no check of its own), and the results equal the two processors run on their own."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import log_prob_output_processor, topk_output_processor
from megatron_rl_patches.ops import _checks, _rows
from megatron_rl_patches.processors.combined import with_topk

pytestmark = pytest.mark.megatron


def _gpt(megatron_cpu):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    return GPTModel(config=megatron_cpu.config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16)


def _counted(monkeypatch, owner, name, counts):
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)


def test_with_topk_selects_rows_once_and_checks_the_temperature_once_per_op(
        megatron_cpu, clean_patch_state, monkeypatch):
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = _gpt(megatron_cpu)
    batch = megatron_cpu.batch(seed=3)
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    rows = torch.zeros(2, 16, dtype=torch.bool)
    rows[0, 5:12], rows[1, 9:] = True, True
    options = {"temperature": 0.7}
    log_prob = log_prob_output_processor(with_entropy=True, **options)
    both = with_topk(log_prob, 3, options, {})
    counts: dict[str, int] = {}
    _counted(monkeypatch, _rows, "_selected", counts)  # each selection of a mask: a host sync, a TP check
    _counted(monkeypatch, _checks, "check_scalar_temperature", counts)
    with torch.no_grad():
        got = model(*args, labels=batch["labels"], output_processor=both, output_processor_context={"row_mask": rows})
    # three ops (log-probs, top-k ids, top-k log-probs), each checking τ once; nothing else checks it
    assert counts == {"_selected": 1, "check_scalar_temperature": 3}, counts

    counts.clear()
    with torch.no_grad():
        want = model(*args, labels=batch["labels"], output_processor=log_prob,
                     output_processor_context={"row_mask": rows})
        want.update(model(*args, output_processor=topk_output_processor(k=3, **options),
                          output_processor_context={"row_mask": rows}))
    assert counts["_selected"] == 2  # without with_topk: one selection per processor call
    assert got.keys() == want.keys() == {"log_probs", "entropy", "topk_ids", "topk_log_probs", "tail"}
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert bool((got["tail"][~rows] == 0).all())
