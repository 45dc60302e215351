"""The verl lane (`make test-verl`): verl 0.9.1's real engine, model-forward and distillation
code on tiny packed GPTModels on CPU. Every module here is marked `verl` and skips cleanly where
verl is not importable (the main lanes). The modules skip on `verl.models`, not `verl`: where
verl is missing, tests/integrations/ on sys.path makes tests/integrations/verl/ a namespace
package `verl` (a real verl, a regular package, always wins over it). The vLLM servers of the
modules that define `launch_server(root)` start together at the lane's first test (`launched`,
asked for by `servers_load_from_the_first_test`), so they load while the modules before theirs run."""
from __future__ import annotations

import os

import pytest


@pytest.fixture
def verl_cpu(clean_patch_state):
    """Megatron on CPU (gloo, parallel state, CPU shims); no patch applied before or after."""
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu() as env:
        yield env


@pytest.fixture(scope="session")
def launched(request, tmp_path_factory):
    """{module name: (server, what the module's fixture needs)} for every collected module with a
    `launch_server(root)` (a real vLLM server, started, not yet ready), all started at once so they
    load side by side; each module's fixture takes its own (`served_by`). Stopped at the end."""
    from megatron_rl_patches.testing.vllm_server import stop

    started: dict[str, tuple] = {}
    try:
        if os.environ.get("MRP_VLLM_PYTHON"):
            for module in dict.fromkeys(item.module for item in request.session.items):
                launch = getattr(module, "launch_server", None)
                if launch is not None:
                    started[module.__name__] = launch(tmp_path_factory.mktemp(module.__name__.rpartition(".")[2]))
        yield started
    finally:
        for server, _ in started.values():
            stop(server.process)


@pytest.fixture(scope="session", autouse=True)
def servers_load_from_the_first_test(launched):
    """The lane's vLLM servers started with its first test, not with the first served module's
    (alphabetically the eighth): a server's load is about one core for 30-60 s, which the lane's
    serial tests before it leave free (issue 87 item 8)."""
    return launched
