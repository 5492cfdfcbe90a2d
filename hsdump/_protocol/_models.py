"""The JSON documents of a dump root: producer manifests, dump metadata, error markers."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hsdump._protocol._names import DEFAULT_RID_PREFIX, DType

#: The final state's convention: the lm_head input (``post_norm``) or the final norm's input.
FinalNorm = Literal["post_norm", "pre_norm"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProducerInfo(_Model):
    """Which program wrote a dump."""

    name: str
    version: str


class Capabilities(_Model):
    """What a producer guarantees about its captures."""

    chunked_prefill_assembly: bool = Field(
        description="Chunks of one prefill become one dump (else chunked prefill must be off)."
    )
    prefix_cache_guard: bool = Field(
        description="A request with cached prefix tokens gets an error, never a short dump."
    )
    row_moments: bool = Field(
        default=False,
        description="Every dump holds moments.bin, each vector's sum and sum of squares.",
    )


class DumpMeta(_Model):
    """``meta.json`` of a published dump.

    ``layer_ids`` follow the transformers convention: id ``i`` is ``hidden_states[i]``, the input of
    decoder layer ``i`` (0 is the embeddings). The final state is separate; ``final_norm`` says
    whether the model's last norm was applied to it.
    """

    format: Literal["hsdump-dump"] = "hsdump-dump"
    version: Literal[1] = 1
    rid: str
    input_ids: list[int]
    num_tokens: int
    layer_ids: list[int]
    layer_convention: Literal["hidden_states_index"] = "hidden_states_index"
    final_norm: FinalNorm
    hidden_size: int
    dtype: DType
    aux_shape: tuple[int, int, int]
    final_shape: tuple[int, int]
    producer: ProducerInfo
    model_path: str = ""
    rank: int = 0
    created_at: float = Field(default_factory=time.time)
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> DumpMeta:
        t, k, h = self.num_tokens, len(self.layer_ids), self.hidden_size
        if len(self.input_ids) != t:
            raise ValueError(f"num_tokens {t} != len(input_ids) {len(self.input_ids)}")
        if self.aux_shape != (t, k, h) or self.final_shape != (t, h):
            raise ValueError(
                f"shapes aux {self.aux_shape} / final {self.final_shape} do not match "
                f"[T={t}, K={k}, H={h}] / [T, H]"
            )
        return self


class DumpErrorInfo(_Model):
    """The ``error`` marker of a failed capture."""

    format: Literal["hsdump-error"] = "hsdump-error"
    version: Literal[1] = 1
    rid: str
    reason: str
    producer: ProducerInfo
    created_at: float = Field(default_factory=time.time)


class ProducerManifest(_Model):
    """``_producers/<host>-<pid>-<rank>.json``: a producer announcing it dumps into this root."""

    format: Literal["hsdump-producer"] = "hsdump-producer"
    version: Literal[1] = 1
    producer: ProducerInfo
    host: str = Field(default_factory=socket.gethostname)
    pid: int = Field(default_factory=os.getpid)
    rank: int = 0
    rid_prefix: str = DEFAULT_RID_PREFIX
    layer_ids: list[int]
    final_norm: FinalNorm
    hidden_size: int
    dtype: DType
    model_path: str = ""
    capabilities: Capabilities
    started_at: float = Field(default_factory=time.time)

    def is_alive(self) -> bool:
        """False only when the producer ran on this host and its pid is gone."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
