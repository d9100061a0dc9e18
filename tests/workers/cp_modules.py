"""LightningModules for context-parallel error tests."""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard

from zoo import GPTModule


class SelfShardedGPT(GPTModule):
    """Parallelises itself in configure_model (FSDP over the cp ranks), so MeshStrategy applies no plan."""

    def configure_model(self) -> None:
        super().configure_model()
        fully_shard(self.model, mesh=self.device_mesh["cp"])
