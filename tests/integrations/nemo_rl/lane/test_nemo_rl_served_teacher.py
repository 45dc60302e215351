"""A vLLM-served teacher as NeMo-RL 7ea279ab's distillation teacher (`ServedTeacherPolicy`): a real
vLLM CPU server (the served lane's build, MRP_VLLM_PYTHON) serves a tiny random Qwen3 of the lane
student's vocabulary with `--max-logprobs 64`; the policy answers NeMo-RL's `get_topk_logits(data,
k=64)` from NeMo-RL's driver process, checked against transformers' float64 forward; its
`teacher_topk_logits` / `teacher_topk_indices` then feed NeMo-RL's own Megatron driver with its real
`LossPostProcessor` and `DistillationLossFn` on `nemo_rl_topk_kd` at TP=1 and TP=2 (sequence
parallel) over gloo, loss and gradients against a float64 reference. Beside it a vLLM pooling
server of the same checkpoint with the teacher's head on the driver (`head=DIR`): K = 100, above
what the generate server allows, through the same route; and the whole vocabulary: the policy
with `full_vocabulary=True` adds the served hidden states to NeMo-RL's batch, and the loss
`served_teacher_in_setup` builds (`WholeVocabularyDistillationLossFn`) takes them through the
teacher's head on the student's ranks, against a float64 KL over NeMo-RL's own logits. What cannot run on CPU
(NeMo-RL's Ray placement and its real Policy workers, and with them `distillation.setup()`) is
not run here."""
from __future__ import annotations

import copy
import os

import pytest

pytest.importorskip("nemo_rl", reason="NeMo-RL's source is not on the path: run `make test-nemo NEMO_RL=...`")
pytestmark = [pytest.mark.nemo_rl, pytest.mark.multirank, pytest.mark.slow]

import nemo_kit as kit  # noqa: E402
import served_ranks as ranks  # noqa: E402
import torch  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

VLLM_PYTHON = os.environ.get("MRP_VLLM_PYTHON", "")
K = 64  # NeMo-RL's distillation.topk_logits_k default, above vLLM's default --max-logprobs (20)
HEAD_K = 100  # through the head: any K below the vocabulary, whatever the server's --max-logprobs
# vLLM's pooling runner serving a causal LM's final hidden states per token (CONTEXT §19)
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')
API_KEY = "nemo-lane-key"
LAYOUTS = [{"name": "tp1", "tp": 1, "sp": False}, {"name": "tp2-sp", "tp": 2, "sp": True}]
SERVED_TOL = 1e-4  # the engine's float32 against transformers' float64
LOSS_TOL = 1e-5  # the fused float32 loss against the float64 reference
GRAD_TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3 of the lane student's vocabulary (kit.VOCAB) and transformers' model of it."""
    if not VLLM_PYTHON:
        pytest.skip("*** SKIPPED nemo-rl served teacher: MRP_VLLM_PYTHON names no vLLM interpreter "
                    "(make test-nemo passes .lanes/vllm's once `make test-served` has built it) ***")
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer

    root = tmp_path_factory.mktemp("nemo-served")
    model = save_tiny_hf(root / "qwen3", "qwen3", seed=3, hidden_size=64, head_dim=32, intermediate_size=96,
                         max_position_embeddings=256, vocab_size=kit.VOCAB)
    save_word_tokenizer(root / "qwen3", kit.VOCAB)
    return root, model


def _server(checkpoint, log: str, extra: tuple[str, ...] = ()):
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root, _ = checkpoint
    return vllm_server(VLLM_PYTHON, root / "qwen3", root / log, max_model_len=256, max_logprobs=K,
                       api_key=API_KEY, extra=extra)


@pytest.fixture(scope="module")
def served(checkpoint):
    """The generate server (`--max-logprobs 64`) and the pooling server of the same checkpoint."""
    with _server(checkpoint, "vllm.log") as server, _server(checkpoint, "pooling.log", POOLING) as pooled:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
            yield server.url, pooled.url


def _get_topk_logits(policy, k: int, **fields):
    """NeMo-RL's distillation calls on its teacher: prepare, `get_topk_logits(train_data, k, timer)`,
    offload; the caller's batch untouched (`fields`: batch fields beside the tensors)."""
    from nemo_rl.utils.timer import Timer

    data = kit.batch(seed=5)
    data.update(fields)
    before = {key: value.clone() for key, value in data.items() if isinstance(value, torch.Tensor)}
    policy.prepare_for_lp_inference()
    out = policy.get_topk_logits(data, k=k, timer=Timer())
    policy.offload_after_refit()
    assert all(torch.equal(before[key], data[key]) for key in before)
    return out["topk_logits"], out["topk_indices"]


@pytest.fixture(scope="module")
def vocab(served, checkpoint):
    """The whole-vocabulary route's batch fields: `get_topk_logits` of a full-vocabulary policy adds
    `teacher_hidden_states` to NeMo-RL's batch (its other tensors untouched)."""
    from nemo_rl.utils.timer import Timer

    from megatron_rl_patches.integrations.nemo_rl import served_teacher_policy

    _, pooled = served
    root, _ = checkpoint
    policy = served_teacher_policy(pooled, top_k=K, head=root / "qwen3", full_vocabulary=True)
    data = kit.batch(seed=5)
    before = {key: value.clone() for key, value in data.items()}
    out = policy.get_topk_logits(data, k=K, timer=Timer())
    assert all(torch.equal(before[key], data[key]) for key in before)
    assert data["teacher_hidden_states"] is out["teacher_hidden_states"]
    return {"states": out["teacher_hidden_states"], "topk": (out["topk_logits"], out["topk_indices"]),
            "head": str(root / "qwen3")}


def test_full_vocabulary_policy_adds_the_served_hidden_states_as_transformers_computes_them(checkpoint, vocab):
    _, model = checkpoint
    data = kit.batch(seed=5)
    states = vocab["states"]
    assert states.shape == (kit.BATCH, kit.SEQ, model.config.hidden_size)
    worst, control = 0.0, float("inf")
    for i, first, end in _scored(data):
        with torch.no_grad():
            hidden = model.model(data["input_ids"][i:i + 1, :end + 1]).last_hidden_state[0].double()
        worst = max(worst, float((states[i, first:end].double() - hidden[first:end]).abs().max()))
        control = min(control, float((states[i, first:end].double() - hidden[first + 1:end + 1]).abs().max()))
        assert not bool(states[i, :first].any()) and not bool(states[i, end:].any())  # rows no loss reads
    print(f"served hidden states vs transformers: {worst:.2e} (one position off: {control:.2e})")
    assert worst <= SERVED_TOL and control > kit.CONTROL


def hints(seed: int = 7) -> list[list[int]]:
    """Each sample's privileged context: ids of the teacher's vocabulary (sample 1's as text)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, kit.VOCAB, (4 + i,), generator=gen).tolist() for i in range(kit.BATCH)]


@pytest.fixture(scope="module")
def teachers(served, checkpoint):
    """The served teacher's top-k both ways: prompt log-probs (K = 64) and hidden states through
    the head (K = 100); and a privileged teacher (`context="hint"`: each sample's NeMo-RL batch
    field, one of them text through the teacher's tokenizer) on the generate server."""
    from megatron_rl_patches.integrations.nemo_rl import served_teacher_policy

    url, pooled = served
    root, _ = checkpoint
    fields = [" ".join(f"t{i}" for i in hint) if sample == 1 else hint for sample, hint in enumerate(hints())]
    privileged = served_teacher_policy(url, top_k=K, context="hint", tokenizer=root / "qwen3")
    return {"logprobs": _get_topk_logits(served_teacher_policy(url, top_k=K), K),
            "head": _get_topk_logits(served_teacher_policy(pooled, top_k=HEAD_K, head=root / "qwen3"), HEAD_K),
            "privileged": _get_topk_logits(privileged, K, hint=fields)}


def _scored(data) -> list[tuple[int, int, int]]:
    """(sample, first position, end position) of the rows the loss reads: from the position before
    the first token_mask token up to the one before the last token."""
    rows = []
    for i, length in enumerate(data["input_lengths"].tolist()):
        first = int(torch.nonzero(data["token_mask"][i, 1:length]).flatten()[0]) + 1
        rows.append((i, first - 1, length - 1))
    return rows


def test_a_privileged_teacher_scores_each_samples_context_then_its_response_as_transformers_float64(
        checkpoint, teachers):
    """The privileged rows at the student's response positions equal transformers' float64 on
    hint + response; controls (no context, the hint rolled by one token) miss by far more."""
    _, model = checkpoint
    values, ids = teachers["privileged"]
    data = kit.batch(seed=5)
    reference = copy.deepcopy(model).double()

    def rows(context: list[int], response: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = reference(torch.tensor([context + response.tolist()])).logits[0].double()
        return torch.log_softmax(logits, -1)[len(context) - 1:-1].gather(-1, chosen)

    worst, control = 0.0, float("inf")
    for (i, first, end), hint in zip(_scored(data), hints()):
        response, chosen, got = data["input_ids"][i, first + 1:end + 1], ids[i, first:end], values[i, first:end]
        worst = max(worst, float((got.double() - rows(hint, response, chosen)).abs().max()))
        own = data["input_ids"][i, :first + 1].tolist()
        for other in (own, hint[1:] + hint[:1]):
            control = min(control, float((got.double() - rows(other, response, chosen)).abs().max()))
    print(f"privileged served top-{K} vs transformers float64 on hint + response: {worst:.2e} (controls: "
          f"{control:.2e})")
    assert worst <= SERVED_TOL and control > 1e-2


@pytest.mark.parametrize("route,k", [("logprobs", K), ("head", HEAD_K)])
def test_get_topk_logits_answers_from_the_server_as_transformers_float64(checkpoint, teachers, route, k):
    _, model = checkpoint
    values, ids = teachers[route]
    data = kit.batch(seed=5)
    assert values.shape == ids.shape == (kit.BATCH, kit.SEQ, k)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    reference = copy.deepcopy(model).double()
    worst, control = 0.0, float("inf")
    for i, first, end in _scored(data):
        with torch.no_grad():
            logits = reference(data["input_ids"][i:i + 1, :end + 1]).logits[0].double()
        logprobs = torch.log_softmax(logits, -1)  # position s predicts token s + 1
        expected = logprobs[first:end].gather(-1, ids[i, first:end])
        worst = max(worst, float((values[i, first:end].double() - expected).abs().max()))
        # the served ids are the top-k: none below transformers' k-th value
        kth = logprobs[first:end].topk(k, -1).values[:, -1]
        assert bool((expected.min(-1).values >= kth - SERVED_TOL).all())
        # negative control: the same comparison one position off fails
        off = logprobs[first + 1:end + 1].gather(-1, ids[i, first:end])
        control = min(control, float((values[i, first:end].double() - off).abs().max()))
    print(f"served top-{k} ({route}) vs transformers float64: {worst:.2e} (one position off: {control:.2e})")
    assert worst <= SERVED_TOL and control > kit.CONTROL
    assert float(values.double().exp().sum(-1).max()) <= 1 + 1e-6  # whole-vocabulary log-probs: a tail is left


def test_nemo_rls_distillation_step_with_the_served_teacher_equals_float64_at_tp1_and_tp2(teachers, vocab):
    results = run_multirank(ranks.served_world, 2, LAYOUTS, teachers, vocab, timeout=1500)
    for rank, outs in enumerate(results):
        for out in outs:
            print(f"rank {rank}: {out}")
            assert out["loss"] > 0 and abs(out["loss"] - out["float64"]) <= LOSS_TOL, out
            assert out["grad_err"] <= GRAD_TOL and out["grad_scale"] > kit.CONTROL, out
            # negative control: the served rows one position later are far from the step's loss
            assert abs(out["control"] - out["loss"]) > kit.CONTROL, out
    assert {(out["route"], out["layout"], out["kl_type"]) for out in results[0]} == {
        (route, layout["name"], kl) for route in (*teachers, "vocab") for layout in LAYOUTS for kl in ranks.KL_TYPES}


def test_a_privileged_context_past_the_servers_max_model_len_is_refused_before_sending(served):
    from megatron_rl_patches.integrations.nemo_rl import served_teacher_policy
    from megatron_rl_patches.teachers import ServedTeacherRefusal

    url, _ = served
    policy = served_teacher_policy(url, top_k=K, context="hint")
    long = [[5] * (300 if i == 2 else 3) for i in range(kit.BATCH)]  # sample 2: 300 + its 4 response ids
    with pytest.raises(ServedTeacherRefusal, match=r"sample 2 has \d+ ids, over .* max model length 256"):
        _get_topk_logits(policy, K, hint=long)
