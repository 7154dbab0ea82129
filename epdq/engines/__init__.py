"""Engines: the vision tower (encoder workers) and the LLM backends (PD workers) behind one interface."""

# checkpoint families epdq serves (config.json's model_type); the vision tower maps each to its class
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
