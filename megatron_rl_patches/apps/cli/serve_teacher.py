"""`megatron-rl-patches serve-teacher MODEL_DIR [--host --port --api-key] [-- vLLM engine arguments]`:
a teacher server on vLLM's engine held in process (`apps.serve_teacher`), answering every route
`ServedTeacher` speaks and computing a group's shared prefix once. vLLM is imported only here."""
from __future__ import annotations

import argparse
import os

from megatron_rl_patches.apps.cli._common import OK, PROBLEM, UsageError, say

PASSES_THROUGH = True  # the arguments after '--' are vLLM's (args.passed_through)
KEY_VARIABLE = "VLLM_API_KEY"  # as vLLM's own server: the key from the environment, off the command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", help="the teacher's Hugging Face checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument("--api-key", default=None,
                        help=f"the key every route asks for (Authorization: Bearer KEY); better from ${KEY_VARIABLE}, "
                             f"which a process listing does not show")
    parser.epilog = ("after '--': vLLM engine arguments (e.g. -- --dtype bfloat16 --max-model-len 8192); the pooling "
                     "runner and the prefix cache are the server's own")


def run(args: argparse.Namespace) -> int:
    extra = list(args.passed_through)
    if any(word == "--api-key" or word.startswith("--api-key=") for word in extra):  # vLLM's parser would echo it
        raise UsageError(f"--api-key is this command's, not an engine argument: give it before '--' (or set "
                         f"${KEY_VARIABLE})")
    if not os.path.isdir(args.model):
        raise UsageError(f"MODEL_DIR {args.model!r} is no directory: give the teacher's Hugging Face checkpoint "
                         f"directory")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is no port: give 1..65535")
    from megatron_rl_patches.apps.serve_teacher.serving import serve  # lazy: import cost: vLLM, FastAPI, uvicorn

    try:
        serve(args.model, args.host, args.port, args.api_key or os.environ.get(KEY_VARIABLE) or None, extra)
    except (ValueError, RuntimeError) as refused:
        say("serve-teacher", str(refused))
        return PROBLEM
    return OK
