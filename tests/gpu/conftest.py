"""Fixtures of the GPU checks: the server that tests/gpu/run.sh started, and the reference model.

Without ``GPU_CHECK_URL`` every test here skips, so the CPU suite collects this folder and runs
none of it; CUDA, transformers and the server are touched only inside the fixtures, after that.
"""

from __future__ import annotations

from typing import Any

import pytest
from _gpu import GpuServer


@pytest.fixture(scope="session")
def gpu_server() -> GpuServer:
    """The server under test; skips the test when none is named."""
    server = GpuServer.from_env()
    if server is None:
        pytest.skip("no GPU server: tests/gpu/run.sh names one in GPU_CHECK_URL")
    return server


@pytest.fixture(scope="session")
def reference_model(gpu_server: GpuServer) -> Any:
    """The server's model in transformers on the GPU, bf16: what every stored layer must match."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpu_server.model, dtype=torch.bfloat16)
    return model.cuda().eval()
