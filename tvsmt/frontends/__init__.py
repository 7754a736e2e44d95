"""Plan producers: the built-in generator of (single, parallel) execplan pairs and the bug zoo
of mutations applied to parallel plans."""

from tvsmt.frontends.generator import ModelConfig, generate_pair, write_pair, write_pair_dicts

__all__ = ["ModelConfig", "generate_pair", "write_pair", "write_pair_dicts"]
