"""The whole-vocabulary route's host-side reads (`integrations.verl.vocab`) in one process, no verl
needed (a dict batch, as `verl_rows` tests do): where each sequence's scored rows start in every
mask layout verl's batches carry, the teacher's states placed at verl's packed rows, the model and
output weight found inside verl's wrappers, the variable's head entry. (On verl's real trainer batch
and a stand-in server: lane/test_verl_vocab_rows.py; the fused step in ranks: lane/test_verl_served_vocab.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_rl_patches.integrations.verl import vocab
from megatron_rl_patches.model.chunks import unwrap


def nested(parts: list[list[int]]) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(p) for p in parts], layout=torch.jagged)


# three sequences of 7, 5 and 4 tokens: prompts of 3, 2, 3; responses of 4, 3, 1
IDS = nested([[1] * 7, [1] * 5, [1] * 4])
# verl's trainer batch: the response-aligned mask [b, R], padded (the second's first response token unread,
# the third reads nothing)
RESPONSE_MASK = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]])
# the engine's padded attention mask [b, P + R] (prompts left-padded to 3, responses right-padded to 4)
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]])


def test_starts_in_each_mask_layout():
    with_responses = {"input_ids": IDS, "loss_mask": RESPONSE_MASK, "prompts": torch.zeros(3, 3),
                      "responses": torch.zeros(3, 4), "attention_mask": ATTENTION}
    assert vocab.response_starts(with_responses) == [3, 3, 4]  # the prompt, the first read; none read: the length
    attention_only = {"input_ids": IDS, "loss_mask": RESPONSE_MASK, "attention_mask": ATTENTION}
    assert vocab.mask_responses(attention_only, RESPONSE_MASK) == [4, 3, 1]
    assert vocab.response_starts(attention_only) == [3, 3, 4]
    response_nested = nested([[1, 1, 1, 1], [0, 1, 1], [0]])
    assert vocab.response_starts({"input_ids": IDS, "loss_mask": response_nested}) == [3, 3, 4]
    whole = nested([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0]])  # as long as each sequence
    assert vocab.response_starts({"input_ids": IDS, "loss_mask": whole}) == [3, 1, 4]  # at least 1
    assert vocab.response_starts({"input_ids": IDS}) == [1, 1, 1]  # nothing to place a mask by
    padded = {"input_ids": torch.ones(3, 7, dtype=torch.long), "loss_mask": RESPONSE_MASK, "attention_mask": ATTENTION}
    assert vocab.response_starts(padded) == [3, 5, 7]  # every sequence 7 long: prompts 3, 4, 6
    assert vocab.mask_responses({"attention_mask": nested([[1]])}, RESPONSE_MASK) is None
    assert vocab.mask_responses({}, None) is None
    assert vocab.first_marked(None, [2, 0], [3, 2], [5, 2]) == [2, 1]  # no mask: every row read


def test_the_teachers_states_sit_at_verls_packed_rows():
    states = [torch.arange(6, dtype=torch.bfloat16).reshape(3, 2), torch.zeros(0, 2, dtype=torch.bfloat16),
              torch.full((1, 2), 9.0, dtype=torch.float32)]
    params = SimpleNamespace(cu_seqlens_q_padded=torch.tensor([0, 8, 12, 16]))
    packed, rows = vocab.packed_rows(states, [4, 2, 3], params, 18, 2)
    assert packed.dtype == torch.bfloat16 and packed.shape == (18, 2)  # the first non-empty sample's dtype
    assert rows.nonzero().flatten().tolist() == [3, 4, 5, 14]  # sequence i's row start − 1 at its offset
    assert torch.equal(packed[3:6], states[0]) and packed[14].tolist() == [9.0, 9.0]
    assert not packed[rows.logical_not()].any()
    empty, none = vocab.packed_rows([torch.zeros(0, 2)], [1], params, 4, 2)
    assert empty.dtype == torch.float32 and not none.any()


def test_the_model_and_its_output_weight_inside_verls_wrappers():
    own = torch.ones(3, 2)
    core = SimpleNamespace(share_embeddings_and_output_weights=False, output_layer=SimpleNamespace(weight=own))
    assert unwrap(SimpleNamespace(module=SimpleNamespace(module=core))) is core
    assert vocab.output_weight(core) is own
    tied = torch.zeros(3, 2)
    shared = SimpleNamespace(share_embeddings_and_output_weights=True, shared_embedding_or_output_weight=lambda: tied,
                             output_layer=SimpleNamespace(weight=own))
    assert vocab.output_weight(shared) is tied


def test_the_variables_head_entry(monkeypatch):
    """The variable read once at the engine's door (`verl_teacher`, held by the engine); the route is
    the entry's `head` field, never a substring of the text (a host named "head" is no head)."""
    from megatron_rl_patches.integrations.verl.entry import verl_teacher

    engine = SimpleNamespace()
    monkeypatch.setenv(vocab.VERL_TEACHER, " http://t:1;engine=vllm;head=/dirs/teacher ")
    named = verl_teacher(engine)
    assert named.raw == "http://t:1;engine=vllm;head=/dirs/teacher" and str(named.head.head) == "/dirs/teacher"
    monkeypatch.setenv(vocab.VERL_TEACHER, "http://t:1;engine=vllm")
    assert verl_teacher(engine) is named  # read once: held by the engine
    assert verl_teacher(SimpleNamespace()).head is None
    monkeypatch.setenv(vocab.VERL_TEACHER, "http://head:1;engine=vllm")  # "head" in the host only
    assert verl_teacher(SimpleNamespace()).head is None
