"""Zoo models <-> transformers models (state dicts, safetensors directories), and export of trained
MeshStrategy checkpoints to directories `from_pretrained` loads. One file per model pair."""

from zoo.convert.api import CONVERTERS, hf_to_zoo, load_hf_as_zoo, save_hf, zoo_to_hf
from zoo.convert.export import export_hf
from zoo.convert.rules import ConversionError

__all__ = ["CONVERTERS", "ConversionError", "export_hf", "hf_to_zoo", "load_hf_as_zoo", "save_hf", "zoo_to_hf"]
