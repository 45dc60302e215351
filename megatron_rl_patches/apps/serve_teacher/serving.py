"""Start `serve-teacher` (`serve`): the engine built, then the app served by uvicorn on one event
loop (vLLM's own server does the same); the engine shut down on exit."""
# lazy imports: import cost: vLLM, FastAPI, uvicorn and prometheus_client load only when the command runs
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

LOG = logging.getLogger("megatron_rl_patches.serve_teacher")


def serve(model: str, host: str, port: int, api_key: str | None, extra: Sequence[str]) -> None:
    """Serve `model` at host:port until stopped (SIGINT / SIGTERM) or until the engine dies."""
    asyncio.run(serving(model, host, port, api_key, extra))


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
        LOG.info("serve-teacher: %s at http://%s:%d (prefix sharing on%s)", engine.name, host, port,
                 ", API key required" if api_key else "")
        await server.serve()
    finally:
        engine.shutdown()
