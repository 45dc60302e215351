"""A head read from the output layer the engine projects through (issue 86 item 11, found against
a real server): vLLM 0.32's Cohere (commandr.py) projects through the input embeddings and drops a
stored `lm_head.weight`, so `TeacherHead.from_hf` of an untied Cohere checkpoint reads the
embeddings (times its logit scale), not `lm_head.weight`; a Llama's untied head stays its
`lm_head.weight`. (Real servers: tests/teachers/lane/test_served_cohere_logit_scale_vllm.py found
0.36 nats between an untied Cohere's `lm_head` head and the server.)"""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import TeacherHead

transformers = pytest.importorskip("transformers")


def untied(directory, kind: str):
    """A tiny untied checkpoint of `kind` ('cohere' or 'llama'), its lm_head unlike its embeddings."""
    shape = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "cohere":
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**shape))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    torch.manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param))
    model.save_pretrained(directory)
    return model.float()


def test_an_untied_cohere_head_is_its_embeddings_as_the_engine_projects():
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        model = untied(directory, "cohere")
        head = TeacherHead.from_hf(directory)
    embeddings = model.model.embed_tokens.weight.detach()
    assert head.logit_scale == 0.0625
    torch.testing.assert_close(head.weight.double(), embeddings.double() * 0.0625, rtol=0, atol=1e-6)


def test_an_untied_llama_head_is_its_lm_head():
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        model = untied(directory, "llama")
        head = TeacherHead.from_hf(directory)
    torch.testing.assert_close(head.weight, model.lm_head.weight.detach(), rtol=0, atol=0)
