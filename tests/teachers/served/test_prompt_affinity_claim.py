"""What prompt affinity buys, said where users read it (issue 86 item 2): on stock vLLM 0.32 it saves
no compute (prefix-cache reads are off for prompt log-probs and all-token pooling, measured against a
real server's `/metrics` in tests/teachers/lane/test_served_prefix_cache_vllm.py), so neither the
docs nor the policy's docstring may promise a prompt computed once there; on `serve-teacher` replicas
it is what lets a group's prompt be computed once (tests/teachers/lane/test_served_serve_teacher_vllm.py)."""
from __future__ import annotations

from pathlib import Path

from megatron_rl_patches.teachers import PromptAffinity, ReplicaSettings

DOCS = Path(__file__).resolve().parents[3] / "docs" / "distillation.md"


def spreading_bullet() -> str:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("- **Spreading.**")
    return text[start:text.index("\n- **", start + 1)]


def test_the_docs_say_what_prompt_affinity_buys_on_vllm():
    said = " ".join(spreading_bullet().split())
    assert "computes the prompt once" not in said
    assert "saves no compute" in said and "skip_reading_prefix_cache" in said and "/metrics" in said


def test_the_policy_says_it_too_and_keep_prompt_groups_still_spells_it():
    said = " ".join((PromptAffinity.__doc__ or "").split())
    assert "On stock vLLM 0.32 it saves no compute" in said
    assert "`megatron-rl-patches serve-teacher` replicas it is what lets the replica holding a group compute its " \
           "prompt once" in said
    assert ReplicaSettings(keep_prompt_groups=True).spread == PromptAffinity()
