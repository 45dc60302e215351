"""Issue 73 item 5: `k` is checked once on its way down. slime's MEGATRON_RL_PATCHES_OPD_K is
checked where the settings are parsed; the top-k processor and the fused head's top-k op take
that checked k as it is (no second positive-int check); a plain k given to the public processor
or op directly is still checked there, with the same error naming `k`."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.ops import lm_head, scoring_plan
from megatron_rl_patches.processors import heads

H, V, T = 16, 300, 12


def _counting(monkeypatch) -> list:
    """Every positive-int check of `k` from here on (the processor's and the ops')."""
    seen: list = []
    original = scoring_plan.positive_int

    def counted(name, value, meaning=""):
        if name == "k":
            seen.append(value)
        return original(name, value, meaning)

    monkeypatch.setattr(scoring_plan, "positive_int", counted)  # the one check K's goes through (`checked_k`)
    return seen


def _head(k):
    """The top-k processor built with `k`, run on a small head: its selected ids [1, T, k]."""
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(T, 1, H, generator=g)
    return heads.topk_output_processor(k=k)(hidden_states=hidden, output_layer=layer)["topk_ids"]


def test_the_settings_k_reaches_the_op_checked_once(monkeypatch):
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings

    environ = {"MEGATRON_RL_PATCHES_OPD_TEACHERS": "snapshot:/ckpt", "MEGATRON_RL_PATCHES_OPD_K": "8"}
    settings = opd_settings(environ)
    assert settings is not None and isinstance(settings.k, scoring_plan.TopK) and settings.k == 8
    seen = _counting(monkeypatch)
    ids = _head(settings.k)
    assert ids.shape == (1, T, 8)
    assert seen == []  # before: the processor's check, then the op's (two more of one parsed k)


def test_a_plain_k_is_checked_once_where_it_enters(monkeypatch):
    seen = _counting(monkeypatch)
    assert _head(5).shape == (1, T, 5)
    assert seen == [5]  # the processor's; the op inside takes the checked k


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4"])
def test_the_public_entries_still_refuse_a_bad_k_by_name(bad):
    with pytest.raises(ValueError, match="k must be a positive int"):
        heads.topk_output_processor(k=bad)
    with pytest.raises(ValueError, match="k must be a positive int"):
        lm_head.lm_head_topk_ids(torch.randn(T, H), torch.randn(V, H), bad)


def test_the_parser_refuses_a_bad_k_by_its_variable():
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings

    for raw in ("0", "-2", "x"):
        with pytest.raises(ValueError, match="MEGATRON_RL_PATCHES_OPD_K"):
            opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "snapshot:/ckpt", "MEGATRON_RL_PATCHES_OPD_K": raw})

