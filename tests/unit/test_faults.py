"""lit_mesh.FaultInjector in one process: which step, rank and attempt it fires at, and what each fault does.
(Across ranks: the kill, sigterm and disk_full faults in tests/test_crash_safe_save.py and
tests/test_checkpoint_errors.py, nan_loss in tests/test_bad_config.py.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lit_mesh import FaultInjector


def _at(step: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, global_rank=rank)


class _Module:
    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        return torch.tensor(2.0)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="fault='explode'.*kill, nan_loss, slow, hang, sigterm, disk_full"):
        FaultInjector("explode", step=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attempts='twice'"):
        FaultInjector("kill", step=1, attempts="twice")  # type: ignore[arg-type]


def test_fires_at_its_step_and_rank_in_the_first_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    first, always = FaultInjector("slow", step=3, rank=1), FaultInjector("slow", step=3, rank=1, attempts="always")
    assert first._due(_at(3, 1)) and not first._due(_at(3, 0)) and not first._due(_at(4, 1))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt
    assert not first._due(_at(3, 1)) and always._due(_at(3, 1))


def test_nan_loss_poisons_one_step() -> None:
    module = _Module()
    FaultInjector("nan_loss", step=0).on_train_batch_start(_at(0, 0), module, None, 0)  # type: ignore[arg-type]
    assert torch.isnan(module.training_step(None, 0))
    assert module.training_step(None, 1) == 2.0, "the next step is back to normal"


def test_slow_sleeps_and_hang_never_returns() -> None:
    start = time.perf_counter()
    FaultInjector("slow", step=0, seconds=0.2).on_train_batch_start(_at(0, 0), _Module(), None, 0)  # type: ignore[arg-type]
    assert time.perf_counter() - start >= 0.2
    hang = FaultInjector("hang", step=0)
    thread = threading.Thread(target=hang.on_train_batch_start, args=(_at(0, 0), _Module(), None, 0), daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive()
