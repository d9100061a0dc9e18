"""Float8 training of the blocks' linears through torchao (`float8="tensorwise" | "rowwise"`).

An option of MeshStrategy rather than a Lightning precision plugin: the conversion has to happen inside the
order of lit_mesh/parallel/apply.py (after the pipeline split, before TP picks torchao's float8 styles for the
converted linears and before FSDP2 shards their weights for the float8 all-gather), which only the strategy
controls; a precision plugin's `convert_module` runs before any of that and knows nothing of the mesh.

What converts: every nn.Linear inside the model's blocks whose in and out features are multiples of 16 (the
float8 matmul's requirement); the others are listed with the reason and stay in high precision, as do the
embedding and the output head (outside the blocks: the head's logits feed the loss directly, where float8's
rounding costs the most accuracy). Where the device has no float8 matmul (CPU), torchao's emulation runs it in
high precision on float8-rounded values: the numerics of float8 training without its speed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lit_mesh.errors import MeshConfigError
from lit_mesh.extras import EXTRAS, MissingExtraError, require
from lit_mesh.unit import Facts, Rule, option

Float8Recipe = Literal["tensorwise", "rowwise"]
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
FLOAT8_MULTIPLE = 16  # the float8 matmul (torch._scaled_mm) needs both dims of each operand divisible by 16


@dataclass(frozen=True)
class Float8Options:
    recipe: Optional[Float8Recipe] = option(
        None,
        doc='float8 linears in the blocks through torchao (pip install "lit-mesh[fp8]"): "tensorwise" (one scale per'
        ' tensor; FSDP2 all-gathers the weights in float8, TP uses torchao\'s float8 styles) or "rowwise" (one scale'
        " per row; more accurate, all-gathers in high precision). Linears whose dims are not multiples of 16, the"
        " embedding and the output head stay in high precision. Emulated where the device has no float8 matmul"
        " (CPU). 1-D TP only (not the grid tp_modes).",
        arg="float8",
    )

    def __post_init__(self) -> None:
        if self.recipe is not None and self.recipe not in FLOAT8_RECIPES:
            raise MeshConfigError(
                f"float8={self.recipe!r} is not a float8 recipe; choose one of {list(FLOAT8_RECIPES)}"
            )


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _missing_torchao_message(f: Facts) -> str:
    # the wording of lit_mesh.extras.require, so that every missing extra reads alike
    return (
        f"torchao is needed for {EXTRAS['torchao'][1]} but is not installed; install it with: pip install"
        f" 'lit-mesh[fp8]' (from a clone: pip install -e '.[fp8]'), or set float8=None (float8={f.options.float8.recipe!r}"
        " was given)"
    )


def _device_has_float8_matmul(device_type: Optional[str]) -> bool:
    return device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


RULES: list[Rule] = [
    Rule(
        # in the user's process, before any rank starts
        "float8_needs_torchao",
        "init",
        lambda f: f.options.float8.recipe is not None and not torchao_installed(),
        _missing_torchao_message,
        MissingExtraError,
    ),
    Rule(
        # the grid schemes (SUMMA, 3-D) run their own block matmuls, which torchao's Float8Linear does not replace
        "float8_needs_1d_tp",
        "init",
        lambda f: f.options.float8.recipe is not None and f.options.tensor.mode != "1d",
        lambda f: (
            f"float8={f.options.float8.recipe!r} with tp_mode={f.options.tensor.mode!r}: torchao's float8 linears have"
            " tensor-parallel styles for the 1-D column/row split only, while the grid tp_modes compute the block"
            " matmuls themselves; use tp_mode='1d', or float8=None"
        ),
    ),
    Rule(
        "float8_on_a_model_lit_mesh_parallelises",
        "setup",
        lambda f: f.options.float8.recipe is not None and f.self_parallelised,
        lambda f: (
            f"float8={f.options.float8.recipe!r} but configure_model parallelised {f.model_name} itself, so MeshStrategy"
            " applies no plan and cannot convert its linears before they are sharded; call"
            " torchao.float8.convert_to_float8_training in configure_model before your own parallelism, or leave the"
            " parallelism to MeshStrategy"
        ),
    ),
    Rule(
        # a GPU without float8 matmuls (before Ada/Hopper) would fail inside torch._scaled_mm at the first step
        "float8_needs_sm89_on_cuda",
        "launch",
        lambda f: (
            f.options.float8.recipe is not None and f.device_type == "cuda" and not _device_has_float8_matmul("cuda")
        ),
        lambda f: (
            f"float8={f.options.float8.recipe!r} on a GPU of compute capability"
            f" {torch.cuda.get_device_capability() if torch.cuda.is_available() else 'unknown'}: float8 matmuls need"
            " 8.9 or newer (Ada, Hopper, Blackwell); set float8=None on this GPU"
        ),
    ),
]


@dataclass(frozen=True)
class Float8Conversion:
    """What `convert_blocks` did: the linears converted and those kept in high precision, each with the reason."""

    recipe: str
    emulated: bool
    converted: list[str]
    kept: list[tuple[str, str]]
    fsdp_float8_all_gather: bool

    def report(self) -> str:
        """Lines of the layout print: the converted linears (grouped over blocks) and those kept, with why."""
        how = "emulated: no float8 matmul on this device" if self.emulated else "float8 matmuls"
        gather = "float8" if self.fsdp_float8_all_gather else "high precision"
        lines = [
            f"MeshStrategy: float8 {self.recipe!r} ({how}; FSDP2 all-gathers its weights in {gather}):"
            f" {len(self.converted)} linears converted",
            *(f"  float8: {name}" for name in _grouped(self.converted)),
            *(f"  kept in high precision: {name} ({why})" for name, why in self.kept),
        ]
        return "\n".join(lines)


def _grouped(names: Sequence[str]) -> list[str]:
    """'layers.0.attention.wq', 'layers.1.attention.wq' -> 'layers.{0,1}.attention.wq' (one line per role)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if index is None:
            groups.setdefault(name, [])
            continue
        key = ".".join([*parts[:index], "{}", *parts[index + 1 :]])
        groups.setdefault(key, []).append(parts[index])
    return [key.replace("{}", "{" + ",".join(ids) + "}") if ids else key for key, ids in groups.items()]


def float8_config(recipe: str, emulate: bool, fsdp_float8_all_gather: bool) -> Any:
    """torchao's Float8LinearConfig for `recipe`, emulated or not, with FSDP2's float8 all-gather where it applies
    (tensorwise scaling only: a rowwise scale is not known until the whole weight is gathered)."""
    float8 = require("torchao.float8")
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather and recipe == "tensorwise"
    )


def _why_kept(linear: nn.Linear) -> Optional[str]:
    odd = [
        f"{what}={size}"
        for what, size in (("in_features", linear.in_features), ("out_features", linear.out_features))
        if size % FLOAT8_MULTIPLE
    ]
    return f"{' and '.join(odd)} not a multiple of {FLOAT8_MULTIPLE}" if odd else None


def convert_blocks(
    root: nn.Module, block_lists: Sequence[Sequence[nn.Module]], recipe: str, device_type: str, fsdp_sharded: bool
) -> Float8Conversion:
    """Swap the eligible nn.Linear of every block for torchao's Float8Linear (in place); everything else of `root`
    (the embedding, the output head) stays as it is. Runs before TP and FSDP: both pick their float8 behaviour
    from the converted modules."""
    float8 = require("torchao.float8")
    emulate = not _device_has_float8_matmul(device_type)
    config = float8_config(recipe, emulate, fsdp_sharded)
    names = {id(module): name for name, module in root.named_modules()}
    converted: list[str] = []
    kept: list[tuple[str, str]] = []
    for blocks in block_lists:
        for block in blocks:
            prefix = names[id(block)]

            def eligible(module: nn.Module, name: str, prefix: str = prefix) -> bool:
                if not isinstance(module, nn.Linear):
                    return False
                why = _why_kept(module)
                full = f"{prefix}.{name}" if name else prefix
                if why is not None:
                    kept.append((full, why))
                    return False
                converted.append(full)
                return True

            float8.convert_to_float8_training(block, module_filter_fn=eligible, config=config)
    head = [
        name
        for name, module in root.named_modules()
        if isinstance(module, nn.Linear) and not _inside_blocks(module, block_lists)
    ]
    kept += [(name, "outside the blocks: the embedding and the output head stay in high precision") for name in head]
    return Float8Conversion(recipe, emulate, converted, kept, config.enable_fsdp_float8_all_gather)


def _inside_blocks(module: nn.Module, block_lists: Sequence[Sequence[nn.Module]]) -> bool:
    return any(module is m for blocks in block_lists for block in blocks for m in block.modules())


def is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")


def float8_tp_styles_apply(recipe: Optional[str], sequence_parallel: bool) -> bool:
    """Whether the converted linears get torchao's float8 TP styles: tensorwise scaling only (torchao has none for
    rowwise), and not under sequence parallelism. There lit_mesh's `gather_input` style gathers each region's input
    once, in high precision, before the linears (lit_mesh/parallel/hidden_states.py), so torchao's column-wise
    style would only cast that whole gathered input to float8 once per linear and keep those copies for backward,
    where lit_mesh's re-gather (lit_mesh/parallel/regather.py) keeps the sequence shard: the same collectives
    (counted: lit_mesh.planner.fake_step), a third fewer activations on the small preset at tp 2. Torch's styles
    then apply to the float8 linears: their matmuls stay float8."""
    return recipe == "tensorwise" and not sequence_parallel


def float8_tp_style(module: nn.Module, style: str, output_layouts: Any) -> Optional[ParallelStyle]:
    """torchao's float8 TP style for a converted linear (the input cast to float8 before the matmul, which the
    column-wise style then all-gathers in float8 under SP; the output's gradient cast to float8 in backward); None:
    the plain style applies."""
    config: Any = getattr(module, "config", None)  # a Float8Linear's Float8LinearConfig
    if not is_float8_linear(module) or config.cast_config_weight.scaling_granularity.value != "tensorwise":
        return None
    tensor_parallel = require("torchao.float8.float8_tensor_parallel")
    if style == "colwise":
        return tensor_parallel.Float8ColwiseParallel()
    if style == "rowwise":
        return tensor_parallel.Float8RowwiseParallel(output_layouts=output_layouts)
    return None
