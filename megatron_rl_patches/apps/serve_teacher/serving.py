"""Start `serve-teacher` (`serve`): the engine built, then the app served by uvicorn on one event
loop (vLLM's own server does the same); the engine shut down on exit."""
# lazy imports: import cost: vLLM, FastAPI, uvicorn and prometheus_client load only when the command runs
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

LOG = logging.getLogger("megatron_rl_patches.serve_teacher")


def serve(model: str, host: str, port: int, api_key: str | None, extra: Sequence[str]) -> None:
    """Serve `model` at host:port until stopped (SIGINT / SIGTERM) or until the engine dies."""
    asyncio.run(serving(model, host, port, api_key, extra))


def server_url(host: str, port: int) -> str:
    """`http://host:port` as a client writes it: an IPv6 address in brackets (`http://[::1]:8000`;
    a zone's '%' escaped as '%25', RFC 6874), a name or an IPv4 address as it is."""
    if ":" in host and not host.startswith("["):
        host = f"[{host.replace('%', '%25')}]"
    return f"http://{host}:{port}"


def start_line(name: str, host: str, port: int, block_size: int, keyed: bool) -> str:
    """The line the server logs once it serves: where (a URL a client takes as it is), the KV
    block it shares prompts in, and the shortest prompt it shares (vLLM's prefix cache holds whole
    blocks only)."""
    return (f"serve-teacher: {name} at {server_url(host, port)} (prefix sharing on, KV blocks of {block_size} tokens: "
            f"a group shares its prompt's whole blocks, so a prompt shares nothing under {block_size} tokens"
            f"{'; API key required' if keyed else ''})")


async def serving(model: str, host: str, port: int, api_key: str | None, extra: Sequence[str]) -> None:
    import uvicorn

    from megatron_rl_patches.apps.serve_teacher.app import teacher_app
    from megatron_rl_patches.apps.serve_teacher.engine import TeacherEngine

    engine = TeacherEngine(model, extra)
    server: uvicorn.Server | None = None

    def on_engine_death() -> None:
        LOG.error("serve-teacher: vLLM's engine died; stopping the server (clients fail over to other replicas)")
        if server is not None:
            server.should_exit = True

    try:
        app = teacher_app(engine, api_key, on_engine_death)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False))
        # the command's own line on stderr (a logger's info line was never shown: no handler takes it)
        print(start_line(engine.name, host, port, engine.block_size, api_key is not None), file=sys.stderr, flush=True)
        await server.serve()
    finally:
        engine.shutdown()
