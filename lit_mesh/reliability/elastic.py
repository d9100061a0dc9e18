"""Process groups that survive `torchrun --max-restarts`: each restart attempt rendezvouses under its own keys.

Why our own: under torchrun, torch's env:// rendezvous hands every attempt the agent's one TCPStore without a
per-attempt prefix (torch/distributed/rendezvous.py, `_torchelastic_use_agent_store`), so a restarted rank can
read the gloo addresses and barrier counts the previous attempt left there and connect to a dead process
(hangs or "failed to connect" in init_process_group). Lightning passes no store, so the fix lives here.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment


def restart_attempt() -> int:
    """Which attempt of the launch this process belongs to: 0 first, then 1, 2, ... (torchrun or SLURM requeue)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or 0)


def attempt_store(address: str, port: int, world_size: int, timeout: timedelta) -> Optional[dist.Store]:
    """The agent's store seen through a prefix of this attempt, or None when torchrun's agent store is not used
    (then torch's default rendezvous makes a fresh store per launch and needs no prefix)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    agent_store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    # TORCHELASTIC_RESTART_COUNT is the same on every worker of one attempt of a torchrun agent
    return dist.PrefixStore(f"lit_mesh/attempt_{restart_attempt()}", agent_store)


def init_process_group_for_attempt(
    environment: ClusterEnvironment, backend: str, timeout: Optional[timedelta], device: torch.device
) -> None:
    """Start the default process group on this attempt's own keys under torchrun; otherwise leave it to
    Lightning (which then finds it initialised, or initialises it the usual way)."""
    if dist.is_initialized():
        return
    timeout = timeout or default_pg_timeout
    store = attempt_store(environment.main_address, environment.main_port, environment.world_size(), timeout)
    if store is None:
        return
    dist.init_process_group(
        backend,
        store=store,
        rank=environment.global_rank(),
        world_size=environment.world_size(),
        timeout=timeout,
        device_id=device if device.type != "cpu" else None,
    )
