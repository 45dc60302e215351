"""The fused output processors on a real tiny GPTModel (megatron-core < 0.18 through the
`gpt_output_processor` patch, >= 0.18 natively), against the model's own logits path: values and
every parameter's gradient; packed `thd` and CP-zigzag rows; the top-k processor for a student
and a teacher scoring the student's ids."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import (
    log_prob_output_processor,
    log_probs_and_entropy,
    topk_ids,
    topk_logprobs,
    topk_output_processor,
)
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import close, collect_grads

pytestmark = pytest.mark.megatron
REL = 2e-6


def _gpt(megatron_cpu, tied: bool, seed: int = 0):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    return GPTModel(
        config=megatron_cpu.config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
        max_sequence_length=16, share_embeddings_and_output_weights=tied,
    )






@layouts.mark("bshd")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_log_prob_processor_equals_the_logits_path(megatron_cpu, clean_patch_state, tied):
    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on >= 0.18
    model = _gpt(megatron_cpu, tied)
    batch = megatron_cpu.batch(seed=3)
    a = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    b = 0.1 * torch.randn(2, 16, generator=torch.Generator().manual_seed(2))

    logits = megatron_cpu.forward(model, batch)  # [b, s, V], through the output layer
    lp_ref, ent_ref = log_probs_and_entropy(logits.reshape(-1, 64), batch["labels"].reshape(-1), temperature=0.8,
                                            with_entropy=True)
    ((a.reshape(-1) * lp_ref).sum() + (b.reshape(-1) * ent_ref).sum()).backward()
    want = collect_grads(model, zero=False)
    model.zero_grad()

    processor = log_prob_output_processor(temperature=0.8, with_entropy=True)
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                output_processor=processor)
    assert set(out) == {"log_probs", "entropy"} and out["log_probs"].shape == (2, 16)
    assert close(out["log_probs"], lp_ref.reshape(2, 16).detach(), REL)
    assert close(out["entropy"], ent_ref.reshape(2, 16).detach(), REL)
    ((a * out["log_probs"]).sum() + (b * out["entropy"]).sum()).backward()
    got = collect_grads(model, zero=False)
    assert got.keys() == want.keys()
    for name in want:
        assert close(got[name], want[name], REL)


def test_entropy_as_a_metric_and_per_token_context(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = _gpt(megatron_cpu, tied=False)
    batch = megatron_cpu.batch(seed=4)
    tau = torch.rand(2, 16, generator=torch.Generator().manual_seed(5)) + 0.5
    keep = torch.rand(2, 16, 64, generator=torch.Generator().manual_seed(6)) < 0.5
    keep.scatter_(2, batch["labels"][..., None], True)
    logits = megatron_cpu.forward(model, batch).detach()
    lp_ref, ent_ref = log_probs_and_entropy(logits.reshape(-1, 64), batch["labels"].reshape(-1),
                                            temperature=tau.reshape(-1), keep_mask=keep.reshape(-1, 64),
                                            with_entropy=True)
    processor = log_prob_output_processor(with_entropy=True, entropy_requires_grad=False)
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                output_processor=processor, output_processor_context={"temperature": tau, "keep_mask": keep})
    assert close(out["log_probs"], lp_ref.reshape(2, 16), REL)
    assert close(out["entropy"], ent_ref.reshape(2, 16), REL)
    assert not out["entropy"].requires_grad and out["log_probs"].requires_grad


def test_processor_input_errors_name_the_problem(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = _gpt(megatron_cpu, tied=False)
    batch = megatron_cpu.batch()
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    with pytest.raises(ValueError, match="needs labels"):
        model(*args, output_processor=log_prob_output_processor())
    with pytest.raises(ValueError, match="unknown keys \\['temp'\\]"):
        model(*args, labels=batch["labels"], output_processor=log_prob_output_processor(),
              output_processor_context={"temp": 1.0})
    with pytest.raises(TypeError, match="output_processor_context must be a dict"):
        model(*args, labels=batch["labels"], output_processor=log_prob_output_processor(), output_processor_context=3)
    with pytest.raises(ValueError, match="exactly one source of ids"):
        model(*args, output_processor=topk_output_processor())
    with pytest.raises(ValueError, match="k must be a positive int"):
        topk_output_processor(k=0)


@layouts.mark("bshd")
def test_topk_processor_for_student_and_teacher(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    student, teacher = _gpt(megatron_cpu, tied=False, seed=0), _gpt(megatron_cpu, tied=True, seed=1)
    batch = megatron_cpu.batch(seed=7)
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    out = student(*args, output_processor=topk_output_processor(k=4, temperature=0.9))
    logits = megatron_cpu.forward(student, batch).detach()
    ids_ref = topk_ids(logits / 0.9, 4)
    assert torch.equal(out["topk_ids"], ids_ref)
    lp_ref, tail_ref = topk_logprobs(logits, ids_ref, temperature=0.9)
    assert close(out["topk_log_probs"], lp_ref, REL)
    assert close(out["tail"], tail_ref, REL)
    with torch.no_grad():
        scored = teacher(*args, output_processor=topk_output_processor(),
                         output_processor_context={"ids": out["topk_ids"]})
        t_logits = megatron_cpu.forward(teacher, batch)
    t_lp, t_tail = topk_logprobs(t_logits, ids_ref)
    assert "topk_ids" not in scored
    assert close(scored["topk_log_probs"], t_lp, REL)
    assert close(scored["tail"], t_tail, REL)


@pytest.mark.parametrize("cp", [1, 2], ids=["thd", "cp-zigzag"])
def test_packed_and_zigzag_rows_share_the_labels_layout(megatron_cpu, cp):
    """The processor is per token: with labels in the hidden states' own (packed or zigzag) row
    layout, its per-sample responses equal the packing helpers' logits path."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_rl_patches.ops.packing import (
        PackedLayout,
        response_log_probs_and_entropy,
        shifted_targets,
        split_responses,
    )

    g = torch.Generator().manual_seed(8)
    totals, responses = (7, 11, 5), (3, 6, 2)
    tokens = [torch.randint(0, 64, (n,), generator=g) for n in totals]
    config = megatron_cpu.config()
    layer = ColumnParallelLinear(32, 64, config=config, init_method=torch.nn.init.normal_, bias=False,
                                 skip_bias_add=True, gather_output=False)
    for rank in range(cp):
        layout = PackedLayout(totals, responses, cp_size=cp, cp_rank=rank)
        rows = sum(layout.sample_rows(n) for n in totals)
        hidden = torch.randn(rows, 1, 32, generator=g)  # [s, b=1, h] in the layout's row order
        labels = shifted_targets(tokens, layout, rows)[None]  # [b=1, s], the same order
        out = log_prob_output_processor(with_entropy=True)(hidden_states=hidden, output_layer=layer, labels=labels,
                                                           config=config)
        logits = (hidden[:, 0] @ layer.weight.T).detach()
        want_lp, want_ent = response_log_probs_and_entropy(logits, tokens, layout, with_entropy=True)
        got_lp = split_responses(out["log_probs"][0].detach(), layout)
        got_ent = split_responses(out["entropy"][0].detach(), layout)
        for g_lp, w_lp, g_e, w_e in zip(got_lp, want_lp, got_ent, want_ent):
            assert close(g_lp, w_lp, REL)
            assert close(g_e, w_e, REL)
