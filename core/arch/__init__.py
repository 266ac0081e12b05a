"""Architectures from a local config.json: types (Architecture, counts), families (block layouts), config."""

from core.arch.config import Facts, describe, from_config, load_architecture
from core.arch.types import Architecture, LinearModule

__all__ = ["Architecture", "Facts", "LinearModule", "describe", "from_config", "load_architecture"]
