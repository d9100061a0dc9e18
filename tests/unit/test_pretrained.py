"""Pretrained transformers directories loaded in one process: logits equal transformers' own for every
architecture with a plan (sharded safetensors, tied embeddings, Mixtral's per-expert hub layout), the zoo GPT
and MoE through the converters; missing and mismatched tensors named; another architecture refused by name; the
slice reader against plain indexing for strided index runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from lit_mesh.checkpoint.pretrained import Concatenated, Files, FileTensor, PretrainedError, Stacked, Transposed
from zoo import GPTModule, MoEModule
from zoo.hf.configs import tiny_config
from zoo.hf.modules import HFCausalLM


def _save(directory: Path, architecture: str, **overrides: object) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(architecture, **overrides)).save_pretrained(
        directory, max_shard_size="60KB"
    )
    return directory


def _reference_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory).eval()(input_ids=tokens).logits


TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral", "mixtral", "gpt2"])
def test_hf_causal_lm_logits_equal_transformers(tmp_path: Path, architecture: str) -> None:
    directory = _save(tmp_path, architecture)
    assert (tmp_path / "model.safetensors.index.json").is_file(), "several safetensors files"
    module = HFCausalLM(pretrained=str(directory))
    module.configure_model()  # no MeshStrategy: the whole model is read here
    with torch.no_grad():
        assert torch.equal(module.eval()(TOKENS), _reference_logits(directory, TOKENS))


@pytest.mark.parametrize(("module_class", "architecture"), [(GPTModule, "llama"), (MoEModule, "mixtral")])
def test_zoo_modules_load_through_the_converters(tmp_path: Path, module_class: type, architecture: str) -> None:
    directory = _save(tmp_path, architecture, tie_word_embeddings=False)
    module = module_class(pretrained=str(directory))
    module.configure_model()
    with torch.no_grad():
        torch.testing.assert_close(module.eval()(TOKENS), _reference_logits(directory, TOKENS), rtol=1e-5, atol=1e-5)


def test_tied_llama_directory_loads_into_a_tied_zoo_gpt(tmp_path: Path) -> None:
    directory = _save(tmp_path, "llama", tie_word_embeddings=True)
    assert not any("lm_head" in key for file in tmp_path.glob("*.safetensors") for key in load_file(file))
    module = GPTModule(pretrained=str(directory))
    module.configure_model()
    model = module.model
    assert model.config.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(module.eval()(TOKENS), _reference_logits(directory, TOKENS), rtol=1e-5, atol=1e-5)


def test_missing_and_mismatched_tensors_are_named(tmp_path: Path) -> None:
    directory = _save(tmp_path, "llama")
    files = sorted(tmp_path.glob("*.safetensors"))
    for file in files:
        state = load_file(file)
        state.pop("model.layers.1.mlp.up_proj.weight", None)
        if "model.norm.weight" in state:
            state["model.norm.weight"] = torch.ones(32)
        save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(PretrainedError) as error:
        HFCausalLM(pretrained=str(directory))
    message = str(error.value)
    assert "model.norm.weight: (32,) in" in message and "(64,) in the model" in message
    assert "missing from" in message and "model.layers.1.mlp.up_proj.weight" in message


def test_another_architecture_is_refused_by_name(tmp_path: Path) -> None:
    _save(tmp_path / "qwen2", "qwen2")
    with pytest.raises(
        PretrainedError,
        match=r"holds a Qwen2ForCausalLM \(model_type 'qwen2'\); this module loads \['LlamaForCausalLM'\]",
    ):
        GPTModule(pretrained=str(tmp_path / "qwen2"))
    _save(tmp_path / "opt", "opt")
    with pytest.raises(PretrainedError, match="holds a OPTForCausalLM"):
        HFCausalLM(pretrained=str(tmp_path / "opt"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        HFCausalLM(pretrained=str(tmp_path / "nothing"))


def test_slices_read_from_the_file_equal_indexing(tmp_path: Path) -> None:
    a, b = torch.randn(6, 10), torch.randn(4, 10)
    save_file({"a": a, "b": b, "c": torch.randn(6, 10)}, tmp_path / "w.safetensors")
    t = {
        k: FileTensor(tmp_path / "w.safetensors", k, tuple(v.shape))
        for k, v in load_file(tmp_path / "w.safetensors").items()
    }
    rows, cols = torch.tensor([0, 1, 4, 5]), torch.tensor([2, 3, 4, 8, 9])  # strided: two runs each
    from contextlib import ExitStack

    with ExitStack() as stack:
        files = Files(stack)
        assert torch.equal(t["a"].read(files, [rows, cols]), a[rows][:, cols])
        assert torch.equal(Transposed(t["a"]).read(files, [cols, rows]), a.t()[cols][:, rows])
        both = torch.cat([a, b])
        idx = torch.tensor([1, 5, 6, 9])
        assert torch.equal(Concatenated((t["a"], t["b"]), dim=0).read(files, [idx, cols]), both[idx][:, cols])
        stacked = Stacked((t["a"], t["c"])).read(files, [torch.tensor([1]), rows, cols])
        assert torch.equal(stacked, load_file(tmp_path / "w.safetensors")["c"][rows][:, cols][None])


class _Writes(TorchDispatchMode):
    """The storages (data pointers) every in-place or out= op writes into."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            written = args[i] if i < len(args) else kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(written, torch.Tensor):
                if not written.is_meta:
                    self.storages.add(written.untyped_storage().data_ptr())
        return func(*args, **kwargs)


def _on_meta(module: torch.nn.Module) -> tuple[torch.nn.Module, list]:
    import lit_mesh.hf  # noqa: F401  registers transformers' plans and initialisation, as the strategy does
    from lit_mesh.parallel.apply import find_plan_owners

    with torch.device("meta"):
        module.configure_model()
    return module, find_plan_owners(module)


@pytest.mark.parametrize("kind", ["zoo", "hf"])
def test_materialize_allocates_pretrained_parameters_without_initialising_them(kind: str) -> None:
    """The parameters a pretrained source fills are allocated, never written (no init kernels); every other
    parameter is initialised (zoo: to the same values as without the skip); buffers (RoPE tables) still are."""
    from lit_mesh.init import materialize

    def build() -> tuple[torch.nn.Module, list]:
        return _on_meta(GPTModule() if kind == "zoo" else HFCausalLM(architecture="llama"))

    torch.manual_seed(0)
    reference, owners = build()
    materialize(reference, owners, torch.device("cpu"))
    module, owners = build()
    names = [name for name, _ in module.named_parameters()]
    filled = set(names[::2]) if kind == "zoo" else set(names)  # transformers draws from one stream: skip all
    torch.manual_seed(0)
    with _Writes() as writes:
        materialize(module, owners, torch.device("cpu"), filled=filled)
    params, expected = dict(module.named_parameters()), dict(reference.named_parameters())
    assert not {params[n].untyped_storage().data_ptr() for n in filled} & writes.storages, (
        "a filled parameter was written"
    )
    for name in set(names) - filled:
        assert torch.equal(params[name], expected[name]), name
    buffers, expected_buffers = dict(module.named_buffers()), dict(reference.named_buffers())
    assert (kind == "zoo") or buffers, "the HF Llama has RoPE buffers"
    for name, buffer in buffers.items():
        assert torch.equal(buffer, expected_buffers[name]), name
    assert not any(hasattr(p, "_is_hf_initialized") for p in module.parameters()), "transformers' flag is removed"


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_an_index_naming_files_outside_its_directory_is_refused(tmp_path: Path, name: str) -> None:
    import json

    from zoo.pretrained import INDEX_FILE, directory_tensors

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    (model / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(PretrainedError, match=r"maps weights to .*, which is not a file of"):
        directory_tensors(model)
