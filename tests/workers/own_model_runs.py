"""A user's own transformer (defined here, not in the zoo, no parallel_plan()) under MeshStrategy, against the same
model trained in a plain loop on one device (issue #38).

Usage: python tests/fork_launch.py NPROC tests/workers/own_model_runs.py OUT_DIR RUN [RUN...]
Each rank writes OUT_DIR/rank{r}.json: {run: {"ok": bool, "error": str, "value": ...}}; the test judges.
Every run trains 10 steps (fp32, AdamW) on the same global batches of 8 sequences; the per-step global losses and the
final full parameters must match the single-device loop (relative 1e-4).
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric.strategies.model_parallel import _load_raw_module_state
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit_mesh import MeshStrategy

OUT = Path(sys.argv[1])
WORLD, RANK = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # set by the launcher
RUNS = sys.argv[2:]
STEPS, EPOCH_STEPS, GLOBAL_BATCH, SEQ, VOCAB, DIM, N_BLOCKS = 10, 5, 8, 8, 32, 32, 4
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


# ---- the user's model: nothing of lit-mesh in it -----------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias has no gradient: AdamW would amplify noise
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(attention)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def new_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer()


class Tokens(Dataset):
    """EPOCH_STEPS global batches: a resume at an epoch's end continues where the single-device loop does."""

    def __len__(self) -> int:
        return EPOCH_STEPS * GLOBAL_BATCH

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(index))


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out  # a transformers model returns an output object
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def optimizer_of(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=1e-2)


# ---- one device: the plain loop -------------------------------------------------------------------------------
def reference(factory: Callable[[], nn.Module] = new_model) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, data = factory(), Tokens()
    optimizer = optimizer_of(model.parameters())
    losses = []
    for step in range(STEPS):
        batch = torch.stack([data[(step % EPOCH_STEPS) * GLOBAL_BATCH + i] for i in range(GLOBAL_BATCH)])
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the LightningModule ----------------------------------------------------------------------------------------
class OwnModule(LightningModule):
    def __init__(self, wrap_in_configure_model: bool = False, factory: Callable[[], nn.Module] = new_model) -> None:
        super().__init__()
        self.model = factory()
        self.wrap_in_configure_model = wrap_in_configure_model
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.wrap_in_configure_model:  # Lightning's FSDP guide: manual wrapping
            from torch.distributed.fsdp.wrap import wrap

            for i, layer in enumerate(self.model.layers):
                self.model.layers[i] = wrap(layer)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # this rank's slice of the step's global batch, chosen by the step: Lightning replays an epoch's batches on a
        # resume at the epoch's end, which a plain loop does not (the batch from the loader has the same shape)
        first = (self.global_step % EPOCH_STEPS) * GLOBAL_BATCH
        batch = torch.stack([Tokens()[first + i] for i in range(RANK, GLOBAL_BATCH, WORLD)])
        loss = loss_of(self.model, batch)
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach())))  # the mean over the global batch
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_of(self.parameters())

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(Tokens(), num_replicas=WORLD, rank=RANK, shuffle=False)
        return DataLoader(Tokens(), batch_size=GLOBAL_BATCH // WORLD, sampler=sampler)


class GrownModule(OwnModule):
    """OwnModule's model with one tensor more, loaded without strict loading (Lightning's LightningModule flag)."""

    strict_loading = False

    def __init__(self) -> None:
        super().__init__()
        self.model.extra = nn.Parameter(torch.ones(3))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        pass

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def fit(strategy: Any, steps: int = STEPS, module: OwnModule | None = None, ckpt: str | None = None) -> OwnModule:
    module = module or OwnModule()
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        use_distributed_sampler=False,
        **QUIET,
    )
    trainer.fit(module, ckpt_path=ckpt)
    module.trainer_ref = trainer  # type: ignore[attr-defined]
    return module


def full_parameters(module: OwnModule) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))  # on every rank
    return {k.removeprefix("model."): v.cpu() for k, v in state.items()}


def assert_close(a: float, b: float, what: str) -> None:
    assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), f"{what}: {a} != {b}"


def assert_parity(module: OwnModule, first_step: int = 0, reference: Any = None) -> None:
    expected, final = reference or REFERENCE
    assert len(module.losses) == STEPS - first_step, module.losses
    for step, loss in enumerate(module.losses, start=first_step):
        assert_close(loss, expected[step], f"loss at step {step}")
    got = full_parameters(module)
    for name, tensor in final.items():  # relative to the tensor's norm (a near-zero element may differ more)
        error = float((got[name] - tensor).norm() / tensor.norm().clamp_min(1e-12))
        assert error <= 1e-4, f"{name}: relative difference {error:.2e} from the single-device parameters"


def units(module: OwnModule) -> list[str]:
    return sorted(name for name, m in module.named_modules() if isinstance(m, FSDPModule))


PER_BLOCK = [f"model.layers.{i}" for i in range(N_BLOCKS)]


# ---- the runs ----------------------------------------------------------------------------------------------------
def run_found_blocks() -> Any:
    module = fit(MeshStrategy(dp=WORLD))
    assert units(module) == sorted(["model", *PER_BLOCK]), units(module)  # the repeated blocks, found
    assert_parity(module)
    return units(module)


def run_auto_wrap_policy() -> Any:
    module = fit(MeshStrategy(auto_wrap_policy={Block, nn.Embedding}, activation_checkpointing_policy={Block}))
    assert units(module) == sorted(["model", "model.embedding", *PER_BLOCK]), units(module)
    assert_parity(module)
    return units(module)


def run_found_blocks_checkpointed() -> Any:
    # activation checkpointing on every 2nd found block, selective
    module = fit(MeshStrategy(dp=WORLD, activation_checkpointing="selective", ac_every_n_blocks=2))
    assert_parity(module)
    return units(module)


def run_hsdp() -> Any:
    module = fit(MeshStrategy(dp_replicate=2, dp_shard=2))
    assert units(module) == sorted(["model", *PER_BLOCK]), units(module)
    assert_parity(module)
    return units(module)


def run_hsdp_device_mesh_auto_wrap() -> Any:
    # FSDPStrategy's words: HSDP as a (replicas, shards) tuple, the units by policy, full activation checkpointing
    module = fit(MeshStrategy(device_mesh=(2, 2), auto_wrap_policy={Block}, activation_checkpointing_policy={Block}))
    assert module.trainer_ref.strategy.layout.dp_replicate == 2  # type: ignore[attr-defined]
    assert_parity(module)
    return units(module)


def run_sharding_strategies() -> Any:
    seen = {}
    for name, zero_stage, data_parallel in (("SHARD_GRAD_OP", 2, "fsdp"), ("NO_SHARD", 3, "ddp")):
        module = fit(MeshStrategy(sharding_strategy=name))
        strategy = module.trainer_ref.strategy  # type: ignore[attr-defined]
        assert strategy.options.data.zero_stage == zero_stage and strategy.layout.data_parallel == data_parallel
        assert_parity(module)
        seen[name] = strategy.layout.describe()
    return seen


def run_manual_wrap() -> Any:
    module = fit(MeshStrategy(), module=OwnModule(wrap_in_configure_model=True))
    assert units(module) == sorted(["model", *PER_BLOCK]), units(module)
    assert_parity(module)
    return units(module)


def tiny_llama() -> nn.Module:
    """A transformers model built from a config, as a user holds it (nothing of lit-mesh in it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=2 * DIM,
        num_hidden_layers=N_BLOCKS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def run_transformers_model() -> Any:
    """A user's LightningModule holding a LlamaForCausalLM built from a config (not zoo.HFCausalLM): lit_mesh.hf
    derives its plan from the class (blocks: the decoder layers), so each decoder layer is an FSDP unit, and dp=2
    trains to the single-device losses and weights."""
    module = fit(MeshStrategy(dp=WORLD), module=OwnModule(factory=tiny_llama))
    layers = [f"model.model.layers.{i}" for i in range(N_BLOCKS)]
    assert units(module) == sorted(["model", *layers]), units(module)
    assert_parity(module, reference=reference(tiny_llama))
    return units(module)


def run_cpu_offload() -> Any:
    # FSDP2's CPUOffloadPolicy on every unit: sharded parameters, gradients and optimizer state on the host
    from torch.distributed.fsdp import CPUOffloadPolicy

    module = fit(MeshStrategy(cpu_offload=True, limit_all_gathers=True, use_orig_params=True))
    for name in PER_BLOCK + ["model"]:
        state = module.get_submodule(name)._get_fsdp_state()  # type: ignore[operator]
        group = state._fsdp_param_group
        assert group is not None and isinstance(group.offload_policy, CPUOffloadPolicy), name
        assert group.offload_policy.pin_memory is False, name  # pinned host memory only beside an accelerator
    assert all(p.to_local().device.type == "cpu" for p in module.parameters())
    gradients = [p.grad for p in module.parameters() if p.grad is not None]  # the last step's, left by Lightning
    assert gradients and all(g.to_local().device.type == "cpu" for g in gradients), len(gradients)
    optimizer = module.trainer_ref.strategy.optimizers[0]  # type: ignore[attr-defined]
    assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    assert_parity(module)
    return "offloaded"


def _fsdp_strategy_sharded_save(strategy: MeshStrategy, checkpoint: dict, path: Path) -> None:
    """Lightning's FSDPStrategy.save_checkpoint (its own code) with state_dict_type="sharded": FSDP1 refuses CPU, so
    the state comes from FSDP2 (DTensor shards where FSDP1 has ShardedTensors: both are chunks in DCP's files)."""
    strategy._state_dict_type = "sharded"  # type: ignore[attr-defined]  # the attribute FSDPStrategy's code reads
    FSDPStrategy.save_checkpoint(strategy, checkpoint, path)  # type: ignore[arg-type]


def run_checkpoints_cross() -> Any:
    half = EPOCH_STEPS  # one epoch, then resume
    # FSDPStrategy's sharded layout ("model" key, optimizer_0, meta.pt) -> MeshStrategy resumes it
    first = fit(MeshStrategy(), steps=half)
    trainer = first.trainer_ref  # type: ignore[attr-defined]
    sharded = Path(trainer.strategy.broadcast(str(OUT / "fsdp_sharded.ckpt")))
    _fsdp_strategy_sharded_save(trainer.strategy, trainer._checkpoint_connector.dump_checkpoint(), sharded)
    trainer.strategy.barrier()  # FSDPStrategy writes meta.pt on rank 0 alone, after the shards, with no barrier
    assert (sharded / "meta.pt").is_file()
    resumed = fit(MeshStrategy(), ckpt=str(sharded))
    assert_parity(resumed, first_step=half)
    # a model grown by one tensor, with Lightning's strict_loading=False: validate loads what the checkpoint holds
    # on every rank (sharded as this layout shards it), the grown tensor keeps its value
    grown = GrownModule()
    Trainer(accelerator="cpu", devices=WORLD, strategy=MeshStrategy(), **QUIET).validate(grown, ckpt_path=str(sharded))
    loaded, saved = full_parameters(grown), full_parameters(first)
    assert torch.equal(loaded.pop("extra"), torch.ones(3)) and loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), f"{name} not loaded under strict_loading=False"
    # full: one file with full tensors (FSDPStrategy writes it through Strategy.save_checkpoint, as here)
    first = fit(MeshStrategy(state_dict_type="full"), steps=half)
    full = Path(first.trainer_ref.strategy.broadcast(str(OUT / "full.ckpt")))  # type: ignore[attr-defined]
    first.trainer_ref.save_checkpoint(full)  # type: ignore[attr-defined]
    resumed = fit(MeshStrategy(sharding_strategy="NO_SHARD"), ckpt=str(full))  # into another layout
    assert_parity(resumed, first_step=half)
    # MeshStrategy's full file -> FSDPStrategy's loading code for full files (load_checkpoint, state_dict_type
    # "full"), on a world of one: FSDP1 refuses CPU ranks
    if RANK == 0:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        checkpoint = torch.load(full, weights_only=False)
        module = OwnModule()
        optimizer = optimizer_of(module.parameters())
        _load_raw_module_state(checkpoint.pop("state_dict"), module=module, world_size=1, strict=True)
        state = checkpoint["optimizer_states"][0]
        if isinstance(next(iter(state["state"])), int):  # as FSDPStrategy does for a plain optimizer's state
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, module)
        # FSDPStrategy then calls FSDP.optim_state_dict_to_load, which needs FSDP1 modules (an accelerator): the
        # state it receives is keyed by the model's parameter names, which that call maps to the flat parameters
        assert set(state["state"]) == {name for name, _ in module.named_parameters()}, sorted(state["state"])[:3]
        optimizer.load_state_dict(FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, module))
        data, expected = Tokens(), REFERENCE[0]
        for step in range(half, STEPS):
            batch = torch.stack([data[(step % EPOCH_STEPS) * GLOBAL_BATCH + i] for i in range(GLOBAL_BATCH)])
            loss = loss_of(module.model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert_close(loss.item(), expected[step], f"FSDPStrategy's loader, loss at step {step}")
    return "crossed"


CHECKS: dict[str, Callable[[], Any]] = {
    name.removeprefix("run_"): fn for name, fn in globals().items() if name.startswith("run_") and callable(fn)
}
REFERENCE = reference()

if __name__ == "__main__":
    results: dict[str, dict] = {}
    OUT.mkdir(parents=True, exist_ok=True)
    for run in RUNS:
        try:
            results[run] = {"ok": True, "value": CHECKS[run]()}
        except Exception:  # noqa: BLE001 - reported to the test; the launcher then stops the other ranks
            results[run] = {"ok": False, "error": traceback.format_exc()}
        (OUT / f"rank{RANK}.json").write_text(json.dumps(results))
        if not results[run]["ok"]:  # the ranks would part ways in their collectives: stop now, not hang
            sys.exit(1)
