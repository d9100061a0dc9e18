"""HostSyncCounter (the StepAudit's host-sync count) sees every kind of host sync, once, and no op that reads no
device value. The audited training steps: tests/integration/test_host_sync.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lit_mesh.monitor.host_syncs import HostSyncCounter

x = torch.arange(6.0)
mask = x > 2

SYNCS: dict[str, Callable[[], object]] = {
    "item": lambda: x.sum().item(),
    "tolist": lambda: x.tolist(),
    "bool": lambda: bool(x.sum()),
    "cpu": lambda: x.cpu(),
    "nonzero": lambda: x.nonzero(),
    "where one argument": lambda: torch.where(mask),
    "boolean-mask indexing": lambda: x[mask],
    "boolean-mask assignment of a tensor": lambda: x.clone().__setitem__(mask, torch.ones(3)),
    "masked_select": lambda: x.masked_select(mask),
    "unique": lambda: torch.unique(x),
    "unique_consecutive": lambda: torch.unique_consecutive(x),
    "repeat_interleave without output_size": lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long)),
    "equal": lambda: torch.equal(x, x),
    "tensor of a list, to a device": lambda: torch.tensor([1, 2], device="cpu"),
    "tensor of a scalar, to a device": lambda: torch.tensor(1.0, device=x.device),
    "tensor of a list, then moved": lambda: torch.tensor([1, 2]).to(x.device),
    "host tensor moved to another device type": lambda: x.to("meta"),
    "host tensor copied into another device type": lambda: torch.empty(6, device="meta").copy_(x),
}

NO_SYNCS: dict[str, Callable[[], object]] = {
    "arithmetic": lambda: (x * 2).sum(),
    "integer indexing": lambda: x[x.long()[:2]],
    "repeat_interleave with output_size": lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long), output_size=6),
    "where three arguments": lambda: torch.where(mask, x, 0.0),
    "a factory with a device": lambda: torch.zeros(3, device=x.device),
    "a dtype change": lambda: x.to(torch.float64),
    "a device tensor to its device": lambda: x.to(x.device),
    "boolean-mask assignment of a scalar (masked_fill)": lambda: x.clone().__setitem__(mask, 0.0),
    "repeat_interleave with an int": lambda: x.repeat_interleave(2),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_host_sync_counts_once(name: str) -> None:
    with HostSyncCounter() as syncs:
        SYNCS[name]()
    assert syncs.total == 1, syncs.sites
    (site,) = syncs.sites
    assert site.startswith(f"{__file__.split('site-packages/')[-1]}:")  # the line of this file that made it


@pytest.mark.parametrize("name", list(NO_SYNCS))
def test_ops_that_read_no_device_value_count_nothing(name: str) -> None:
    with HostSyncCounter() as syncs:
        NO_SYNCS[name]()
    assert syncs.total == 0, syncs.sites


def _declared_read(t: torch.Tensor) -> list:
    return t.tolist()


def test_a_declared_read_counts_apart_and_counting_stops_on_exit() -> None:
    with HostSyncCounter({_declared_read: "split sizes"}, ignore=frozenset({id(x)})) as syncs:
        _declared_read(mask)
        x.tolist()  # an ignored tensor
    assert syncs.total == 0 and syncs.declared_counts == {"split sizes": 1}, syncs.sites
    x.tolist()
    torch.nonzero(x)
    assert syncs.total == 0 and torch.Tensor.tolist.__qualname__ != "HostSyncCounter._counting.<locals>.counted"


def test_the_optimizers_host_step_counters_count_nothing() -> None:
    """AdamW keeps its step counters on the host (torch.tensor(1.0, device="cpu") increments them): no sync on a GPU."""
    weight = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([weight], foreach=True)
    weight.grad = torch.ones(4, 3)
    optimizer.step()  # makes the state
    counters = frozenset(id(state["step"]) for state in optimizer.state.values())
    with HostSyncCounter(ignore=counters) as syncs:
        optimizer.step()
    assert syncs.total == 0, syncs.sites
