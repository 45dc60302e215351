"""`verl_topk_kd`'s served teacher on verl 0.9.1's real teacher loop and distillation loss, against
a real vLLM CPU server (the served lane's build, its own Python 3.11 venv named by MRP_VLLM_PYTHON;
one server for this module): verl's agent-loop worker asks its teacher client
(`compute_teacher_logprobs_single`), which the served teacher answers in verl's rows; verl pads them
into the batch (`_pad_teacher_outputs`) and its Megatron top-k loss (`verl_topk_kd`: the exact tail)
gives losses and gradients equal to float64 from transformers' forward of the same checkpoint.
A privileged teacher (`;context=hint`, verl's non-tensor field) is scored the same way against
transformers' float64 forward of hint + response, at TP=1 and TP=2.
Without MRP_VLLM_PYTHON (`make test` without the served lane) every test here skips, saying why."""
from __future__ import annotations

import asyncio
import os
import types

import pytest
import torch

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = [pytest.mark.verl,
              pytest.mark.skipif(not os.environ.get("MRP_VLLM_PYTHON"),
                                 reason="needs a real vLLM server: MRP_VLLM_PYTHON names vLLM's interpreter "
                                        "(make test-verl passes it when the served lane .lanes/vllm is built)")]

import verl.trainer.distillation.megatron.losses as megatron_losses  # noqa: E402
from verl_kit import nested  # noqa: E402

import megatron_rl_patches  # noqa: E402
from megatron_rl_patches.teachers import ServedTeacherRefusal  # noqa: E402

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"
# the served lane's checkpoint shape (tests/teachers/lane/served_kit.py; `tests` is another package
# in the verl lane's site directory): vLLM's CPU attention serves head sizes 32, 64, ...
API_KEY, MAX_MODEL_LEN, VOCAB = "verl-served-key", 256, 1001
MODEL_SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, max_position_embeddings=MAX_MODEL_LEN,
                   vocab_size=VOCAB)
K = 32  # verl's default distillation topk; the server is started with --max-logprobs 32
PROMPTS, RESPONSES = (5, 9), (14, 7)
PAD = 0  # verl's pad token id here


def launch_server(root):
    """One vLLM server of a tiny random Qwen3 (--max-logprobs 32), started; transformers' model of it."""
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
    from megatron_rl_patches.testing.vllm_server import launch

    directory = root / "qwen3"
    model = save_tiny_hf(directory, "qwen3", seed=5, **MODEL_SHAPE)
    save_word_tokenizer(directory, VOCAB)
    server = launch(os.environ["MRP_VLLM_PYTHON"], directory, root / "vllm.log", max_model_len=MAX_MODEL_LEN,
                    max_logprobs=K, api_key=API_KEY)
    return server, types.SimpleNamespace(model=model, directory=directory)


@pytest.fixture(scope="module")
def served(launched, tmp_path_factory):
    """The module's server (started with the lane's others: conftest's `launched`), ready."""
    from megatron_rl_patches.testing.vllm_server import serving

    server, info = launched.pop(__name__, None) or launch_server(tmp_path_factory.mktemp("verl-served"))
    with serving(server):
        yield types.SimpleNamespace(url=server.url, model=info.model, directory=info.directory)


@pytest.fixture
def entry(served, verl_cpu, monkeypatch):
    """The served teacher named for verl, the API key set, `verl_topk_kd` applied."""
    monkeypatch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
    monkeypatch.setenv(VARIABLE, f"{served.url};engine=vllm")
    megatron_rl_patches.apply(only="verl_topk_kd")
    return served


def manager(loss_mode: str = "forward_kl_topk", topk: int = K, client: object = None) -> object:
    """verl's real teacher client, built from verl's generated trainer config (one teacher)."""
    from omegaconf import OmegaConf
    from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager
    from verl.trainer import config as verl_config

    config = OmegaConf.load(os.path.join(os.path.dirname(verl_config.__file__), "_generated_ppo_megatron_trainer.yaml"))
    config.distillation.enabled = True
    config.distillation.distillation_loss.loss_mode = loss_mode
    config.distillation.distillation_loss.topk = topk
    teacher = config.distillation.teacher_models.teacher_model
    teacher.model_path, teacher.key, teacher.num_replicas, teacher.inference.name = "/unused", "gsm8k", 1, "vllm"
    return AsyncTeacherLLMServerManager(config, {"default": client})


def agent_loop_rows(teacher_client: object, prompt: list[int], response: list[int],
                    fields: dict | None = None) -> tuple:
    """verl's agent-loop worker's own call (`AgentLoopWorker._compute_teacher_logprobs`) on one sample
    (`fields`: the sample's non-tensor batch fields)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = object.__new__(AgentLoopWorker)  # its __init__ starts servers: only what this method reads
    worker.distillation_enabled, worker.teacher_key, worker.teacher_server_manager = True, "data_source", teacher_client
    output = types.SimpleNamespace(multi_modal_data=None, mm_processor_kwargs=None, extra_fields={})
    asyncio.run(worker._compute_teacher_logprobs(output, prompt_ids=prompt, response_ids=response, validate=False,
                                                 sample_kwargs=fields))
    return output.extra_fields["teacher_ids"], output.extra_fields["teacher_logprobs"]


def samples(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    return [(ids(p), ids(r)) for p, r in zip(PROMPTS, RESPONSES)]


def reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' float64 log-softmax, row r predicting token r + 1 ([L - 1, V])."""
    with torch.no_grad():
        logits = model.double()(torch.tensor([ids])).logits[0]
    model.float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def test_verls_agent_loop_gets_the_served_teachers_top_k_in_verls_rows(entry):
    client = manager()
    for prompt, response in samples():
        ids, log_probs = agent_loop_rows(client, prompt, response)
        rows = len(prompt) + len(response)
        assert ids.shape == log_probs.shape == (rows, K) and ids.dtype == torch.int32
        assert log_probs.dtype == torch.float32
        assert not ids[-1].any() and not log_probs[-1].any()  # verl's dummy last row
        ref = reference(entry.model, prompt + response)
        torch.testing.assert_close(log_probs[:-1].double(), ref.gather(1, ids[:-1].long()), rtol=0, atol=1e-4)
        assert bool((log_probs[:-1].diff(dim=1) <= 1e-6).all())  # best first, as vLLM's ranks
        assert (ids[:-1].long() == ref.topk(K).indices).float().mean() > 0.9  # the teacher's own top-k


def test_without_top_k_verl_gets_each_tokens_own_log_prob(entry):
    prompt, response = samples(1)[0]
    ids, log_probs = agent_loop_rows(manager(loss_mode="k3"), prompt, response)
    sequence = torch.tensor(prompt + response)
    assert ids.shape == log_probs.shape == (len(sequence), 1)
    assert torch.equal(ids[:-1, 0].long(), sequence[1:])
    ref = reference(entry.model, sequence.tolist()).gather(1, sequence[1:, None])
    torch.testing.assert_close(log_probs[:-1].double(), ref, rtol=0, atol=1e-4)


def float64_loss(student: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The (k+1)-bucket forward KL per row in float64."""
    log_p = torch.log_softmax(student.double(), dim=-1).gather(1, ids)
    q_tail, p_tail = torch.log1p(-teacher.exp().sum(1)), torch.log1p(-log_p.exp().sum(1))
    return (teacher.exp() * (teacher - log_p)).sum(1) + q_tail.exp() * (q_tail - p_tail)


def verl_batch(served, privileged: bool = False) -> tuple[list, list, list]:
    """Two samples through verl's agent loop, padded by verl into its batch (prompts left,
    responses right) and unpadded as its trainer packs them: per sample the served ids and
    log-probs [L, K], and transformers' float64 rows with those ids (the reference: with
    `privileged`, the teacher's rows on a hint + the response, from verl's non-tensor field
    `hint`; the prompt's rows then carry no loss)."""
    from verl.experimental.teacher_loop.teacher_manager import _pad_teacher_outputs

    client = manager()
    gen = torch.Generator().manual_seed(11)
    packed_ids, packed_log_probs, references = [], [], []
    for prompt, response in samples(2):
        hint = torch.randint(1, VOCAB, (len(prompt) + 2,), generator=gen).tolist()
        ids, log_probs = agent_loop_rows(client, prompt, response, {"hint": hint} if privileged else None)
        ids, log_probs = _pad_teacher_outputs(ids, log_probs, max(PROMPTS), max(RESPONSES), len(prompt),
                                              len(response), PAD)
        assert ids.shape == (1, max(PROMPTS) + max(RESPONSES), K)
        rows = slice(max(PROMPTS) - len(prompt), max(PROMPTS) + len(response))  # verl's unpadding
        packed_ids.append(ids[0, rows])
        packed_log_probs.append(log_probs[0, rows])
        if privileged:
            teacher = response_rows(served.model, hint, response)
            teacher = torch.cat([torch.zeros(len(prompt) - 1, VOCAB, dtype=torch.float64), teacher])
        else:
            teacher = reference(served.model, prompt + response)
        references.append((teacher, ids[0, rows].long(), len(prompt) - 1 if privileged else 0))
    return packed_ids, packed_log_probs, references


def float64_reference(student: torch.Tensor, references: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 loss per packed row and its gradient to the student's logits [T, V]."""
    student64 = student.detach()[0].double().requires_grad_(True)
    expected, start = [], 0
    for teacher, ids, first in references:
        scored = len(ids) - 1  # the last row is verl's dummy: no loss
        read = slice(first, scored)  # a privileged teacher's rows: the response's only (no loss before)
        expected += [torch.zeros(first, dtype=torch.float64),
                     float64_loss(student64[start:start + scored][read], teacher[read].gather(1, ids[read]), ids[read]),
                     torch.zeros(1, dtype=torch.float64)]
        start += len(ids)
    loss = torch.cat(expected)
    loss.sum().backward()
    return loss.detach(), student64.grad


def student_logits(rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    return (2.0 * torch.randn(1, rows, vocab, generator=gen)).requires_grad_(True)


CONFIG = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(topk=K, log_prob_min_clamp=None))


@pytest.mark.parametrize("privileged", [False, True], ids=["own", "privileged"])
def test_loss_and_gradients_through_verls_padding_equal_float64_and_verls_own_loss_misses(entry, privileged,
                                                                                        monkeypatch):
    """`verl_topk_kd` on the served rows as verl packs them equals the float64 loss of
    transformers' float64 teacher at the same ids (losses and the gradient to the student's
    logits). Negative control: verl's own top-k loss (no tail) on the same rows misses the
    reference by far more than the tolerance."""
    if privileged:
        monkeypatch.setenv(VARIABLE, f"{entry.url};engine=vllm;context=hint")
    packed_ids, packed_log_probs, references = verl_batch(entry, privileged)
    student = student_logits(sum(len(i) for i in packed_ids), VOCAB)
    teacher_ids, teacher_log_probs = nested(packed_ids), nested(packed_log_probs)
    out = megatron_losses.compute_forward_kl_topk(student, teacher_log_probs, teacher_ids, CONFIG, "thd")
    out["distillation_losses"].sum().backward()
    expected, grad = float64_reference(student, references)
    loss_error = (out["distillation_losses"][0].double() - expected).abs().max().item()
    grad_error = (student.grad[0].double() - grad).abs().max().item()
    print(f"served teacher through verl: loss vs float64 {loss_error:.2e}, gradient {grad_error:.2e}")
    assert loss_error < 2e-4 and grad_error < 2e-4

    megatron_rl_patches.revert()  # verl's own compute_forward_kl_topk: the same rows, no tail
    own = megatron_losses.compute_forward_kl_topk(student, teacher_log_probs, teacher_ids, CONFIG, "thd")
    miss = (own["distillation_losses"][0].double() - expected).abs().max().item()
    print(f"verl's own top-k loss vs float64: {miss:.2e}")
    assert miss > 1e-2


def tp2_rank(rank: int, world: int, student: torch.Tensor, ids: list, log_probs: list) -> tuple:
    """One rank of TP=2: its vocabulary half of the student's logits through verl's loss (patched)."""
    import verl.trainer.distillation.megatron.losses as losses

    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu(tensor_parallel=2):
        megatron_rl_patches.apply(only="verl_topk_kd")
        half = student.shape[-1] // 2
        shard = student[..., rank * half:(rank + 1) * half].clone().requires_grad_(True)
        out = losses.compute_forward_kl_topk(shard, nested(log_probs), nested(ids), CONFIG, "thd")
        out["distillation_losses"].sum().backward()
        return out["distillation_losses"].detach(), shard.grad


@pytest.mark.parametrize("privileged", [False, True], ids=["own", "privileged"])
def test_at_tp2_the_loss_and_gradients_equal_float64(entry, privileged, monkeypatch):
    """The same served rows at TP=2 (the student's vocabulary split over two gloo ranks; one
    padding column makes it even, as Megatron pads; verl packs each sequence to a multiple of TP,
    so the student's packed rows hold one alignment row after an odd sequence): every rank's loss
    and its gradient half equal the float64 reference over the whole vocabulary; the alignment
    rows give 0 and no gradient."""
    from megatron_rl_patches.testing.multirank import run_multirank

    if privileged:
        monkeypatch.setenv(VARIABLE, f"{entry.url};engine=vllm;context=hint")
    packed_ids, packed_log_probs, references = verl_batch(entry, privileged)
    lengths = [len(i) for i in packed_ids]
    starts = torch.tensor([0, *[n + n % 2 for n in lengths]]).cumsum(0)
    keep = torch.cat([torch.arange(int(start), int(start) + n) for start, n in zip(starts, lengths)])
    student = student_logits(int(starts[-1]), VOCAB + 1).detach()
    results = run_multirank(tp2_rank, 2, student, packed_ids, packed_log_probs, timeout=300)
    expected, grad = float64_reference(student[:, keep], references)
    losses = [loss[0].double() for loss, _ in results]
    grads = torch.cat([g[0] for _, g in results], dim=-1).double()
    alignment = torch.ones(student.shape[1], dtype=torch.bool)
    alignment[keep] = False
    assert int(alignment.sum()) == sum(n % 2 for n in lengths) > 0
    assert all(not loss[alignment].any() for loss in losses) and not grads[alignment].any()
    loss_error = max((loss[keep] - expected).abs().max().item() for loss in losses)
    grad_error = (grads[keep] - grad).abs().max().item()
    print(f"served teacher through verl at TP=2: loss vs float64 {loss_error:.2e}, gradient {grad_error:.2e}")
    assert loss_error < 2e-4 and grad_error < 2e-4


def test_without_the_variable_verls_own_replicas_answer(served, verl_cpu, monkeypatch):
    """Unset: verl's client asks its own replica (a stand-in here: verl's replicas need Ray and GPUs)."""
    monkeypatch.delenv(VARIABLE, raising=False)
    megatron_rl_patches.apply(only="verl_topk_kd")
    asked = []

    async def generate(**kwargs):
        asked.append(kwargs["sampling_params"])
        rows = len(kwargs["prompt_ids"])
        fields = {"prompt_ids": [[7] * K] * rows, "prompt_logprobs": [[-1.0] * K] * rows}
        return types.SimpleNamespace(extra_fields=fields)

    replica = types.SimpleNamespace(generate=generate)
    ids, log_probs = agent_loop_rows(manager(client=replica), [1, 2, 3], [4, 5])
    assert asked and asked[0]["prompt_logprobs"] == K
    assert torch.equal(ids, torch.full((5, K), 7, dtype=torch.int32)) and bool((log_probs == -1).all())


def test_refusals_name_the_variable_and_the_server(entry, monkeypatch):
    prompt, response = samples(3)[0]
    with pytest.raises(ServedTeacherRefusal, match=rf"top_k=64 is over the server's --max-logprobs {K}"):
        agent_loop_rows(manager(topk=64), prompt, response)
    monkeypatch.setenv(VARIABLE, entry.url)
    with pytest.raises(ValueError, match=rf"{VARIABLE}=.*name the engine serving it, e.g. '{entry.url};engine=vllm'"):
        agent_loop_rows(manager(), prompt, response)
    monkeypatch.setenv(VARIABLE, f"{entry.url};engine=vllm;tp=2")
    with pytest.raises(ValueError, match=rf"{VARIABLE}=.*option 'tp=2': a served teacher runs at its server's own"):
        agent_loop_rows(manager(), prompt, response)
    monkeypatch.setenv(VARIABLE, f"{entry.url};engine=vllm")
    client = manager()
    with pytest.raises(ValueError, match=rf"{VARIABLE}: a served teacher scores token ids only.*\['images'\]"):
        asyncio.run(client.compute_teacher_logprobs_single(prompt + response, multi_modal_data={"images": [1]}))


def response_rows(model, context: list[int], response: list[int]) -> torch.Tensor:
    """transformers' float64 rows predicting the response after `context` ([R, V])."""
    return reference(model, context + response)[len(context) - 1:]


def test_a_privileged_context_from_verls_non_tensor_field_is_scored_before_the_response(served, verl_cpu,
                                                                                       monkeypatch):
    """`;context=hint`: the response's rows are the teacher's on hint + response (ids from verl's
    non-tensor row, or text through `;tokenizer=DIR`), exact against transformers' float64; the
    prompt's rows zeros. Controls: the rows without the context, and with it rolled by one
    token, miss by far more than the bound."""
    import numpy as np

    monkeypatch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
    monkeypatch.setenv(VARIABLE, f"{served.url};engine=vllm;context=hint;tokenizer={served.directory}")
    megatron_rl_patches.apply(only="verl_topk_kd")
    client = manager()
    gen = torch.Generator().manual_seed(9)
    for (prompt, response), as_text in zip(samples(3), (False, True)):
        hint = torch.randint(1, VOCAB, (6,), generator=gen).tolist()
        value = np.array(" ".join(f"t{i}" for i in hint), dtype=object) if as_text else np.array(hint)
        ids, log_probs = agent_loop_rows(client, prompt, response, {"hint": value, "data_source": "x"})
        first = len(prompt) - 1
        assert ids.shape == (len(prompt) + len(response), K)
        assert not ids[:first].any() and not log_probs[:first].any() and not ids[-1].any()
        scored, chosen = log_probs[first:-1].double(), ids[first:-1].long()
        error = (scored - response_rows(served.model, hint, response).gather(1, chosen)).abs().max().item()
        no_context = (scored - response_rows(served.model, prompt, response).gather(1, chosen)).abs().max().item()
        rolled = (scored - response_rows(served.model, hint[1:] + hint[:1], response).gather(1, chosen)).abs().max()
        print(f"verl privileged context ({'text' if as_text else 'ids'}): {error:.2e}; controls: no context "
              f"{no_context:.2e}, rolled {rolled.item():.2e}")
        assert error < 1e-4 and no_context > 1e-2 and rolled.item() > 1e-2


def test_a_privileged_context_past_the_servers_max_model_len_is_refused_before_sending(served, verl_cpu,
                                                                                      monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
    monkeypatch.setenv(VARIABLE, f"{served.url};engine=vllm;context=hint")
    megatron_rl_patches.apply(only="verl_topk_kd")
    prompt, response = samples(4)[0]
    with pytest.raises(ServedTeacherRefusal, match=r"max model length 256"):
        agent_loop_rows(manager(), prompt, response, {"hint": [5] * MAX_MODEL_LEN})
    with pytest.raises(ValueError, match=r"prompt of 5 ids .*no non-tensor batch field 'hint'"):
        agent_loop_rows(manager(), prompt, response, {"data_source": "x"})
