"""PipeDream-2BW on pp = world size ranks (tests/integration/test_pipeline_2bw.py): the zoo GPT trains STEPS steps
with MeshStrategy(pp=world, pp_schedule="2bw"), saving a checkpoint at RESUME_STEP, then a second fit resumes from it;
every rank records its losses, batches and weight storage per step. Rank 0 then replays on one process, from the same
initial weights and batches: with the delayed rule (W_{t+1} = W_t - update(grad f(W_{t-1}; batch t-1)), no update at
step 0), synchronously (1F1B's curve), and with the delay restarted at the resume step; it writes them next to what
the pipeline did to OUT/result.json.

Usage: torchrun --nproc_per_node=P pipeline_2bw.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lit_mesh import MeshStrategy
from tests.workers import exit_skipping_teardown
from zoo.modules import GPTModule

STEPS, BATCH, SEQ, MICROBATCHES, RESUME_STEP = 10, 8, 16, 4, 5
CONFIG = {"n_layers": 4, "dim": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64}


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    windows = torch.randint(0, 256, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class Record(L.Callback):
    """The initial weights (every stage's, merged on rank 0 later), and per step: the loss training_step returned
    and (distinct weight-storage bytes, one copy's bytes) of this rank's stage, and the batch."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []
        self.storage: list[tuple[int, int]] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []  # as the loader gave them

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.batches.append(tuple(t.clone() for t in args[0]))
        self.storage.append(trainer.strategy._pipeline.weight_storage_bytes())


class P2PRecord:
    """While open: the pipeline's point-to-point as it reaches torch. Every batch_isend_irecv (its ops' peers and
    kinds), every send or receive issued outside one (unbatched), and the host reads (Tensor.tolist) of the
    pipeline's P2P code (lit_mesh/parallel/pipeline/p2p.py)."""

    P2P = ("isend", "irecv", "send", "recv")

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, int]]] = []
        self.unbatched: list[str] = []
        self.host_reads = 0
        self._in_batch = False

    def __enter__(self) -> P2PRecord:
        self._saved = {name: getattr(dist, name) for name in (*self.P2P, "batch_isend_irecv")}
        self._tolist = torch.Tensor.tolist
        record = self

        def unbatched(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                if not record._in_batch:
                    record.unbatched.append(name)
                return record._saved[name](*args, **kwargs)

            return call

        def batch(ops: list) -> Any:
            record.batches.append([(op.op.__name__, op.group_peer) for op in ops])
            record._in_batch = True
            try:
                return record._saved["batch_isend_irecv"](ops)
            finally:
                record._in_batch = False

        def tolist(tensor: torch.Tensor) -> Any:
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            record.host_reads += caller.endswith("lit_mesh/parallel/pipeline/p2p.py")
            return record._tolist(tensor)

        for name in self.P2P:  # in c10d too: P2POp accepts only the functions c10d holds
            setattr(dist, name, unbatched(name))
            setattr(c10d, name, getattr(dist, name))
        dist.batch_isend_irecv = batch
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, function in self._saved.items():
            setattr(dist, name, function)
            if name in self.P2P:
                setattr(c10d, name, function)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]

    def summary(self) -> dict:
        return {
            "batches": len(self.batches),
            "unbatched": self.unbatched,
            "host_reads": self.host_reads,
            # a batch that receives talks to that one peer (a send to another goes in a batch of its own)
            "mixed_peer_receives": [
                b for b in self.batches if any(k == "irecv" for k, _ in b) and len({p for _, p in b}) > 1
            ],
        }


def merged(local: dict) -> dict:
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def replay(
    initial: dict[str, torch.Tensor], batches: list, delayed: bool, restart_at: int = -1
) -> tuple[list[float], dict]:
    """One process, the whole model, the same micro-batches in the same order, the module's own optimizer.
    restart_at: the step a resumed run starts from (the gradient in flight there is dropped, as 2bw documents)."""
    module = GPTModule(preset="tiny", config_overrides=CONFIG)
    module.configure_model()
    module.model.load_state_dict(initial, strict=True)
    optimizer = module.configure_optimizers()
    params = list(module.model.parameters())
    losses, pending = [], [None] * len(params)
    for step, (tokens, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        micro_losses = []
        for x, y in zip(tokens.tensor_split(MICROBATCHES), targets.tensor_split(MICROBATCHES)):
            loss = module.loss_fn(module.model(x), y)
            micro_losses.append(loss.detach().float())
            (loss * (1.0 / MICROBATCHES)).backward()
        losses.append(float(torch.stack(micro_losses).mean()))
        if delayed:  # this batch's gradient waits a step; the previous one's is applied (none at step 0)
            fresh = [p.grad for p in params]
            for p, grad in zip(params, pending if step != restart_at else [None] * len(params)):
                p.grad = grad
            pending = fresh
        optimizer.step()
    return losses, {n: p.detach().clone() for n, p in module.model.named_parameters()}


def fit(record: Record, world: int, checkpoints: Path, resume: bool) -> GPTModule:
    module = GPTModule(preset="tiny", config_overrides=CONFIG)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*samples()), batch_size=BATCH)
    saves = L.pytorch.callbacks.ModelCheckpoint(checkpoints, "{step}", every_n_train_steps=RESUME_STEP, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        precision="32-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_checkpointing=not resume,
        callbacks=[record, saves] if not resume else [record],
        strategy=MeshStrategy(pp=world, pp_schedule="2bw", pp_microbatches=MICROBATCHES),
    )
    trainer.fit(module, data, ckpt_path=checkpoints / f"step={RESUME_STEP}.ckpt" if resume else None)
    return module


def main(out: Path) -> None:
    torch.manual_seed(0)
    world = int(os.environ["WORLD_SIZE"])
    record, resumed = Record(), Record()
    with P2PRecord() as p2p:
        module = fit(record, world, out / "ckpt", resume=False)
    p2p_per_rank = merged({dist.get_rank(): p2p.summary()})
    runner = module.trainer.strategy._pipeline
    storage = merged({dist.get_rank(): {"per_step": record.storage, "after_fit": runner.weight_storage_bytes()}})
    final = merged({n: p.detach().clone() for n, p in module.model.named_parameters()})
    initial = merged(record.initial)
    fit(resumed, world, out / "ckpt", resume=True)
    if dist.get_rank() == 0:
        write_result(out, world, record, resumed, initial, final, storage, p2p_per_rank)


def write_result(
    out: Path, world: int, record: Record, resumed: Record, initial: dict, final: dict, storage: dict, p2p: dict
) -> None:
    delayed_losses, delayed_params = replay(initial, record.batches, delayed=True)
    sync_losses, _ = replay(initial, record.batches, delayed=False)
    restarted, _ = replay(initial, record.batches[:RESUME_STEP] + resumed.batches, delayed=True, restart_at=RESUME_STEP)
    result = {
        "world": world,
        "losses": record.losses,
        "delayed_losses": delayed_losses,
        "sync_losses": sync_losses,
        "param_max_abs_diff": max((final[n] - p).abs().max().item() for n, p in delayed_params.items()),
        "param_max_abs": max(p.abs().max().item() for p in delayed_params.values()),
        "param_names_match": sorted(final) == sorted(delayed_params),
        "storage": storage,
        "resumed_losses": resumed.losses,
        "restarted_losses": restarted[RESUME_STEP:],
        "p2p": p2p,
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_skipping_teardown()
