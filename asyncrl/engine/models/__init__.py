"""Model implementations and the checkpoint loader (config.json + safetensors)."""
from asyncrl.engine.models.config import ARCHITECTURES, ModelConfig
from asyncrl.engine.models.decoder import CausalLM
from asyncrl.engine.models.loader import load_model

__all__ = ["ARCHITECTURES", "ModelConfig", "CausalLM", "load_model"]
