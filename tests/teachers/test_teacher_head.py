"""`TeacherHead.from_hf`: a Hugging Face teacher's output layer alone, against transformers' own
model saved to a temp dir (untied, tied, a vision-language wrapper's text model) and, at TP=2 over
gloo, against the output-layer shard the package's own builder gives the student's layout."""
from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_rl_patches.testing.multirank import run_multirank

pytest.importorskip("transformers")

from megatron_rl_patches.teachers import TeacherHead  # noqa: E402
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    models = {"untied": save_tiny_hf(root / "untied", "qwen3", seed=1),
              "tied": save_tiny_hf(root / "tied", "qwen3", seed=2, tie_word_embeddings=True),
              "wrapped": save_tiny_hf(root / "wrapped", "qwen3_5", seed=3, tie_word_embeddings=True)}
    return root, models


def test_untied_head_is_lm_head(saved):
    root, models = saved
    head = TeacherHead.from_hf(root / "untied")
    assert torch.equal(head.weight, models["untied"].lm_head.weight)
    assert (head.vocab_size, head.padded_vocab_size, head.first_id, head.hidden_size) == (1001, 1001, 0, 32)
    assert head.nbytes == 1001 * 32 * 4


def test_tied_head_is_the_embedding(saved):
    root, models = saved
    model = models["tied"]
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # transformers ties them
    assert torch.equal(TeacherHead.from_hf(root / "tied").weight, model.lm_head.weight)


def test_wrapped_text_model_head(saved):
    """A vision-language wrapper's (Qwen3.5: text_config) tied embedding, under its text model's prefix."""
    root, models = saved
    assert "text_config" in json.loads((root / "wrapped" / "config.json").read_text())
    assert torch.equal(TeacherHead.from_hf(root / "wrapped").weight, models["wrapped"].lm_head.weight)


def test_dtype_and_padding_without_a_group(saved):
    root, models = saved
    head = TeacherHead.from_hf(root / "untied", dtype=torch.bfloat16, make_vocab_size_divisible_by=128)
    assert head.weight.shape == (1024, 32) and head.dtype == torch.bfloat16 and head.padded_vocab_size == 1024
    assert torch.equal(head.weight[:1001], models["untied"].lm_head.weight.bfloat16())
    assert not head.weight[1001:].any()  # padded rows are zero (and get no mass with vocab_size=1001)
    assert TeacherHead.from_hf(root / "untied", dtype="float64").dtype == torch.float64


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625),
                                          ("logits_scaling", 8.0)])
def test_head_transforms_are_refused_by_name(saved, tmp_path, field, value):
    import shutil

    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(root / "untied", copy)
    config = json.loads((copy / "config.json").read_text())
    config[field] = value
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        TeacherHead.from_hf(copy)
    config[field] = None if field == "final_logit_softcapping" else 1.0  # a neutral value is served
    (copy / "config.json").write_text(json.dumps(config))
    assert TeacherHead.from_hf(copy).vocab_size == 1001


def test_bad_arguments_are_named(saved, tmp_path):
    root, _ = saved
    with pytest.raises(ValueError, match="dtype"):
        TeacherHead.from_hf(root / "untied", dtype=torch.int32)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        TeacherHead.from_hf(root / "untied", make_vocab_size_divisible_by=0)
    with pytest.raises(FileNotFoundError, match="TeacherHead.from_hf"):
        TeacherHead.from_hf(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="a file; pass the checkpoint directory"):
        TeacherHead.from_hf(root / "untied" / "config.json")
    words = ("TeacherHead.from_hf(tp_group=...) needs torch.distributed initialized (the student's tensor-parallel "
             "group), or tp_group=None for the whole vocabulary on this rank")
    with pytest.raises(ValueError, match=re.escape(words)):
        TeacherHead.from_hf(root / "untied", tp_group=object())  # torch.distributed is not initialized here


def test_hub_cache_folder_named_as_the_loader_names_it(saved, tmp_path):
    import shutil

    root, _ = saved
    cache = tmp_path / "models--org--tiny"
    shutil.copytree(root / "untied", cache / "snapshots" / "abc")
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc")
    with pytest.raises(ValueError, match="hub cache folder.*snapshots/abc"):
        TeacherHead.from_hf(cache)
    assert TeacherHead.from_hf(cache / "snapshots" / "abc").vocab_size == 1001


def test_a_checkpoint_without_its_output_layer_is_named(saved, tmp_path):
    from megatron_rl_patches.testing.hf_checkpoints import write_safetensors

    root, models = saved
    copy = tmp_path / "headless"
    copy.mkdir()
    (copy / "config.json").write_text((root / "untied" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in models["untied"].state_dict().items() if k != "lm_head.weight"}
    write_safetensors(copy / "model.safetensors", state)
    with pytest.raises(ValueError, match="holds no lm_head.weight"):
        TeacherHead.from_hf(copy)
    config = json.loads((root / "untied" / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    write_safetensors(copy / "model.safetensors", {k: v for k, v in state.items() if "embed_tokens" not in k})
    words = ("holds no lm_head.weight or the tied embedding (model.embed_tokens.weight / "
             "model.language_model.embed_tokens.weight / language_model.model.embed_tokens.weight) (config.json's "
             "tie_word_embeddings=True)")
    with pytest.raises(ValueError, match=re.escape(words)):
        TeacherHead.from_hf(copy)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float64])
def test_without_a_dtype_in_config_json_the_tensors_own_is_kept(saved, tmp_path, stored):
    from megatron_rl_patches.testing.hf_checkpoints import write_safetensors

    root, models = saved
    config = json.loads((root / "untied" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                      if k not in ("dtype", "torch_dtype")}))
    weight = models["untied"].lm_head.weight.detach().to(stored)
    write_safetensors(tmp_path / "model.safetensors", {"lm_head.weight": weight.contiguous()})
    head = TeacherHead.from_hf(tmp_path)
    assert head.dtype == stored and head.checkpoint_dtype == stored and torch.equal(head.weight, weight)


def test_a_config_json_dtype_named_torch_dot_and_an_integer_weight(saved, tmp_path):
    """config.json's "torch.float16" (as torch writes a dtype) is float16; an int8 output layer is refused by name."""
    from safetensors.torch import save_file

    from megatron_rl_patches.testing.hf_checkpoints import write_safetensors

    root, models = saved
    config = json.loads((root / "untied" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "torch.float16", "torch_dtype": None}))
    weight = models["untied"].lm_head.weight.detach().contiguous()
    write_safetensors(tmp_path / "model.safetensors", {"lm_head.weight": weight})
    assert TeacherHead.from_hf(tmp_path).checkpoint_dtype == torch.float16
    save_file({"lm_head.weight": weight.to(torch.int8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape("'s lm_head.weight is I8; the head is read from a F64 / F32 / F16 "
                                                   "/ BF16 checkpoint only (dequantize it first)")):
        TeacherHead.from_hf(tmp_path)


@pytest.mark.parametrize(("hidden", "shown"), [([[0.0] * 32], "list"), (torch.zeros(2, 31), "(2, 31)"),
                                               (torch.zeros(32), "(32,)")])
def test_hidden_states_of_another_shape_are_refused_by_name(hidden, shown):
    head = TeacherHead(torch.zeros(5, 32), 5, 5, 0)
    with pytest.raises(ValueError, match=re.escape(f"hidden must be [R, 32] (the teacher's final hidden states, this "
                                                   f"head's width), got {shown}")):
        head.token_log_probs(hidden, torch.zeros(1, dtype=torch.long))


def _states(model, length: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T], transformers' final hidden states [T, H]) of a random sequence."""
    ids = torch.randint(0, 1001, (length,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = model.model(ids[None]).last_hidden_state[0]
    return ids, hidden


def _dense(hidden: torch.Tensor, weight: torch.Tensor, tau: float) -> torch.Tensor:
    return torch.log_softmax(hidden.double() @ weight.double().T / tau, dim=-1)


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_the_heads_distribution_equals_transformers(saved, tau):
    """float64 head: the dense float64 log-softmax within 1e-12; float32 head: transformers' own
    logits (float64 log-softmax) within 1e-5; top-64 (any K) ids, values and exact tail; the
    log-probs at ids the caller chose."""
    root, models = saved
    model = models["untied"]
    ids, hidden = _states(model)
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    want = torch.log_softmax(logits.double() / tau, dim=-1)
    exact = _dense(hidden, model.lm_head.weight, tau)
    head32 = TeacherHead.from_hf(root / "untied", make_vocab_size_divisible_by=128)  # padded rows masked
    head64 = TeacherHead.from_hf(root / "untied", dtype=torch.float64)
    tokens = torch.roll(ids, -1)
    for head, reference, tol in ((head32, want, 1e-5), (head64, exact, 1e-12)):
        got = head.token_log_probs(hidden, tokens, temperature=tau)
        torch.testing.assert_close(got.double(), reference.gather(1, tokens[:, None])[:, 0], atol=tol, rtol=0)
        top_ids, top_values, tail = head.topk(hidden, 64, temperature=tau)
        assert torch.equal(top_ids, exact.topk(64, dim=-1).indices)
        torch.testing.assert_close(top_values.double(), reference.gather(1, top_ids), atol=tol, rtol=0)
        rest = reference.clone().scatter_(1, top_ids, -torch.inf).logsumexp(-1)
        torch.testing.assert_close(tail.double(), rest, atol=tol * 10, rtol=0)
        chosen = torch.randint(0, 1001, (len(ids), 5), generator=torch.Generator().manual_seed(1))
        at, at_tail = head.log_probs_at(hidden, chosen, temperature=tau)
        torch.testing.assert_close(at.double(), reference.gather(1, chosen), atol=tol, rtol=0)
    with pytest.raises(ValueError, match=r"hidden must be \[R, 32\]"):
        head32.token_log_probs(hidden[:, :16], tokens)


def test_another_checkpoints_head_is_far_off(saved):
    """A negative control: the tied checkpoint's head over the untied one's states."""
    root, models = saved
    ids, hidden = _states(models["untied"])
    exact = _dense(hidden, models["untied"].lm_head.weight, 1.0)
    other = TeacherHead.from_hf(root / "tied").token_log_probs(hidden, torch.roll(ids, -1))
    assert (other.double() - exact.gather(1, torch.roll(ids, -1)[:, None])[:, 0]).abs().max() > 0.1


def _tp2(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    out: dict = {}
    with megatron_on_cpu(tensor_parallel=2):
        group = ps.get_tensor_model_parallel_group()
        for name in ("untied", "tied"):
            head = TeacherHead.from_hf(f"{root}/{name}", tp_group=group)
            student = build_inference_model_from_hf(f"{root}/{name}", dtype=torch.float32)[0]
            student = (student.shared_embedding_or_output_weight() if student.share_embeddings_and_output_weights
                       else student.output_layer.weight)
            out[name] = (head.weight.clone(), student.detach().clone(), head.first_id, head.padded_vocab_size)
        model = __import__("transformers").AutoModelForCausalLM.from_pretrained(f"{root}/untied").float().eval()
        ids, hidden = _states(model)
        head = TeacherHead.from_hf(f"{root}/untied", tp_group=group)
        out["scores"] = (head.token_log_probs(hidden, ids, temperature=0.7), *head.topk(hidden, 64, temperature=0.7))
        # one rank's bad argument is the same error on both ranks, raised before anything is shared
        try:
            TeacherHead.from_hf(f"{root}/untied", tp_group=group, dtype=torch.float32 if rank else "int8")
        except ValueError as error:
            out["refused"] = str(error)
    return out


def test_tp2_shards_equal_the_students_output_layer_shards(saved):
    root, models = saved
    ranks = run_multirank(_tp2, 2, str(root), timeout=300)
    for name in ("untied", "tied"):
        whole = models[name].lm_head.weight.detach()
        for rank, result in enumerate(ranks):
            head, student, first, padded = result[name]
            assert padded == 1024 and first == 512 * rank and head.shape == (512, 32)
            real = whole[first:first + 512]
            assert torch.equal(head[:real.shape[0]], real) and not head[real.shape[0]:].any(), (name, rank)
            assert torch.equal(head, student), (name, rank)  # the student's layout, padding included
    assert all("rank" in r["refused"] and "dtype" in r["refused"] for r in ranks)
    # the sharded head's scores equal the whole head's on every rank
    ids, hidden = _states(models["untied"])
    whole = TeacherHead.from_hf(root / "untied")
    want = (whole.token_log_probs(hidden, ids, temperature=0.7), *whole.topk(hidden, 64, temperature=0.7))
    for result in ranks:
        assert torch.equal(result["scores"][1], want[1])
        for got, ref in zip(result["scores"], want):
            torch.testing.assert_close(got, ref, atol=2e-6, rtol=0)
