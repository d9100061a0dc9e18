"""The test launcher's switch (tests/launch.py): a value it does not know is named, not silently replaced."""

from __future__ import annotations

import pytest

from tests.launch import REPO, launch


def test_an_unknown_launcher_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIT_MESH_TEST_LAUNCHER", "torchrunn")
    with pytest.raises(ValueError, match=r"LIT_MESH_TEST_LAUNCHER='torchrunn': choose one of fork, torchrun"):
        launch(2, "launch_probe.py", "unused", "probe")


def test_the_slowest_modules_listed_for_scheduling_exist() -> None:
    from tests.conftest import SLOWEST_MODULES

    missing = [path for path in SLOWEST_MODULES if not (REPO / path).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_MODULES names modules that are gone: {missing}"
