"""Hugging Face transformers models under MeshStrategy: plans by class (registered or derived from
transformers' own TP plan), explicit naming, and transformers' initialisation on any mesh.

A LightningModule that holds a transformers model needs nothing else: on import this package registers its
plans as a plan source (lit_mesh.plan) and transformers' initialisation as an initialiser (lit_mesh.init),
and `import lit_mesh` imports it. `register_plan` / `use_plan` name one where the default does not fit.
"""

from lit_mesh.hf.init import initialise_weights
from lit_mesh.hf.registry import declared_plan, plan_for, register_plan, use_plan
from lit_mesh.init import register_initialiser
from lit_mesh.plan import register_plan_source

register_plan_source(declared_plan)
register_initialiser(initialise_weights)

__all__ = ["declared_plan", "plan_for", "register_plan", "use_plan"]
