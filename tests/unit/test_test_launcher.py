"""The test launcher's switch (tests/launch.py): a value it does not know is named, not silently replaced."""

from __future__ import annotations

import pytest

from tests.launch import launch


def test_an_unknown_launcher_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIT_MESH_TEST_LAUNCHER", "torchrunn")
    with pytest.raises(ValueError, match=r"LIT_MESH_TEST_LAUNCHER='torchrunn': choose one of fork, torchrun"):
        launch(2, "launch_probe.py", "unused", "probe")
