"""Llama-family decoder, Hugging Face / GGUF loaders, default model conversion."""

from pagedllm.model.config import ModelConfig, RopeConfig
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import LoadedModel, load_model

__all__ = ["LlamaForCausalLM", "LoadedModel", "ModelConfig", "RopeConfig", "load_model"]
