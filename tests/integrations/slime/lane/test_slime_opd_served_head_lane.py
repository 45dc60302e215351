"""slime_opd with a served teacher's head (`http://host:port;engine=vllm;head=DIR`): a real vLLM
pooling server (its CPU build, MRP_VLLM_PYTHON) sends the teacher's final hidden states, the
trainer projects them through DIR's output layer, through slime 624b824a's real
`MegatronTrainRayActor.train_actor` with a snapshot teacher beside it, at one rank and TP=2: the
student's own ids (MEGATRON_RL_PATCHES_OPD_IDS_FROM=student, refused for a served teacher without a
head) at slime's --rollout-temperature 0.8 (a served teacher without a head: 1 only); the first
step's OPD loss and every gradient against dense float64 (the served checkpoint built alone in
float64). Without MRP_VLLM_PYTHON the test skips naming it (the slime lane is outside `make test`)."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.slime

VLLM_PYTHON = os.environ.get("MRP_VLLM_PYTHON", "")
VOCAB = 64  # the lane's tiny GPT's vocabulary (slime_kit.VOCAB), the served model's too
SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, max_position_embeddings=256, vocab_size=VOCAB)
WEIGHTS = (0.3, 0.7)  # slime_ranks.OPD_ENV's: the served teacher, the snapshot
TEMPERATURE = 0.8
# vLLM's pooling runner serving a causal LM's final hidden states per token
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    if not VLLM_PYTHON:
        pytest.skip("MRP_VLLM_PYTHON names vLLM's interpreter (the served lane's, .lanes/vllm/bin/python): unset")
    from megatron_rl_patches.testing.hf_checkpoints import (
        save_word_tokenizer,
        tiny_hf_config,
        transformers_layout,
        write_tiny_checkpoint,
    )
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root = tmp_path_factory.mktemp("pooled")
    config = {**transformers_layout(tiny_hf_config("qwen3", **SHAPE)), "architectures": ["Qwen3ForCausalLM"]}
    write_tiny_checkpoint(root / "qwen3", config, seed=3)
    save_word_tokenizer(root / "qwen3", VOCAB)
    with vllm_server(VLLM_PYTHON, root / "qwen3", root / "vllm.log", max_model_len=256, extra=POOLING) as server:
        yield server.url, str(root / "qwen3")


@pytest.mark.parametrize("tensor", [1, 2])
def test_train_actor_with_a_served_head_on_the_student_ids_equals_dense_float64(slime_cpu, pooled, tensor):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.multirank import run_multirank

    url, directory = pooled
    served = {"entries": f"{url};engine=vllm;head={directory},teacher-a", "student": directory,
              "ids_from": "student", "temperature": str(TEMPERATURE)}
    ranks = run_multirank(slime_ranks.opd_train_actor, tensor, 1, 1, tensor, None, None, (), 1, None, 1, None, None,
                          served, timeout=400)
    for rank in ranks:
        assert rank["keys"] == sorted([slime_opd.IDS, slime_opd.TEACHER_LOGPROBS, slime_opd.TEACHER_TAILS])

    def whole(field, tag=None):
        return kit.unsplit([r[field] if tag is None else r[field][tag] for r in ranks], ranks[0]["split"])

    states, grads = {tag: whole("states", tag) for tag in ranks[0]["states"]}, whole("grads")
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        full = kit.provider_func(args)()
        names = [name for name, _ in full.named_parameters()]
        with torch.no_grad():
            for name, p in full.named_parameters():
                p.copy_(states["actor"][name])
        data = kit.rollout(0)
        ids = kit.whole_ids(ranks, 1, tensor)
        teacher = kit.hf_teacher_logps(directory, data, TEMPERATURE, VOCAB)
        snapshot = [states["opd_teacher_1"][name] for name in names]
        student = kit.float64_copy(args, [p.detach() for p in full.parameters()])
        dense_student = kit.response_logps(student, data, TEMPERATURE)
        for sample_ids, logp in zip(ids, dense_student):  # the step's ids are the student's own top-k, ties aside
            assert (sample_ids.sort(-1).values == logp.topk(sample_ids.shape[-1]).indices.sort(-1).values).float() \
                .mean() > 0.9
        with torch.no_grad():
            other = kit.response_logps(kit.float64_copy(args, snapshot), data, TEMPERATURE)
        expected = kit.dense_opd_loss(dense_student, [teacher, other], data, ids, WEIGHTS)
        expected.backward()
    served_values = [values[0] for values in ranks[-1]["teacher_logprobs"]]  # the served teacher's [R, k]
    value_error = max((v.double() - t.gather(-1, i)).abs().max().item() for v, t, i in zip(served_values, teacher, ids))
    (losses,) = ranks[-1]["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor TP={tensor} with a served head (student ids, T={TEMPERATURE}) vs dense float64: "
          f"loss {float(expected):.6f}, |Δloss| {loss_error:.2e}, max |Δteacher logp| {value_error:.2e}, "
          f"max |Δgrad| {grad_error:.2e}")
    assert value_error <= 1e-5
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
