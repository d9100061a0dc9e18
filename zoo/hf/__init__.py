"""transformers models in the zoo's LightningModules (built from local configs) and their tiny configs."""

from zoo.hf.configs import ARCHITECTURES, tiny_config
from zoo.hf.modules import HFCausalLM, HFImageClassifier

__all__ = ["ARCHITECTURES", "HFCausalLM", "HFImageClassifier", "tiny_config"]
