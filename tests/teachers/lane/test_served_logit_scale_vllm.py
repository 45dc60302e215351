"""A teacher whose engine scales its logits (a tiny Llama with config.json's `logit_scale` = 0.5,
which vLLM 0.32's llama.py passes to `LogitsProcessor(scale=...)` after the states a pooling server
sends): its served prompt log-probs (a generate server) against the log-probs its pooled states
give through `TeacherHead.from_hf` (the scale applied in the head); the same states through the
head of a copy without the field (no scale: far off) as the negative control. Two servers of this
checkpoint, started together while the lane's other tests run (`early_work`). And the table's
rows against the lane's vLLM source (no server): each applied row's model files read its field,
from the config the row says (`hf_config` as written, or `hf_config.get_text_config()`)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch, TeacherHead
from megatron_rl_patches.teachers.head.transforms import APPLIED, EMBEDDING_OUTPUT, HEAD_TRANSFORMS, OUTER, TEXT
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
from megatron_rl_patches.testing.vllm_server import VllmServer, launch, serving, stop
from tests.teachers.lane.early_work import offer, server_job
from tests.teachers.lane.served_kit import MAX_LOGPROBS, MODEL_SHAPE, POOLING, VLLM_PYTHON, VOCAB

SCALE = 0.5
FAST = ClientSettings(retries=1, backoff_s=0.1, deadline_s=120.0)


def begin_logit_scale(root: Path, _directory: Path) -> tuple[Path, VllmServer, VllmServer]:
    """A tiny Llama with `logit_scale` = SCALE and a copy without the field (the negative control),
    and the generate and pooling servers of the first started (not waited for)."""
    folder = root / "logit-scale"
    directory = folder / "llama"
    save_tiny_hf(directory, "llama", seed=11, logit_scale=SCALE, **MODEL_SHAPE)
    save_word_tokenizer(directory, VOCAB)
    assert json.loads((directory / "config.json").read_text())["logit_scale"] == SCALE
    unscaled = folder / "unscaled"
    shutil.copytree(directory, unscaled, dirs_exist_ok=True)
    config = json.loads((unscaled / "config.json").read_text())
    del config["logit_scale"]
    (unscaled / "config.json").write_text(json.dumps(config))
    generate = launch(VLLM_PYTHON, directory, folder / "generate.log")
    try:
        pooling = launch(VLLM_PYTHON, directory, folder / "pooling.log", extra=POOLING)
    except BaseException:
        stop(generate.process)
        raise
    return folder, generate, pooling


# its two servers load while the lane's other tests run (early_work)
offer("logit scale", server_job(__name__, 2, begin_logit_scale, lambda begun: begun[1:]))


def test_an_engine_logit_scale_is_the_heads(early_work):
    folder, generate, pooling = early_work.take("logit scale")
    directory, unscaled = folder / "llama", folder / "unscaled"
    gen = torch.Generator().manual_seed(2)
    batch = TeacherBatch([torch.randint(0, VOCAB, (n,), generator=gen) for n in (30, 12)], [10, 2])
    with serving(generate) as served, serving(pooling) as pooled:
        with ServedTeacher(served.url, top_k=MAX_LOGPROBS, client=FAST) as teacher:
            engine = teacher.score(batch)
        with ServedTeacher(pooled.url, head=directory, top_k=MAX_LOGPROBS, client=FAST) as teacher:
            assert teacher.head is not None and teacher.head.logit_scale == SCALE
            through_head = teacher.score(batch)
    off = 0.0
    for i in range(len(batch)):
        torch.testing.assert_close(through_head.token_log_probs[i].double(), engine.token_log_probs[i].double(),
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(through_head.topk_log_probs[i].double(), engine.topk_log_probs[i].double(),
                                   atol=1e-4, rtol=0)
        assert torch.equal(through_head.topk_ids[i][:, :5], engine.topk_ids[i][:, :5])
        tokens = batch.sequences[i][batch.response_starts[i]:]
        plain = TeacherHead.from_hf(unscaled).token_log_probs(through_head.hidden_states[i], tokens).double()
        off = max(off, float((plain - engine.token_log_probs[i].double()).abs().max()))
    assert off > 0.05, off  # without the scale the head is another distribution
    print(f"logit_scale {SCALE}: head vs vLLM's prompt log-probs within 1e-4; unscaled head {off:.3f} nats off")


def test_each_applied_row_is_read_where_the_lanes_vllm_reads_it():
    """Every file an applied row names is one of the lane's vLLM model files, reads the row's
    field, and reads it from the config the row says: `get_text_config()` in a `TEXT` row's file,
    none in an `OUTER` row's (each reads `vllm_config.model_config.hf_config`, config.json as written;
    teleflm.py through llama.py's `self.config`)."""
    found = subprocess.run([VLLM_PYTHON, "-c", "import importlib.util; "
                            "print(importlib.util.find_spec('vllm').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True, timeout=120)
    models = Path(found.stdout.strip()) / "model_executor" / "models"
    for row in HEAD_TRANSFORMS:
        for name in row.files:
            assert (models / name).is_file(), (row.key, name)
        if row.action != APPLIED:
            continue
        for name in row.files:
            source = (models / name).read_text()
            assert row.key in source, (row.key, name)
            assert ("get_text_config()" in source) == (row.reads == TEXT), (row.key, name, row.reads)
    assert {row.reads for row in HEAD_TRANSFORMS if row.action == APPLIED} == {OUTER, TEXT}


def test_each_embedding_output_file_projects_through_the_embeddings():
    """Every architecture `EMBEDDING_OUTPUT` reads the head of from the embeddings is built by a
    lane vLLM model file whose logits come from `self.model.embed_tokens` (no lm_head of its own)."""
    found = subprocess.run([VLLM_PYTHON, "-c", "import importlib.util; "
                            "print(importlib.util.find_spec('vllm').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True, timeout=120)
    models = Path(found.stdout.strip()) / "model_executor" / "models"
    for name in EMBEDDING_OUTPUT:
        source = (models / name).read_text()
        assert "logits_processor(self.model.embed_tokens" in source, name
        assert "self.lm_head" not in source, name
