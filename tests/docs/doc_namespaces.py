"""What each documentation page's `# fragment: uses NAME, ...` blocks use but do not define, built small
and real (CPU), in the fresh interpreter that runs the page's fragments (doc_fragment_run.py).

`PAGES[page]` is a `Page`: `build(stack)` returns the names its fragments may be given (each is given
exactly the names it lists, in page order; what a fragment binds is kept for `finish`);
`before(block, ns)` may rebind names for one block (two examples on a page that use one name for
different things); `replace` maps literal strings in the blocks to real values (e.g. a checkpoint
path); `finish(ns)` runs after the last fragment (e.g. calls a test function the page defines).
`megatron=True`: the page needs megatron-core (marker); `verl=True`: it needs verl (marker `verl`,
skipped where verl is not importable).
`OUTPUTS[name]()` returns the text a `docs-test: output-of: name` block must show.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import runpy
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from doc_blocks import REPO


@dataclass
class Page:
    build: Callable[[ExitStack], dict] = lambda stack: {}
    megatron: bool = False
    verl: bool = False  # needs verl: runs in the verl lane (`make test-verl`), skipped elsewhere
    before: Callable[[Any, dict], None] = lambda block, ns: None
    replace: Callable[[dict], dict] = lambda ns: {}
    finish: Callable[[dict], None] = lambda ns: None
    notes: list = field(default_factory=list)


def lm_head_logits(rows: int, vocab: int, hidden: int = 16, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] logits made by a small LM head, so they require grad and are not a leaf."""
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen).requires_grad_()
    return states @ weight.T


def token_ids(rows: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed))


def megatron_world(stack: ExitStack) -> Any:
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    return stack.enter_context(megatron_on_cpu())


def saved_teacher(stack: ExitStack, provider: Callable[..., Any]) -> str:
    """A weights file (a torch state dict) of the provider's model, for `load_dir=`."""
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="docs-teacher-")))
    path = folder / "teacher.pt"
    torch.save(provider(True, True).state_dict(), path)
    return str(path)


# ---------------------------------------------------------------------------- README.md


def readme(stack: ExitStack) -> dict:
    """README's fragments define their own inputs: the test gives them nothing (each also runs
    alone in a fresh process, test_readme_as_written.py)."""
    return {}


# ---------------------------------------------------------------------------- docs/inference-only.md


def inference_only(stack: ExitStack) -> dict:
    kit = megatron_world(stack)

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        batch = next(data_iterator)
        return kit.forward(model, batch), batch["labels"]

    batches = [kit.batch(batch_size=1, seed=i) for i in range(4)]
    return {
        "model_provider": kit.provider(),
        "teacher_checkpoint": saved_teacher(stack, kit.provider(seed=7)),
        "data_iterator": iter(batches),
        "_labels": [batch["labels"] for batch in batches],
        "forward_step": forward_step,
    }


def inference_only_finish(ns: dict) -> None:
    results = ns["results"]  # one per micro-batch: log-probs of each batch's labels
    assert [r["log_probs"].shape for r in results] == [labels.shape for labels in ns["_labels"]]
    assert all(bool((r["log_probs"] <= 0).all()) for r in results)


# ---------------------------------------------------------------------------- docs/logprobs.md


def logprobs(stack: ExitStack) -> dict:
    total_lengths, response_lengths, vocab = [5, 7], [3, 4], 50
    rows = sum(total_lengths)
    gen = torch.Generator().manual_seed(2)
    inputs = {
        "logits": lm_head_logits(rows, vocab),
        "tokens": token_ids(rows, vocab),
        "tp_group": None,
        "rollout_temperature": 0.8,
        "entropy_coef": 0.01,
        "total_lengths": total_lengths,
        "response_lengths": response_lengths,
        "cp": 1,
        "rank": 0,
        "unconcat_tokens": [torch.randint(0, vocab, (n,), generator=gen) for n in total_lengths],
    }
    return {**inputs, "_inputs": inputs}


def logprobs_before(block: Any, ns: dict) -> None:
    """The fragments get the packed batch's inputs, not the runnable example's toy `logits`."""
    if block.text.startswith("# fragment:"):
        ns.update(ns["_inputs"])


# ---------------------------------------------------------------------------- docs/testing.md


def testing(stack: ExitStack) -> dict:
    kit = megatron_world(stack)
    from megatron_rl_patches import reentrant_train

    @reentrant_train
    def my_train(rollout_id: int, model: list, batches: list) -> None:
        """One rollout of a Megatron-style step: zero the grad buffers, the real schedule, the
        grad sync, an SGD step on main_grad."""
        for chunk in model:
            chunk.zero_grad_buffer()
        kit.run_schedule(model, batches)
        for chunk in model:
            chunk.finish_grad_sync()
        kit.sgd_step(model)

    return {"my_train": my_train, "_kit": kit}


def testing_finish(ns: dict) -> None:
    ns["test_my_train_loop_survives_two_rollouts"](ns["_kit"])


# ---------------------------------------------------------------------------- docs/fused-lm-head.md


def fused_lm_head(stack: ExitStack) -> dict:
    kit = megatron_world(stack)
    from megatron_rl_patches import build_inference_model

    vocab = 128  # above the k = 64 the page picks
    batch = kit.batch(vocab_size=vocab, seed=0)
    (teacher,) = build_inference_model(kit.provider(vocab_size=vocab, seed=7))
    return {
        "torch": torch,
        "model": kit.gpt(vocab_size=vocab, seed=0),
        "teacher": teacher,
        "tokens": batch["tokens"],
        "position_ids": batch["position_ids"],
        "attention_mask": batch["attention_mask"],
        "targets": batch["labels"],
        "advantages": torch.randn(batch["labels"].shape, generator=torch.Generator().manual_seed(3)),
    }


def fused_lm_head_finish(ns: dict) -> None:
    ns["loss"].backward()
    assert ns["kl"].shape == ns["targets"].shape and bool(torch.isfinite(ns["kl"]).all())


# ---------------------------------------------------------------------------- docs/topk-opd.md


def topk_example_module() -> Any:
    spec = importlib.util.spec_from_file_location("docs_topk_opd_cpu", REPO / "examples" / "topk_opd_cpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def topk_opd(stack: ExitStack) -> dict:
    kit = megatron_world(stack)
    example = topk_example_module()
    student = example.build_student(0)
    return {"_gpt_example": {
        "response_logits": example.response_logits,
        "student": student,
        "teachers": example.build_teachers(100),
        "optimizer": torch.optim.Adam(student.parameters(), lr=example.LR),
        "batch": example.sample(student, batch_seed=0, gen=torch.Generator().manual_seed(0)),
    }, "_fused_route": _fused_route_names(kit)}


def _fused_route_names(kit: Any) -> dict:
    """The fused-route fragment's names: a DDP GPT student and teacher providers, vocab 128 (> k = 64)."""
    vocab = 128
    batch = kit.batch(vocab_size=vocab, seed=0)
    return {
        "student": kit.ddp(kit.gpt(vocab_size=vocab, seed=0)),
        "teacher_providers": [kit.provider(vocab_size=vocab, seed=7 + j) for j in range(2)],
        "tokens": batch["tokens"],
        "position_ids": batch["position_ids"],
        "attention_mask": batch["attention_mask"],
        "loss_mask": torch.ones(batch["tokens"].shape),
    }


def topk_opd_before(block: Any, ns: dict) -> None:
    """The megatron GPT fragments' `student` / `teachers` / `batch` are the example's GPTs and
    samples, not the pure torch example's linear layers above them."""
    if "response_logits(student, batch)" in block.text:
        ns.update(ns["_gpt_example"])
    elif "topk_output_processor" in block.text:
        ns.update(ns["_fused_route"])


def topk_opd_finish(ns: dict) -> None:
    example = ns["_gpt_example"]
    assert all(p.grad is not None for p in example["student"].parameters())
    assert all(p.grad is None and not p.requires_grad for t in example["teachers"] for p in t.parameters())


PAGES: dict[str, Page] = {
    "README.md": Page(readme, megatron=True),
    "docs/inference-only.md": Page(
        inference_only,
        megatron=True,
        replace=lambda ns: {'"/ckpt/teacher"': repr(ns["teacher_checkpoint"])},
        finish=inference_only_finish,
    ),
    "docs/logprobs.md": Page(logprobs, before=logprobs_before),
    "docs/testing.md": Page(testing, megatron=True, finish=testing_finish),
    "docs/fused-lm-head.md": Page(fused_lm_head, megatron=True, finish=fused_lm_head_finish),
    "docs/topk-opd.md": Page(topk_opd, megatron=True, before=topk_opd_before, finish=topk_opd_finish),
    "docs/recipes.md": Page(verl=True),
    "docs/shared-prefix.md": Page(megatron=True),  # its example's command: a megatron-core training step
}


# ---------------------------------------------------------------------------- output-of producers


def padding_report() -> str:
    """docs/inference-only.md: the tiny model's grad-buffer lines with the distributed optimizer,
    overlap_grad_reduce and bucket_size=4000."""
    from megatron_rl_patches import training_state_bytes
    from megatron_rl_patches.apps.presentation import memory_report

    with ExitStack() as stack:
        kit = megatron_world(stack)
        ddp = kit.ddp(kit.gpt(seed=0), use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=4000)
        text = memory_report(training_state_bytes(ddp))
    return text[text.index("grad buffer counted"):]


def topk_example() -> str:
    """docs/topk-opd.md: `python examples/topk_opd_cpu.py`, run in this process."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = ["examples/topk_opd_cpu.py"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(REPO / "examples" / "topk_opd_cpu.py"), run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


OUTPUTS: dict[str, Callable[[], str]] = {"padding_report": padding_report, "topk_example": topk_example}
MEGATRON_OUTPUTS = {"padding_report", "topk_example"}
