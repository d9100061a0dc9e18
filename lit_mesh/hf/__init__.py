"""Hugging Face transformers models under MeshStrategy: plans by class (registered or derived from
transformers' own TP plan), explicit naming, and transformers' initialisation on any mesh.

A LightningModule that holds a transformers model needs nothing else: MeshStrategy finds the model and its
plan. `register_plan` / `use_plan` name one where the default does not fit.
"""

from lit_mesh.hf.registry import declared_plan, plan_for, register_plan, use_plan

__all__ = ["declared_plan", "plan_for", "register_plan", "use_plan"]
