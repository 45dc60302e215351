"""A router in front of vLLM (the served lane runs the real sglang-router 0.3.2: its own
`/v1/models` card, a 422 for a token-id prompt, 404 for /pooling): what the teacher says, with
stand-ins answering the router's two refusals, each named with what to give instead."""
from __future__ import annotations

import pytest

from megatron_rl_patches.teachers import ServedTeacher
from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal
from tests.teachers.local_servers import url_of, vllm_like

ROUTER_422 = ("Failed to deserialize the JSON body into the target type: prompt: data did not match any variant of "
              "untagged enum StringOrArray at line 1 column 29")


def router_card(_):
    return 200, {"object": "list", "data": [{"id": "unknown", "object": "model", "owned_by": "local"}]}


def refuses_ids(_):
    return 422, ROUTER_422


@pytest.mark.parametrize("routes, error", [({"v1_models": router_card}, ServedTeacherError),
                                           ({"v1_completions": refuses_ids}, ServedTeacherRefusal)],
                         ids=["its own model card", "token ids refused"])
def test_a_router_in_front_is_named_with_what_to_give_instead(routes, error):
    with vllm_like(**routes) as server, ServedTeacher(url_of(server), engine="vllm", top_k=2) as teacher:
        with pytest.raises(error) as refused:
            teacher.check()
    said = str(refused.value)
    assert "router in front of the engine" in said and "joined by '|'" in said, said
