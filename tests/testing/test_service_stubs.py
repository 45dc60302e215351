"""The kit's service stand-ins (testing.service_stubs): each service package and its submodules
import, every name in them is inert, decorators leave what they decorate as it is; removal forgets them."""
from __future__ import annotations

import importlib
import sys

import pytest

from megatron_rl_patches.testing import service_stubs
from megatron_rl_patches.testing.service_stubs import SERVICES, install_service_stubs, remove_service_stubs

NAMES = ("mrp_fake_ray", "json.mrp_stand_in")  # the second below a real package, as megatron.bridge


@pytest.fixture
def stubs():
    finder = install_service_stubs(NAMES)
    yield finder
    remove_service_stubs()


def test_every_named_service_and_its_submodules_import_as_inert_modules(stubs):
    ray = importlib.import_module("mrp_fake_ray")
    queue = importlib.import_module("mrp_fake_ray.util.queue")
    assert service_stubs.is_stand_in(ray) and service_stubs.is_stand_in(queue)
    from mrp_fake_ray.actor import ActorHandle  # noqa: F401 - a name imported from a stand-in is inert
    handle = ray.get(ray.put(3))
    assert not handle and list(handle) == [] and "inert" in repr(handle)
    with ray.profiling.span("x") as span:
        assert not span
    assert service_stubs.is_stand_in(importlib.import_module("json.mrp_stand_in.deeper"))
    assert not service_stubs.is_stand_in(importlib.import_module("json.decoder"))  # the real package's own


def test_a_decorator_leaves_its_function_or_class_and_a_base_class_works(stubs):
    ray = importlib.import_module("mrp_fake_ray")

    @ray.remote
    class Worker:
        def ping(self):
            return "pong"

    @ray.remote(num_gpus=1)
    def task():
        return 1

    assert Worker().ping() == "pong" and task() == 1

    class Subclass(ray.Actor):
        pass

    assert Subclass() is not None


def test_a_real_package_already_imported_is_refused_and_removal_forgets():
    with pytest.raises(RuntimeError, match=r"\['json'\] are imported already"):
        install_service_stubs(("json",))
    install_service_stubs(NAMES)
    importlib.import_module("mrp_fake_ray")
    remove_service_stubs()
    assert "mrp_fake_ray" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mrp_fake_ray")


def test_the_default_list_names_the_services_nemo_rl_imports():
    assert set(SERVICES) == {"ray", "mlflow", "wandb", "swanlab", "hydra", "fastapi", "zmq", "tensorboard",
                             "pynvml", "megatron.bridge"}
