"""slime's role names: the default set of `inference_roles` lives with slime's wrapper, not in the
environment module (which checks the variable's syntax only). The patch itself on a stand-in
slime and real megatron-core: tests/integrations/slime/test_slime_roles_patch.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl_patches.integrations.slime import roles as slime_roles
from megatron_rl_patches.patching import env


def test_unset_means_slimes_teacher_roles_empty_means_none():
    assert slime_roles.inference_roles({}) == ["prm_teacher", "teacher"]
    assert slime_roles.inference_roles({env.INFERENCE_ROLES: ""}) == []
    assert slime_roles.inference_roles({env.INFERENCE_ROLES: "ref, teacher"}) == ["ref", "teacher"]


def test_the_environment_module_checks_syntax_and_knows_no_role_name():
    with pytest.raises(ValueError, match="'prm-teacher' is not a role name"):
        env.checked_role_names({env.INFERENCE_ROLES: "teacher,prm-teacher"})
    assert env.checked_role_names({}) is None and env.checked_role_names({env.INFERENCE_ROLES: "x,y"}) == ["x", "y"]
    source = Path(env.__file__).read_text()
    assert not [role for role in slime_roles.DEFAULT_INFERENCE_ROLES if role in source]


@pytest.mark.parametrize("value, says", [("teacher:strem", "has residency 'strem'"),
                                         ("teacher,teacher:stream", "more than once"),
                                         ("tea cher", "is not a role name")])
def test_the_patch_refuses_what_the_start_up_check_refuses_naming_the_variable(value, says):
    """issue 38: through apply(), `teacher:strem` failed at the build without naming the variable."""
    with pytest.raises(ValueError, match=f"{env.INFERENCE_ROLES}=.*{says}"):
        slime_roles.inference_roles({env.INFERENCE_ROLES: value})
