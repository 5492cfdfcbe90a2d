"""The plugin's dump path without SGLang, for tests that drive it with stand-in batches.

SGLang needs a GPU; everything after the forward does not. These are the parts a test builds on
the CPU: the settings, the planner that maps a batch's rows to requests, the pinned ring and the
stager that copy rows into it, and the dumper that feeds the writer threads real dump files.
Importing this module imports torch.
"""

from __future__ import annotations

from sglang_patch._config import PluginConfig, load_config
from sglang_patch._dumper import Dumper
from sglang_patch._plan import ChunkPlanner
from sglang_patch._staging import PinnedRing, Stager, vector_moments
from sglang_patch._writer import DumpFormat

__all__ = [
    "ChunkPlanner",
    "DumpFormat",
    "Dumper",
    "PinnedRing",
    "PluginConfig",
    "Stager",
    "load_config",
    "vector_moments",
]
