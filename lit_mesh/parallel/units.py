"""The blocks of a model without a parallel_plan(): the modules that become FSDP units of their own and that
activation checkpointing and compile_blocks act on.

Where they come from, first match wins:
- the user named them: FSDPStrategy's `auto_wrap_policy` (a set of classes, or a callable / torch wrap policy), or
  `torch.distributed.fsdp.wrap.wrap(module)` called in configure_model (Lightning's FSDP guide; `manual_wrap_context`
  makes those calls mark the module instead of wrapping it in FSDP1);
- found: transformers' `_no_split_modules` classes, else the `nn.ModuleList` / `nn.Sequential` of same-class children
  that holds the most parameters (a transformer's layers).
Nothing found: the model keeps one FSDP unit per top-level submodule, as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from lit_mesh.errors import PlanError


@dataclass(frozen=True)
class Blocks:
    """The blocks chosen for a model without a plan, by name (as `root.named_modules()` names them)."""

    modules: list[tuple[str, nn.Module]]
    source: str  # how they were chosen: "auto_wrap_policy", "wrap() in configure_model", "repeated children", ...

    def describe(self) -> str:
        """E.g. "model.layers.0-11 (Block)": consecutive siblings of one class in a range."""
        if not self.modules:
            return "none"
        parts: list[str] = []
        run: list[str] = []
        cls = ""

        def flush() -> None:
            if not run:
                return
            parent, first = run[0].rpartition(".")[0], run[0].rpartition(".")[2]
            last = run[-1].rpartition(".")[2]
            name = run[0] if len(run) == 1 else f"{parent + '.' if parent else ''}{first}-{last}"
            parts.append(f"{name} ({cls})")

        for name, module in self.modules:
            parent, _, index = name.rpartition(".")
            if run and index.isdigit() and type(module).__name__ == cls:
                prev_parent, _, prev_index = run[-1].rpartition(".")
                if prev_parent == parent and prev_index.isdigit() and int(prev_index) + 1 == int(index):
                    run.append(name)
                    continue
            flush()
            run, cls = [name], type(module).__name__
        flush()
        return ", ".join(parts)


# modules that `wrap(module)` marked inside configure_model (see manual_wrap_context)
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _mark_wrapped(module: nn.Module, **overrides: Any) -> nn.Module:
    if overrides:
        raise PlanError(
            f"wrap({type(module).__name__}, {', '.join(f'{k}=...' for k in overrides)}): per-unit FSDP1 settings are"
            " not carried over; call wrap(module) alone (the unit takes MeshStrategy's settings), or call"
            " torch.distributed.fsdp.fully_shard yourself in configure_model"
        )
    _WRAPPED.add(module)
    return module


@contextmanager
def manual_wrap_context() -> Iterator[None]:
    """`torch.distributed.fsdp.wrap.wrap(module)` inside marks `module` as an FSDP unit (applied with FSDP2 in
    setup), where FSDPStrategy's context would wrap it with FSDP1; outside any such context wrap() does nothing."""
    from torch.distributed.fsdp.wrap import enable_wrap

    with enable_wrap(wrapper_cls=_mark_wrapped):
        yield


def policy_modules(root: nn.Module, policy: Any) -> list[nn.Module]:
    """The submodules of `root` (root excluded) that an FSDPStrategy policy selects: a set (list, tuple) of module
    classes, a torch wrap policy (ModuleWrapPolicy, CustomPolicy), or a callable(module, recurse, nonwrapped_numel)
    such as size_based_auto_wrap_policy, evaluated as FSDP1 evaluates it."""
    from torch.distributed.fsdp.wrap import _Policy, _recursive_wrap

    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise PlanError(
                f"a wrap policy given as a collection holds nn.Module classes; got {sorted(map(repr, classes))}"
            )
        return [m for n, m in root.named_modules() if n and isinstance(m, classes)]
    if isinstance(policy, _Policy):
        chosen = policy._run_policy(root, ignored_modules=set(), root_kwargs={})
        return [m for n, m in root.named_modules() if n and m in chosen]
    if callable(policy):
        selected: list[nn.Module] = []

        def record(module: nn.Module, **_: Any) -> nn.Module:  # FSDP1's wrapper class, recording instead
            selected.append(module)
            return module

        _recursive_wrap(root, policy, record, ignored_modules=set(), ignored_params=set(), only_wrap_children=True)
        return [m for n, m in root.named_modules() if n and m in set(selected)]
    raise PlanError(
        f"a wrap policy is a set of nn.Module classes, a torch.distributed.fsdp.wrap policy or a callable(module,"
        f" recurse, nonwrapped_numel); got {type(policy).__name__}"
    )


def _repeated_children(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the ModuleList / Sequential of >= 2 same-class children that holds the most parameters."""
    best: list[tuple[str, nn.Module]] = []
    best_numel = 0
    for name, container in root.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        numel = sum(p.numel() for p in container.parameters())
        if numel > best_numel and all(any(True for _ in c.parameters()) for _, c in children):
            best, best_numel = [(f"{name}.{n}" if name else n, c) for n, c in children], numel
    return best


def _no_split_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' declaration of its blocks: modules of the classes a PreTrainedModel lists in _no_split_modules."""
    names: set[str] = set()
    for module in root.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    if not names:
        return []
    return [(n, m) for n, m in root.named_modules() if n and type(m).__name__ in names]


def choose_blocks(root: nn.Module, auto_wrap_policy: Any = None) -> Blocks:
    """The blocks of `root`, a model without a plan (see the module's doc); empty where nothing was found."""
    named = {m: n for n, m in root.named_modules()}
    if auto_wrap_policy is not None:
        return Blocks([(named[m], m) for m in policy_modules(root, auto_wrap_policy)], "auto_wrap_policy")
    wrapped = [(n, m) for n, m in root.named_modules() if n and m in _WRAPPED]
    if wrapped:
        return Blocks(wrapped, "wrap() in configure_model")
    declared = _no_split_modules(root)
    if declared:
        return Blocks(declared, "transformers' _no_split_modules")
    return Blocks(_repeated_children(root), "repeated children")


def innermost_first(blocks: Blocks) -> list[nn.Module]:
    """The blocks in the order fully_shard must see them: nested ones before those holding them."""
    order = sorted(enumerate(blocks.modules), key=lambda item: (-item[1][0].count("."), item[0]))
    return [module for _, (_, module) in order]


def parameters_outside(module: nn.Module, blocks: list[nn.Module]) -> bool:
    """Whether `module` holds parameters that no block holds (else it is no FSDP unit of its own)."""
    inside = {id(p) for block in blocks for p in block.parameters()}
    return any(id(p) not in inside for p in module.parameters())


def units_report(blocks: Blocks, others: list[str], model_name: str) -> str:
    """The layout print's line about the FSDP units of a model without a plan."""
    rest = f" + {len(others)} more ({', '.join(others)})" if others else ""
    if not blocks.modules and blocks.source == "auto_wrap_policy":
        return f"MeshStrategy: auto_wrap_policy selects no module of {model_name}; FSDP units: {', '.join(others)}"
    if not blocks.modules:
        return (
            f"MeshStrategy: no repeated blocks found in {model_name} (no nn.ModuleList/nn.Sequential of same-class"
            f" children, no auto_wrap_policy); FSDP units: {', '.join(others) or 'none'}"
        )
    return f"MeshStrategy: FSDP units ({blocks.source}): {blocks.describe()}{rest}"
