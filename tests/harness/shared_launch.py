"""One spawn of ``world`` ranks that runs the NeMo fits of several test modules, started early.

A spawn costs far more than its fits (process start and ``import nemo`` on every rank), so test
modules whose fits need no fresh processes register them here at import (pytest imports every
test module before the first test runs); the first module that asks for results gets every
registered fit's, and the others read theirs by name.

The session starts each launch in a background thread before the first test
(``tests/conftest.py``) when a selected test needs it: its ranks then run while the tests
before its first user run, which on a two-core machine leave about a quarter of the CPU idle
(ranks waiting on their peers, processes starting, fault tests waiting out their timeouts).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from tests.harness.strategy import Fit, run_fits

__all__ = ["SharedLaunch", "shared_launch", "start_needed_launches"]


class SharedLaunch:
    """The fits of several test modules, run in one spawn of ``world`` ranks.

    Relative checkpoint and weight paths land under :attr:`out_dir`.

    Example::

        LAUNCH = shared_launch(4)
        LAUNCH.add([Fit("base_tp1_dp4"), Fit("tp1_gtp2_dp2", gtp=2)])

        @pytest.fixture(scope="module")
        def four_ranks(tmp_path_factory):
            return LAUNCH.results(tmp_path_factory)
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.fits: list[Fit] = []
        self.prepares: list[Any] = []
        self.modules: set[str] = set()  # the test modules that registered fits
        self.out_dir: Path | None = None
        self._thread: threading.Thread | None = None
        self._by_name: dict[str, list[dict[str, Any]]] | None = None
        self._error: BaseException | None = None

    def add(self, fits: list[Fit], prepare: Any = None) -> None:
        """Register ``fits`` (names unique across every registering module); ``prepare(out_dir)``
        runs in this process before the spawn (e.g. writes a checkpoint a fit restores)."""
        if self._thread is not None:
            raise RuntimeError("fits added after the shared launch started")
        taken = {fit.name for fit in self.fits}
        clashes = taken & {fit.name for fit in fits}
        if clashes:
            raise ValueError(f"fit names registered twice: {sorted(clashes)}")
        self.fits.extend(fits)
        self.modules.add(sys._getframe(1).f_globals["__name__"])
        if prepare is not None:
            self.prepares.append(prepare)

    def start(self, tmp_path_factory: Any) -> None:
        """Start the spawn in a background thread (once; :meth:`results` waits for it)."""
        if self._thread is not None:
            return
        self.out_dir = tmp_path_factory.mktemp(f"shared_launch{self.world}")
        for prepare in self.prepares:
            prepare(self.out_dir)
        self._thread = threading.Thread(
            target=self._run, name=f"shared_launch{self.world}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            per_rank = run_fits(self.fits, self.world, self.out_dir)
        except BaseException as err:  # re-raised in the test thread by results()
            self._error = err
            return
        self._by_name = {
            fit.name: [rank[i] for rank in per_rank] for i, fit in enumerate(self.fits)
        }

    def results(self, tmp_path_factory: Any) -> dict[str, list[dict[str, Any]]]:
        """``{fit name: [rank 0 result, rank 1 result, ...]}`` of every registered fit (starts
        the spawn if the session did not, and waits for it)."""
        self.start(tmp_path_factory)
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"the shared {self.world}-rank launch failed") from self._error
        assert self._by_name is not None
        return self._by_name


_SHARED: dict[int, SharedLaunch] = {}


def shared_launch(world: int) -> SharedLaunch:
    """The process-wide :class:`SharedLaunch` of ``world`` ranks."""
    return _SHARED.setdefault(world, SharedLaunch(world))


def start_needed_launches(
    test_modules: set[str], tmp_path_factory: Any, worlds: tuple[int, ...]
) -> None:
    """Start, in the background, each shared launch of ``worlds`` that a module of
    ``test_modules`` (the session's selected tests) registered fits to."""
    for world in worlds:
        launch = _SHARED.get(world)
        if launch is not None and launch.modules & test_modules:
            launch.start(tmp_path_factory)
