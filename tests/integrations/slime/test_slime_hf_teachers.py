"""slime_opd's `PATH` teachers from Hugging Face directories (integrations/megatron/opd/hf_teachers.py)
without slime's source, on real megatron-core (1 rank; PP=2 in tests/inference/loading/hf/
test_hf_multirank.py, slime's real train_actor in the slime lane): the routing decision (the same
architecture as the actor: slime's snapshot route; another: a separate inference-only model), bad
paths and a foreign vocabulary refused before anything loads, and the teacher of another hidden
size and depth scoring the student's ids through `load_teachers` equal to transformers' forward,
its padding rows given no mass."""
from __future__ import annotations

import json
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches.inference.loading.hf.architecture import UnsupportedCheckpointError
from megatron_rl_patches.integrations.megatron.opd import hf_teachers
from megatron_rl_patches.integrations.megatron.opd.opd_settings import LOSS_PATH, TEACHERS, opd_settings
from megatron_rl_patches.integrations.slime import opd as slime_opd
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

pytestmark = pytest.mark.megatron

VOCAB, SEQ, K = 1001, 12, 5
OTHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64)  # another size than the actor


def _actor_args(**overrides):
    """slime's actor arguments of the model tiny_hf_config("qwen3") describes."""
    values = dict(hidden_size=32, num_layers=2, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                  kv_channels=8, ffn_hidden_size=48, num_experts=None, vocab_size=VOCAB, qk_layernorm=True,
                  add_qkv_bias=False, untie_embeddings_and_output_weights=True, loss_type="custom_loss",
                  custom_loss_function_path=LOSS_PATH, context_parallel_size=1, allgather_cp=False,
                  transformer_impl="local", params_dtype=torch.float32, hf_checkpoint="none")
    values.update(overrides)
    return Namespace(**values)


class _Actor:
    """What load_teachers reads of slime's actor: args, model, the snapshot loader and switch."""

    def __init__(self, args):
        self.args, self.log = args, []
        self.model = [SimpleNamespace(vocab_size=1024, config=SimpleNamespace(variable_seq_lengths=True))]
        own = {"w": torch.zeros(2)}
        self.weights_backuper = SimpleNamespace(get=lambda tag: own)

    def load_other_checkpoint(self, tag, path):
        self.log.append(("load", tag, path))

    def _switch_model(self, tag):
        self.log.append(("switch", tag))


def _config_dir(root, name, **overrides):
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_hf_config(**overrides)))
    return str(path)


def test_the_route_follows_the_shape_of_the_model(tmp_path):
    args, what = _actor_args(), "teacher"
    assert hf_teachers.local_loading(_config_dir(tmp_path, "same"), args, what) == (hf_teachers.SNAPSHOT, [])
    route, differences = hf_teachers.local_loading(_config_dir(tmp_path, "other", **OTHER), args, what)
    assert route == hf_teachers.HF
    assert differences == ["hidden_size: teacher 48, actor 32", "num_hidden_layers: teacher 4, actor 2",
                           "intermediate_size: teacher 64, actor 48"]
    # the same sizes, another family: Llama has no q/k norm
    assert hf_teachers.local_loading(_config_dir(tmp_path, "llama", kind="llama"), args, what) == \
        (hf_teachers.HF, ["qk_norm: teacher False, actor True"])
    route, differences = hf_teachers.local_loading(_config_dir(tmp_path, "moe", kind="qwen3_moe"), args, what)
    assert route == hf_teachers.HF and "num_experts: teacher 4, actor 0" in differences
    vocab = _config_dir(tmp_path, "vocab", vocab_size=VOCAB + 1)
    assert hf_teachers.local_loading(vocab, args, what)[0] == hf_teachers.HF
    # the same shapes, another RoPE base: slime's route would run it with the actor's
    rope = _config_dir(tmp_path, "rope", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert hf_teachers.local_loading(rope, _actor_args(rotary_base=10000, norm_epsilon=1e-6), what) == \
        (hf_teachers.HF, ["rope_theta: teacher 1000000.0, actor 10000"])
    # Megatron checkpoints and paths slime's own loader reports on stay slime's
    megatron = tmp_path / "megatron"
    megatron.mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("3")
    assert hf_teachers.local_loading(str(megatron), args, what)[0] == hf_teachers.SNAPSHOT
    assert hf_teachers.local_loading(str(tmp_path / "missing"), args, what)[0] == hf_teachers.SNAPSHOT


def test_an_unserved_family_of_another_shape_is_refused_one_of_the_same_shape_is_slimes(tmp_path):
    args = _actor_args()
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({**tiny_hf_config(), "model_type": "gemma3", "hidden_size": 64}))
    with pytest.raises(UnsupportedCheckpointError, match="model_type 'gemma3'.*not served"):
        hf_teachers.local_loading(str(gemma), args, "teacher")
    (gemma / "config.json").write_text(json.dumps({**tiny_hf_config(), "model_type": "gemma3"}))
    assert hf_teachers.local_loading(str(gemma), args, "teacher")[0] == hf_teachers.SNAPSHOT


def test_hugging_face_files_instead_of_their_directory_are_refused_naming_the_variable(tmp_path):
    directory = _config_dir(tmp_path, "hf", **OTHER)
    settings = opd_settings({TEACHERS: f"{directory}/config.json"})
    with pytest.raises(ValueError, match=f"{TEACHERS}: teacher .*config.json' is a file of a Hugging Face "
                                         "checkpoint; name the directory"):
        slime_opd.load_teachers(_Actor(_actor_args()), settings)
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=f"{TEACHERS}: teacher .*weights_only' holds \\*.safetensors but no "
                                         "config.json"):
        slime_opd.load_teachers(_Actor(_actor_args()), opd_settings({TEACHERS: str(weights_only)}))


def test_a_foreign_vocabulary_is_refused_before_any_teacher_loads(tmp_path, monkeypatch):
    from megatron_rl_patches.inference import build_hf

    def never(*args, **kwargs):
        raise AssertionError("the teacher was built")

    monkeypatch.setattr(build_hf, "build_inference_model_from_hf", never)
    other = _config_dir(tmp_path, "other", vocab_size=999, **OTHER)
    actor = _Actor(_actor_args())
    with pytest.raises(ValueError, match=f"{TEACHERS}: teacher .*other'.*vocab_size=999 but the student "
                                         f"has vocab_size={VOCAB}"):
        slime_opd.load_teachers(actor, opd_settings({TEACHERS: f"{tmp_path / 'snapshot'},{other}"}))
    assert actor.log == []  # not even the first (snapshot) teacher was loaded


def test_ranks_that_see_the_path_differently_all_fail(tmp_path, monkeypatch):
    """The agreement itself (gloo is single-rank here): a rank whose MIN and MAX differ raises."""
    monkeypatch.setattr(hf_teachers, "_agreed", lambda code: (0, 1))
    with pytest.raises(ValueError, match="the ranks see it differently"):
        hf_teachers.teacher_loading(_config_dir(tmp_path, "other", **OTHER), _actor_args(), "teacher")
    monkeypatch.setattr(hf_teachers, "_agreed", lambda code: (0, 2))
    with pytest.raises(ValueError, match="another rank refused it"):
        hf_teachers.teacher_loading(_config_dir(tmp_path, "same"), _actor_args(), "teacher")


@pytest.fixture
def fused_processors(clean_patch_state):
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")
    yield
    megatron_rl_patches.revert()


def test_a_teacher_of_another_size_scores_the_students_ids_as_transformers(megatron_cpu, fused_processors, tmp_path):
    pytest.importorskip("transformers", reason="the reference forward needs transformers (the hf-test extra)")
    from megatron_rl_patches.integrations.megatron.opd.hidden_teachers import real_vocab_size
    from megatron_rl_patches.processors.combined import with_topk
    from megatron_rl_patches.processors.heads import log_prob_output_processor
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    reference = save_tiny_hf(tmp_path / "other", "qwen3", seed=3, **OTHER)
    actor = _Actor(_actor_args())
    loaded = slime_opd.load_teachers(actor, opd_settings({TEACHERS: f"{tmp_path / 'snapshot'},{tmp_path / 'other'}"}))
    assert loaded[0] == "opd_teacher_0" and actor.log[-1] == ("switch", "actor")
    (chunk,) = loaded[1]
    assert len(chunk.decoder.layers) == 4 and chunk.config.hidden_size == 48
    assert chunk.config.variable_seq_lengths  # the actor's schedule settings (packed batches)
    assert not any(p.requires_grad for p in chunk.parameters())
    assert chunk.output_layer.weight.shape[0] == 1024 and real_vocab_size(SimpleNamespace(module=chunk)) == VOCAB
    assert real_vocab_size(SimpleNamespace(module=SimpleNamespace())) is None

    batch = make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=5)
    ids = torch.randint(0, VOCAB, (2, SEQ, K), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = torch.log_softmax(reference(batch["tokens"]).logits.double(), dim=-1)

    def scored(vocab_size):
        options = {"temperature": 1.0, "vocab_size": vocab_size}
        processor = with_topk(log_prob_output_processor(**options), None, options, {"ids": ids})
        with torch.no_grad():
            return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                         output_processor=processor, output_processor_context={})

    out = scored(real_vocab_size(chunk))
    want_logp = full.gather(-1, ids)
    want_tail = torch.log1p(-want_logp.exp().sum(-1))
    want_labels = full.gather(-1, batch["labels"][..., None])[..., 0]
    errors = {"log_probs": (out["log_probs"].double() - want_labels).abs().max(),
              "topk": (out["topk_log_probs"].double() - want_logp).abs().max(),
              "tail": (out["tail"].double() - want_tail).abs().max()}
    print("other-architecture teacher vs transformers:", {k: f"{float(v):.1e}" for k, v in errors.items()})
    assert all(err < 1e-5 for err in errors.values()), errors
    # the negative control: scored over the padded vocab, Megatron's 23 zero rows take mass
    assert (scored(None)["topk_log_probs"].double() - want_logp).abs().max() > 1e-3


def test_one_tokenizer_with_another_padded_vocab_gives_its_padding_no_mass(megatron_cpu, tmp_path):
    """Qwen2.5-7B+ (vocab_size 152064) teaching a Qwen2.5-1.5B actor (151936), one tokenizer: the
    teacher is served, and its chunks carry the shared real vocab (the tokenizer's) that slime's
    fused route passes to the ops as vocab_size, so neither model's padding rows get mass."""
    import json

    from megatron_rl_patches.integrations.megatron.opd import hf_teachers
    from megatron_rl_patches.integrations.megatron.opd.hidden_teachers import real_vocab_size
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    tokenizer = json.dumps({"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(900)}}, "added_tokens": []})
    for name, vocab in (("teacher", 1024), ("student", VOCAB)):
        write_tiny_checkpoint(tmp_path / name, tiny_hf_config("qwen3", vocab_size=vocab))
        (tmp_path / name / "tokenizer.json").write_text(tokenizer)
    chunks = hf_teachers.build_hf_teacher(_actor_args(), str(tmp_path / "teacher"), None, str(tmp_path / "student"),
                                          None, "teacher")
    assert real_vocab_size(chunks[0]) == 900 and chunks[0].output_layer.weight.shape[0] == 1024

