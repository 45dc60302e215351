"""`batch_invariant_mode` on the model config reaches every route to the vocabulary ops (issue 64
item 1), each route given the config it should obey — set on a config object (a model cannot be
built with it on CPU): the route's values equal the invariant op's bits; given the default mode it
runs none of the invariant code and the invariant mode runs it (the negative control, counted:
the two modes' bits may coincide on some CPU's kernels). The fused routes' own tests
are test_slime_fused_invariant.py and the verl lane's test_verl_invariant.py; teachers beside the
student: test_slime_fused_invariant.py; verl's top-k loss: the verl lane's test_verl_topk.py."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.ops.kept_set import lm_head_kept_log_probs
from megatron_rl_patches.testing.invariance import counting_invariant_calls

T, H, V = 96, 64, 5000


def _config(on: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(batch_invariant_mode=on)


def _student(on: bool) -> list:
    """A model chunk as slime's and verl's callers hand it over: only its config is read."""
    return [types.SimpleNamespace(config=_config(on))]


def _logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(T, V, generator=g), torch.randint(0, V, (T,), generator=g)


def _by_mode(run):
    """`run(on)` for the invariant mode on and off: (values, the invariant code's calls) by mode."""
    values, calls = {}, {}
    for on in (True, False):
        with counting_invariant_calls() as calls[on]:
            values[on] = run(on)
    return values, calls


def _apart(default: torch.Tensor, invariant: torch.Tensor, calls: dict) -> None:
    """The negative control: the invariant code ran in the invariant mode only; values close."""
    assert calls[True].count > 0 and calls[False].count == 0, calls
    torch.testing.assert_close(default, invariant, rtol=0, atol=1e-5)


def test_token_log_probs_follows_the_config_it_is_given(monkeypatch):
    from megatron_rl_patches.inference.forward import token_log_probs

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    logits, targets = _logits()
    got, calls = _by_mode(lambda on: token_log_probs(config=_config(on))(logits[None], targets[None])["log_probs"][0])
    want = ops.log_probs_and_entropy(logits, targets, invariant=True)[0]
    assert torch.equal(got[True], want)
    _apart(got[False], got[True], calls)


def _slimes_callback(tokens):
    """slime's `get_log_probs_and_entropy` as far as the adapter sees it: the [1, T, V] logits it is
    handed, squeezed, scaled by the temperature and made contiguous, then the adapter."""
    from megatron_rl_patches.integrations.slime.logprobs import calculate_log_probs_and_entropy

    def get_log_probs_and_entropy(logits, **_):
        return calculate_log_probs_and_entropy((logits.squeeze(0) / 1.0).contiguous(), tokens, None,
                                               with_entropy=True)

    return get_log_probs_and_entropy


def test_slimes_log_prob_adapter_follows_the_students_config(monkeypatch):
    """The mode rides the logits slime's forward_only hands its callback (no context holds it):
    the student's config True gives the invariant op's bits, False the default mode's; logits no
    patched step handed over get the setting's mode (unset: the default)."""
    from megatron_rl_patches.integrations.slime.logprobs import student_step_wrapper

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    logits, tokens = _logits(1)
    callback = _slimes_callback(tokens)

    def forward_only(f, args, model):  # slime's caller holding the student: its callback gets the logits
        return f(logits[None], with_entropy=True)

    seen, calls = _by_mode(lambda on: student_step_wrapper(forward_only, None, (callback, None, _student(on)), {}))
    want = ops.log_probs_and_entropy(logits, tokens, with_entropy=True, invariant=True)
    assert torch.equal(seen[True][0][:, 0], want[0]) and torch.equal(seen[True][1], want[1])
    _apart(seen[False][0], seen[True][0], calls)
    unmarked = callback(logits[None])
    assert torch.equal(unmarked[0], seen[False][0])
    assert student_step_wrapper(forward_only, None, (callback, None, _student(True)), {})[0].__class__ is torch.Tensor


@pytest.mark.megatron
def test_slimes_logits_path_in_a_planned_step_carries_the_plans_mode(monkeypatch):
    """A step slime_fused planned but that runs slime's logits path (a plan with `fused=False`, or a
    fallback): the model's logits carry the plan's mode to the adapter; a non-last pipeline stage's
    hidden states stay plain."""
    from megatron_rl_patches.integrations.mode_logits import mode_of
    from megatron_rl_patches.integrations.slime.fused import FusedModel, FusedStep

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    logits, tokens = _logits(2)
    args = types.SimpleNamespace(rollout_temperature=1.0)
    callback = _slimes_callback(tokens)

    def chunk(post_process=True):
        return types.SimpleNamespace(post_process=post_process, forward=lambda **_: logits[None])

    def run(on):
        out = FusedModel(_Callable(chunk()), FusedStep(args, True, False, fused=False, invariant=on))(input_ids=None)
        assert mode_of(out) is on
        return callback(out)

    seen, calls = _by_mode(run)
    want = ops.log_probs_and_entropy(logits, tokens, with_entropy=True, invariant=True)
    assert torch.equal(seen[True][0][:, 0], want[0])
    _apart(seen[False][0], seen[True][0], calls)
    stage = FusedModel(_Callable(chunk(post_process=False)), FusedStep(args, True, False, fused=False, invariant=True))
    assert mode_of(stage(input_ids=None)) is None


class _Callable:
    """A model chunk: its call is its `forward`."""

    def __init__(self, inner):
        self.module = inner

    def __call__(self, **kwargs):
        return self.module.forward(**kwargs)


def test_no_module_holds_the_steps_mode_or_plan_in_a_context_variable():
    """Issue 73 item 5: the step's invariant mode and plan travel as arguments or with the data, never
    in a ContextVar (or a module-level variable named for them)."""
    import ast
    import pathlib

    import megatron_rl_patches

    root = pathlib.Path(megatron_rl_patches.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ContextVar":
                first = node.args[0] if node.args else None
                name = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
                if any(word in name.lower() for word in ("mode", "invariant", "plan")):
                    found.append(f"{path.relative_to(root)}: {name}")
    # none left: the shared-prefix plan's params for one MoE layer's call, once a ContextVar, are handed to the
    # layer's own router for the call (shared_prefix/moe_statistics.py, issue 122)
    assert found == [], f"a ContextVar carries the step's mode or plan: {found}"


def _kept(n_rows: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(n_rows, H, generator=g), torch.randn(V, H, generator=g) / 4
    tokens = torch.randint(0, V, (n_rows,), generator=g)
    ids = torch.randint(0, V, (n_rows, 40), generator=g)
    return hidden, weight, tokens, ids.reshape(-1), torch.arange(n_rows).repeat_interleave(40)


def test_the_kept_set_head_is_row_invariant_in_the_invariant_mode():
    hidden, weight, tokens, ids, rows = _kept(T)
    got, calls = _by_mode(lambda on: lm_head_kept_log_probs(hidden, weight, tokens, ids, rows, invariant=on))
    whole = got[True]
    alone = [lm_head_kept_log_probs(hidden[r:r + 1], weight, tokens[r:r + 1], ids[rows == r], rows[rows == r] * 0,
                                    invariant=True) for r in (0, 17, T - 1)]
    assert torch.equal(torch.cat(alone), whole[[0, 17, T - 1]])
    _apart(got[False], whole, calls)
    h = hidden.clone().requires_grad_(True)
    lm_head_kept_log_probs(h, weight, tokens, ids, rows, invariant=True).sum().backward()
    h0 = hidden.clone().requires_grad_(True)
    lm_head_kept_log_probs(h0, weight, tokens, ids, rows, invariant=False).sum().backward()
    torch.testing.assert_close(h.grad, h0.grad)  # the default mode's exact gradient


@pytest.mark.megatron
def test_the_kept_set_processor_follows_the_model_config(megatron_cpu, clean_patch_state, monkeypatch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    megatron_rl_patches.apply(only="gpt_output_processor")
    torch.manual_seed(0)
    seq, vocab = 16, 3000
    model = GPTModel(config=megatron_cpu.config(), transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=vocab, max_sequence_length=seq, share_embeddings_and_output_weights=False)
    batch = make_batch(seq_length=seq, vocab_size=vocab, seed=3)
    labels = batch["labels"]
    b = labels.size(0)
    g = torch.Generator().manual_seed(5)
    positions = torch.arange(b * seq).repeat_interleave(30)
    ids = torch.randint(0, vocab, positions.shape, generator=g)
    mask = torch.ones(labels.shape, dtype=torch.bool)
    context = {"kept_ids": ids, "kept_positions": positions, "kept_row_mask": mask}
    seen = {}
    processor = megatron_rl_patches.log_prob_output_processor()

    def spy(**kwargs):
        seen.update(kwargs)
        return processor(**kwargs)

    def run(on):
        model.config.batch_invariant_mode = on  # what megatron-core's config carries on a GPU
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=labels,
                     output_processor=spy, output_processor_context=context)["kept_log_probs"]

    with torch.no_grad():
        out, calls = _by_mode(run)
        hidden = seen["hidden_states"].reshape(seq * b, -1)
        rows = (positions % seq) * b + positions // seq  # [b, s] -> the hidden states' (s, b) rows
        want = lm_head_kept_log_probs(hidden, model.output_layer.weight, labels.t().reshape(-1), ids, rows,
                                      invariant=True)
    assert torch.equal(out[True], want.reshape(seq, b).t())
    _apart(out[False], out[True], calls)


@pytest.mark.megatron
def test_the_mtp_heads_fused_loss_follows_the_model_config(monkeypatch):
    from megatron_rl_patches.processors.mtp_loss import FusedHeadLogits

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    g = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(24, 2, H, generator=g)  # [s, b, h]
    labels = torch.randint(0, V, (2, 24), generator=g)  # [b, s]
    with torch.no_grad():
        got, calls = _by_mode(lambda on: FusedHeadLogits(hidden, layer, None, _config(on)).cross_entropy(labels))
        want = ops.lm_head_log_probs_and_entropy(hidden.reshape(-1, H), layer.weight, labels.t().reshape(-1),
                                                 invariant=True)[0]
    assert torch.equal(got[True], -want.reshape(24, 2).t())
    _apart(got[False], got[True], calls)


@pytest.mark.megatron
def test_slimes_opd_student_buckets_on_the_logits_path_follow_the_students_config(megatron_cpu, monkeypatch):
    from megatron_rl_patches.integrations.megatron.opd.topk_request import IDS
    from megatron_rl_patches.integrations.slime import opd
    from megatron_rl_patches.integrations.slime import rows as slime_rows
    from megatron_rl_patches.integrations.step_mode import student_invariant

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    totals, responses, k = (40, 56), (25, 31), 8
    logits, _ = _logits(4)
    g = torch.Generator().manual_seed(6)
    ids = [torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(r)]) for r in responses]
    batch = {"total_lengths": list(totals), "response_lengths": list(responses), IDS: ids}
    args = types.SimpleNamespace(rollout_temperature=1.0, allgather_cp=False)
    spans = [torch.arange(t - r - 1, t - 1) + start for t, r, start in zip(totals, responses, (0, totals[0]))]
    # slime's per-sample slicing (slime is not installed on this lane; its lane runs slime's own)
    sliced = types.SimpleNamespace(_extract_per_sample=lambda positions, *_: ([positions[s] for s in spans], None))
    monkeypatch.setattr(slime_rows, "slime_loss", lambda: sliced)
    seen, calls = _by_mode(lambda on: opd.student_buckets(args, batch, logits[: sum(totals)][None],
                                                         student_invariant(_student(on))))
    want = ops.topk_logprobs(logits[torch.cat(spans)], torch.cat(ids), invariant=True)
    assert torch.equal(seen[True][0], want[0]) and torch.equal(seen[True][1], want[1])
    _apart(seen[False][0], seen[True][0], calls)
