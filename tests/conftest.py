"""Test-session settings shared by every test module."""

import os

import pytest

# One BLAS thread per process: the tests spawn several ranks on a machine with few cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

EARLY_LAUNCHES = (4,)
"""Shared NeMo launches (by world size) started before the first test when a selected test
needs them (``tests.harness.shared_launch``): the 4-rank one's first user comes half-way
through the suite, and its ranks fill the CPU the tests before it leave idle."""


@pytest.fixture(scope="session", autouse=True)
def _early_shared_launches(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.harness.shared_launch import start_needed_launches

    modules = {item.module.__name__ for item in request.session.items if item.module}
    start_needed_launches(modules, tmp_path_factory, EARLY_LAUNCHES)
