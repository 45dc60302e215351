"""The invariant mode's switch: the op argument wins, then MEGATRON_RL_PATCHES_INVARIANT (a bad value
is a ValueError naming it), then a model config's batch_invariant_mode; the processors read the
config; what the mode refuses is refused by name."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.ops.invariance import VARIABLE, resolve_for_vocab, resolve_invariant
from megatron_rl_patches.testing.invariance import counting_invariant_calls


@pytest.mark.parametrize("text, expected", [("1", True), ("TRUE", True), (" on ", True), ("0", False), ("off", False),
                                            ("", False), (None, False)])
def test_the_setting_is_read_with_its_words(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, text)
    assert resolve_invariant(None) is expected


def test_a_given_environment_is_read_instead_of_the_process_one(monkeypatch):
    from megatron_rl_patches.ops.invariance import environment_invariant

    monkeypatch.setenv(VARIABLE, "1")
    assert environment_invariant({}) is None and environment_invariant({VARIABLE: "off"}) is False
    monkeypatch.delenv(VARIABLE)
    assert environment_invariant({VARIABLE: "on"}) is True and environment_invariant() is None


def test_argument_beats_setting_beats_config(monkeypatch):
    on = SimpleNamespace(batch_invariant_mode=True)
    monkeypatch.delenv(VARIABLE, raising=False)
    assert resolve_invariant(None, on) is True
    assert resolve_invariant(None, SimpleNamespace(batch_invariant_mode=False)) is False
    assert resolve_invariant(None, object()) is False  # a config without the attribute
    assert resolve_invariant(False, on) is False
    monkeypatch.setenv(VARIABLE, "0")
    assert resolve_invariant(None, on) is False  # the setting's explicit "off" wins over the config
    monkeypatch.setenv(VARIABLE, "1")
    assert resolve_invariant(False) is False and resolve_invariant(None) is True


def test_bad_values_are_refused_by_name(monkeypatch):
    monkeypatch.setenv(VARIABLE, "maybe")
    with pytest.raises(ValueError, match=VARIABLE):
        ops.log_probs_and_entropy(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long))
    monkeypatch.setenv(VARIABLE, "y" * 40 + "z" * 20)  # a long value: its first 40 characters quoted
    with pytest.raises(ValueError, match=f"{VARIABLE}='{'y' * 40}' is not a switch"):
        resolve_invariant(None)
    monkeypatch.delenv(VARIABLE)
    with pytest.raises(TypeError, match="invariant"):
        ops.lm_head_log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long),
                                          invariant="yes")


def test_the_setting_switches_the_ops_on(monkeypatch):
    """With the setting on, a default call runs the invariant code (counted: the two modes' bits
    may coincide on some CPU) and gives the invariant call's bits."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(100, 64, generator=g), torch.randn(3000, 64, generator=g) / 8
    tokens = torch.randint(0, 3000, (100,), generator=g)
    monkeypatch.delenv(VARIABLE, raising=False)
    explicit = ops.lm_head_log_probs_and_entropy(h, w, tokens, invariant=True)[0]
    with counting_invariant_calls() as unset:
        ops.lm_head_log_probs_and_entropy(h, w, tokens)
    assert unset.count == 0, unset  # unset: the default mode
    monkeypatch.setenv(VARIABLE, "1")
    with counting_invariant_calls() as on:
        got = ops.lm_head_log_probs_and_entropy(h, w, tokens)[0]
    assert on.count > 0 and torch.equal(got, explicit), on


def test_the_setting_switches_every_op(monkeypatch):
    """Every vocabulary op called with invariant=None follows the setting: "1" runs its invariant
    code and gives its invariant call's bits, "0" runs none of it and gives its default call's
    (the code counted: the two modes' bits may coincide on some CPU)."""
    from test_invariant_rows import _ops, _rows, _weight  # this folder's cases (on sys.path: conftest.py)

    weight, rows = _weight(torch.float32), _rows(40, 7, torch.float32)

    def outputs(calls, op):
        out = calls[op](*rows)
        return out if isinstance(out, tuple) else (out,)

    for op in _ops(weight, None):
        explicit = {inv: outputs(_ops(weight, None, inv), op) for inv in (True, False)}
        for text, inv in (("1", True), ("0", False)):
            monkeypatch.setenv(VARIABLE, text)
            with counting_invariant_calls() as calls:
                got = outputs(_ops(weight, None, None), op)
            assert all(torch.equal(a, b) for a, b in zip(got, explicit[inv], strict=True)), (op, text)
            assert (calls.backend > 0) is inv and (calls.count > 0) is inv, (op, text, calls)


def test_lm_head_divergence_refuses_the_mode_by_name_and_warns_under_the_setting(monkeypatch, caplog):
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(4, 8, generator=g), torch.randn(16, 8, generator=g)
    with pytest.raises(ValueError, match=r"lm_head_divergence\(invariant=True\).*lm_head_topk_logprobs"):
        ops.lm_head_divergence(h, w, h, w, invariant=True)
    monkeypatch.setenv(VARIABLE, "1")
    from megatron_rl_patches._log import forget_warnings

    forget_warnings()
    with caplog.at_level("WARNING", logger="megatron_rl_patches"):
        value = ops.lm_head_divergence(h, w, h, w)
    assert torch.allclose(value, torch.zeros(4), atol=1e-6)
    assert "no invariant mode" in caplog.text


def test_vocabularies_beyond_the_fixed_point_range_are_refused():
    from megatron_rl_patches.ops.invariance import MAX_VOCAB, check_vocab

    check_vocab(MAX_VOCAB, "log_probs_and_entropy")  # 2^19 − 1: test_invariant_vocab_limit.py serves it
    with pytest.raises(ValueError, match=r"log_probs_and_entropy\(invariant=True\).*invariant=False"):
        check_vocab(MAX_VOCAB + 1, "log_probs_and_entropy")
    # through the switch: the op named; the default mode takes any vocabulary
    assert resolve_for_vocab(False, MAX_VOCAB + 1, "topk_logprobs") is False
    with pytest.raises(ValueError, match=r"^topk_logprobs\(invariant=True\)"):
        resolve_for_vocab(True, MAX_VOCAB + 1, "topk_logprobs")


def test_processors_read_the_config(monkeypatch):
    """log_prob_output_processor with a config whose batch_invariant_mode is set (megatron-core refuses
    to build a model with it on CPU: the attribute is set on a config object) runs the invariant op."""
    from megatron_rl_patches.processors.heads import log_prob_output_processor, topk_output_processor

    monkeypatch.delenv(VARIABLE, raising=False)
    g = torch.Generator().manual_seed(2)
    seq, batch, hidden, vocab = 50, 2, 32, 3000
    states = torch.randn(seq, batch, hidden, generator=g)
    layer = torch.nn.Linear(hidden, vocab, bias=False)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    flat = states.reshape(seq * batch, hidden)
    tokens = labels.t().reshape(-1)
    want = {mode: ops.lm_head_log_probs_and_entropy(flat, layer.weight, tokens, invariant=mode)[0].detach()
            for mode in (True, False)}
    for flag in (True, False):
        with counting_invariant_calls() as calls:  # the path, on every CPU (the modes' bits may coincide)
            out = log_prob_output_processor()(hidden_states=states, output_layer=layer, labels=labels,
                                              config=SimpleNamespace(batch_invariant_mode=flag))
        got = out["log_probs"].detach().t().reshape(-1)
        assert torch.equal(got, want[flag])
        assert (calls.count > 0) is flag, (flag, calls)
    ids = topk_output_processor(k=3)(hidden_states=states, output_layer=layer,
                                     config=SimpleNamespace(batch_invariant_mode=True))["topk_log_probs"]
    direct = ops.lm_head_topk_logprobs(flat, layer.weight,
                                       ops.lm_head_topk_ids(flat, layer.weight, 3, invariant=True), invariant=True)[0]
    assert torch.equal(ids.detach().transpose(0, 1).reshape(-1, 3), direct.detach())
