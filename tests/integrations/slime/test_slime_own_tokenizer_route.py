"""slime_opd's `PATH;tokenizer=own` teacher (issue 55 item 1) without slime's source: a Qwen3.5
directory as transformers writes it (the text model under `text_config`) is of another shape than
the actor, so `load_teachers` builds it from its config.json as a separate model (then wraps it
with its own tokenizer); its nested sizes went unseen and it was routed into the actor's buffers
(slime's snapshot loader). The build and the tokenizer pair are stood in for: the route is the test."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl_patches.integrations.megatron.opd import cross_passes, hf_teachers
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, opd_settings
from megatron_rl_patches.integrations.slime import opd as slime_opd
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint
from tests.integrations.slime.tiny_actor import tiny_actor_args


class _Actor:
    """What load_teachers reads of slime's actor (tiny_hf_config("qwen3")'s shape): args, model, the
    snapshot loader (logged: a snapshot route) and the switch."""

    def __init__(self):
        self.args = tiny_actor_args()
        self.model = [SimpleNamespace(vocab_size=1024, config=SimpleNamespace())]
        self.weights_backuper = SimpleNamespace(get=lambda tag: {})
        self.log: list[tuple] = []

    def load_other_checkpoint(self, tag, path):
        self.log.append(("snapshot", tag, path))

    def _switch_model(self, tag):
        pass


def test_an_own_tokenizer_qwen3_5_teacher_is_built_from_its_config(tmp_path, monkeypatch):
    root = tmp_path / "qwen3_5"
    write_tiny_checkpoint(root, transformers_layout(tiny_hf_config("qwen3_5", vocab_size=2000)))
    built = []

    def build(args, path, residency, student, actor_config, what, own_tokenizer=False):
        built.append((path, own_tokenizer))
        return ["chunk"]

    monkeypatch.setattr(hf_teachers, "build_hf_teacher", build)
    monkeypatch.setattr(cross_passes, "load_cross", lambda args, teacher, model: ("own tokenizer", model))
    actor = _Actor()
    loaded = slime_opd.load_teachers(actor, opd_settings({TEACHERS: f"{root};tokenizer=own"}))
    assert actor.log == [] and built == [(str(root), True)]
    assert loaded == [("own tokenizer", ["chunk"])]


@layouts.mark("cp2-allgather")
def test_a_hugging_face_teacher_on_the_actors_split_is_refused_at_allgather_cp(tmp_path, monkeypatch):
    """slime's --allgather-cp gives each context-parallel rank a contiguous slice of the packed
    stream; a Hugging Face teacher of another architecture runs megatron-core's rotary embedding,
    whose thd path cuts each sequence in zigzag (the slime lane's cross-tokenizer world with a Qwen3
    teacher there: a shape error inside `_apply_rotary_pos_emb_thd`). Refused by name before any
    build, with or without its own tokenizer; one context-parallel rank (no slices) still builds."""
    root = tmp_path / "qwen3_5"
    write_tiny_checkpoint(root, transformers_layout(tiny_hf_config("qwen3_5", vocab_size=1001)))
    built = []
    monkeypatch.setattr(hf_teachers, "build_hf_teacher", lambda *args, **kwargs: built.append(args[1]) or ["chunk"])
    monkeypatch.setattr(cross_passes, "load_cross", lambda args, teacher, model: ("own tokenizer", model))
    for entry in (f"{root};tokenizer=own", str(root)):
        actor = _Actor()
        actor.args.allgather_cp, actor.args.context_parallel_size = True, 2
        with pytest.raises(ValueError, match=r"another architecture .* not served with --allgather-cp"):
            slime_opd.load_teachers(actor, opd_settings({TEACHERS: entry}))
        assert built == []
    actor = _Actor()
    actor.args.allgather_cp = True  # one context-parallel rank: nothing is sliced
    slime_opd.load_teachers(actor, opd_settings({TEACHERS: f"{root};tokenizer=own"}))
    assert built == [str(root)]
