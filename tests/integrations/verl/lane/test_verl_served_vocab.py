"""verl's whole-vocabulary distillation from a served teacher's hidden states, on verl 0.9.1's real
engine `forward_step` (its fused route), its `distillation_ppo_loss` and `forward_kl_topk` loss,
against a real vLLM pooling server (the served lane's build, MRP_VLLM_PYTHON): with
MEGATRON_RL_PATCHES_VERL_TEACHER=`URL;engine=vllm;head=DIR` the trainer asks the server for the
teacher's final hidden states of the batch's ids, and the student's fused forward computes the
forward KL over the whole vocabulary through both heads. Per-token KL, loss and gradients equal a
float64 reference (the student's own logits in float64, transformers' float64 teacher) at TP=1
and TP=2 with sequence parallelism; negative control: the head of another checkpoint. A privileged
teacher (`;context=hint`, verl's non-tensor field: ids or text) is scored on context + response,
against float64 on that sequence; controls: its KL against the teacher without the context and
with the context rolled by one token. Without
MRP_VLLM_PYTHON every test here skips, saying why."""
from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = [pytest.mark.verl, pytest.mark.multirank,
              pytest.mark.skipif(not os.environ.get("MRP_VLLM_PYTHON"),
                                 reason="needs a real vLLM server: MRP_VLLM_PYTHON names vLLM's interpreter "
                                        "(make test-verl passes it when the served lane .lanes/vllm is built)")]

import verl.models.mcore.registry  # noqa: E402,F401  (bound by name before any patch: see verl_kit)
import verl_kit as kit  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"
API_KEY, MAX_MODEL_LEN = "verl-vocab-key", 256
MODEL_SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, max_position_embeddings=MAX_MODEL_LEN,
                   vocab_size=kit.VOCAB)  # the student's vocabulary
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')
PROMPTS, RESPONSES = kit.PROMPTS, kit.RESPONSES
TEMPERATURE = 0.7  # the teacher scored at verl's temperature too: the trainer applies it to both heads
LAYOUTS = [{"name": "tp1", "tp": 1, "sp": False}, {"name": "tp2-sp", "tp": 2, "sp": True}]
TOL = 2e-5  # float32 against float64, relative to the largest value


def launch_server(root):
    """A vLLM pooling server of a tiny random Qwen3 of the student's vocabulary, started; transformers'
    model of it and another checkpoint's directory (the negative control's head)."""
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
    from megatron_rl_patches.testing.vllm_server import launch

    model = save_tiny_hf(root / "qwen3", "qwen3", seed=7, **MODEL_SHAPE)
    save_word_tokenizer(root / "qwen3", kit.VOCAB)
    save_tiny_hf(root / "other", "qwen3", seed=8, **MODEL_SHAPE)
    server = launch(os.environ["MRP_VLLM_PYTHON"], root / "qwen3", root / "pooling.log", max_model_len=MAX_MODEL_LEN,
                    max_logprobs=20, api_key=API_KEY, extra=POOLING)
    return server, {"model": model, "head": str(root / "qwen3"), "other": str(root / "other")}


@pytest.fixture(scope="module")
def served(launched, tmp_path_factory):
    """The module's pooling server (started with the lane's others: conftest's `launched`), ready,
    its API key set."""
    from megatron_rl_patches.testing.vllm_server import serving

    server, info = launched.pop(__name__, None) or launch_server(tmp_path_factory.mktemp("verl-vocab"))
    with serving(server):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
            yield {"url": server.url, **info}


def teacher_log_probs(model, contexts: list[list[int]] | None = None) -> list[torch.Tensor]:
    """transformers' float64 teacher log-probs at TEMPERATURE on the rows predicting each response
    token of verl's batch ([R, V]): after the sequence's own prompt, or after `contexts[i]` (the
    privileged sequence context + response)."""
    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE)
    reference = copy.deepcopy(model).double()
    out = []
    for i, (sequence, prompt) in enumerate(zip(batch["input_ids"].unbind(), PROMPTS)):
        before = sequence[:prompt] if contexts is None else torch.tensor(contexts[i])
        scored = torch.cat([before, sequence[prompt:]])
        with torch.no_grad():
            logits = reference(scored[None]).logits[0]
        out.append(torch.log_softmax(logits / TEMPERATURE, -1)[len(before) - 1:-1])
    return out


def hint_values(contexts: list[list[int]]) -> list:
    """The contexts as verl's trainer batch holds a non-tensor field (numpy rows, as
    `DataProto.to_tensordict` stacks them): sample 0 as ids, sample 1 as the word tokenizer's text."""
    import numpy as np

    return [np.array(contexts[0]), np.array(" ".join(f"t{i}" for i in contexts[1]), dtype=object)]


def distillation_step(model, **fields) -> tuple[list[torch.Tensor], float, dict]:
    """verl's engine on its fused route with verl's distillation loss (forward_kl_topk, no policy
    loss): the per-token KL on the response rows, the loss it backpropagates, the gradients.
    `fields`: non-tensor batch fields (a privileged context)."""
    from verl.trainer.distillation import distillation_ppo_loss

    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE, distillation_use_topk=True,
                         distillation_only=True, **fields)
    config = kit.distillation_config(8, use_task_rewards=False, use_policy_gradient=False, loss_max_clamp=None)
    loss_function = functools.partial(distillation_ppo_loss, config=kit.actor_config(), distillation_config=config)
    output, loss = kit.train_step(kit.engine(True), model, batch, loss_function)
    loss.backward()
    reduce_sequence_parallel_grads(model)
    return kit.response_rows(output["distillation_losses"].detach(), PROMPTS), float(loss), kit.grads(model)


def reduce_sequence_parallel_grads(model) -> None:
    """What Megatron's finalize_model_grads does under sequence parallelism: the gradients of the
    parameters every TP rank holds whole (norms) summed over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def float64_step(model, build, teacher: list[torch.Tensor]) -> tuple[list[torch.Tensor], float, dict]:
    """The same loss in float64: the student's own logits (gathered over TP) in float64 against the
    teacher's float64 log-probs, verl's token mean over the response rows; gradients of a float64
    copy of the student (`build()`: the same model, its weights loaded; without sequence
    parallelism, which would need every sequence padded to a multiple of TP)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    reference = build(sequence_parallel=False)
    reference.load_state_dict(model.state_dict())
    reference.double()
    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE)
    rows = []
    for sequence, q, prompt in zip(batch["input_ids"].unbind(), teacher, PROMPTS):
        n = sequence.numel()
        causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
        logits = gather_from_tensor_model_parallel_region(reference(sequence[None], torch.arange(n)[None], causal))
        p = torch.log_softmax(logits[0, :, :kit.VOCAB] / TEMPERATURE, -1)[prompt - 1:-1]
        rows.append((q.exp() * (q - p)).sum(-1))
    loss = torch.cat(rows).sum() / sum(RESPONSES)
    loss.backward()
    return [r.detach() for r in rows], float(loss), kit.grads(reference)


def vocab_world(rank: int, world: int, layouts: list[dict], teacher: list[torch.Tensor], other: str,
                privileged: dict) -> list:
    """Each layout: verl's fused distillation step with the served head against float64, and the
    step with another checkpoint's head (the negative control: refused at connect, the served model's
    root differing from the head's checkpoint); then the privileged step (`;context=hint`) against
    float64 on context + response, its controls, and (TP=2) one rank's batch without the field."""
    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    results = []
    for layout in layouts:
        with megatron_on_cpu(tensor_parallel=layout["tp"]):
            from verl.models.mcore.model_forward_fused import patch_fused_forward

            extra = dict(tensor_model_parallel_size=2, sequence_parallel=layout["sp"]) if layout["tp"] > 1 else {}
            build = functools.partial(build_packed_gpt, vocab_size=kit.VOCAB, seed=3, **extra)
            model = build()
            patch_fused_forward(model)
            megatron_rl_patches.apply(only=["verl_fused_logprobs", "verl_topk_kd"])
            try:
                kl, loss, grads = distillation_step(model)
                entry = os.environ[VARIABLE]
                os.environ[VARIABLE] = entry.replace(entry.rpartition("head=")[2], other)
                try:  # refused at connect: the server's /v1/models root is a checkpoint the head's differs from
                    distillation_step(model)
                    control = "no error"
                except Exception as refused:  # noqa: BLE001 - compared below, the same on every rank
                    control = f"{type(refused).__name__}: {refused}"
                finally:
                    os.environ[VARIABLE] = entry
                os.environ[VARIABLE] = f"{entry};context=hint"
                try:
                    hint = hint_values(privileged["contexts"])
                    ctx_kl, ctx_loss, ctx_grads = distillation_step(model, hint=hint)
                    missing = "not tried (TP=1)"
                    if layout["tp"] > 1:  # rank 1's micro-batch lacks the field: the same error on both ranks
                        try:
                            distillation_step(model, **({} if rank == 1 else {"hint": hint}))
                            missing = "no error"
                        except Exception as refused:  # noqa: BLE001 - compared below, the same on every rank
                            missing = f"{type(refused).__name__}: {refused}"
                finally:
                    os.environ[VARIABLE] = entry
            finally:
                megatron_rl_patches.revert()
            ref_kl, ref_loss, ref_grads = float64_step(model, build, teacher)
            ctx_ref_kl, ctx_ref_loss, ctx_ref_grads = float64_step(model, build, privileged["teacher"])
            rolled_kl = float64_step(model, build, privileged["rolled"])[0]
            results.append({
                "layout": layout["name"], "loss": loss, "float64": ref_loss,
                "kl_err": max(kit.relative(a, b) for a, b in zip(kl, ref_kl)),
                "grad_err": max(kit.relative(grads[name], ref_grads[name]) for name in ref_grads),
                "control": control,
                "ctx_loss": ctx_loss, "ctx_float64": ctx_ref_loss,
                "ctx_kl_err": max(kit.relative(a, b) for a, b in zip(ctx_kl, ctx_ref_kl)),
                "ctx_grad_err": max(kit.relative(ctx_grads[name], ctx_ref_grads[name]) for name in ctx_ref_grads),
                "ctx_without": max(kit.relative(a, b) for a, b in zip(ctx_kl, ref_kl)),
                "ctx_rolled": max(kit.relative(a, b) for a, b in zip(ctx_kl, rolled_kl)),
                "missing": missing,
            })
    return results


def test_verls_fused_distillation_step_over_the_whole_vocabulary_equals_float64(served, monkeypatch):
    monkeypatch.setenv(VARIABLE, f"{served['url']};engine=vllm;head={served['head']}")
    teacher = teacher_log_probs(served["model"])
    gen = torch.Generator().manual_seed(11)
    contexts = [torch.randint(1, kit.VOCAB, (n,), generator=gen).tolist() for n in (7, 4)]
    privileged = {"contexts": contexts, "teacher": teacher_log_probs(served["model"], contexts),
                  "rolled": teacher_log_probs(served["model"], [c[1:] + c[:1] for c in contexts])}
    results = run_multirank(vocab_world, 2, LAYOUTS, teacher, served["other"], privileged, timeout=600)
    for rank, outs in enumerate(results):
        for out in outs:
            print(f"rank {rank}: {out}")
            assert abs(out["loss"] - out["float64"]) <= TOL * abs(out["float64"]), out
            assert out["kl_err"] <= TOL and out["grad_err"] <= TOL, out
            # another checkpoint's head: refused before any state is projected, naming both directories
            assert out["control"].startswith("ServedTeacherRefusal") and served["other"] in out["control"], out
            assert "differs from the head's directory" in out["control"], out
            # the privileged teacher (sample 0's context as ids, sample 1's as text): float64 on context + response
            assert abs(out["ctx_loss"] - out["ctx_float64"]) <= TOL * abs(out["ctx_float64"]), out
            assert out["ctx_kl_err"] <= TOL and out["ctx_grad_err"] <= TOL, out
            assert min(out["ctx_without"], out["ctx_rolled"]) > 1e3 * TOL, out  # the controls miss by far
    missing = [out["missing"] for outs in results for out in outs if out["layout"] == "tp2-sp"]
    assert missing[0].startswith("ValueError") and "no non-tensor field 'hint'" in missing[0], missing
    assert "refused on rank(s) [1]" in missing[0] and missing[0] == missing[1], missing
    assert [out["layout"] for out in results[0]] == [layout["name"] for layout in LAYOUTS]


def test_verls_agent_loop_gets_any_k_through_the_head(served, verl_cpu, monkeypatch):
    """The same entry in the agent loop: verl's teacher rows at K = 64 (above the server's
    --max-logprobs 20: the pooling server's states through the head in the agent-loop process)
    equal transformers' float64 top-k log-probs."""
    from test_verl_served import agent_loop_rows, manager

    import megatron_rl_patches

    monkeypatch.setenv(VARIABLE, f"{served['url']};engine=vllm;head={served['head']}")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
    megatron_rl_patches.apply(only="verl_topk_kd")
    prompt, response = [5, 9, 200, 13], [44, 310, 7, 501, 2]
    ids, log_probs = agent_loop_rows(manager(topk=64), prompt, response)
    assert ids.shape == log_probs.shape == (len(prompt) + len(response), 64)
    with torch.no_grad():
        logits = copy.deepcopy(served["model"]).double()(torch.tensor([prompt + response])).logits[0]
    reference = torch.log_softmax(logits, -1)[:-1]
    error = float((log_probs[:-1].double() - reference.gather(1, ids[:-1].long())).abs().max())
    shifted = float((log_probs[1:-1].double() - reference[:-1].gather(1, ids[1:-1].long())).abs().max())
    print(f"agent-loop rows through the head at K=64 vs float64: {error:.2e} (one row off: {shifted:.2e})")
    assert error < 1e-4 < kit.CONTROL < shifted
    kth = reference.topk(64).values[:, -1]  # the served ids are the top-k: none below the 64th value
    assert bool((reference.gather(1, ids[:-1].long()).min(-1).values >= kth - 1e-4).all())
