"""``HSDUMP_FINAL_NORM=pre_norm``: the final norm's input, handed down SGLang's aux-state path.

The final norm is the ``norm`` of the module that captures the aux layers (``model.model``, or
Kimi-K2.5's ``language_model.model``). SGLang calls it with the residual, as one fused
add-and-norm kernel that writes ``hidden + residual`` into the residual it returns second: that
tensor is the pre-norm final state. A wrapper on the norm keeps it, and a wrapper on the capture
module's class ``forward`` appends it to the aux states that forward returns, as one more layer.

So the state leaves the model as one of its outputs. CUDA graphs copy it out of their own buffer
on every replay (SGLang's breakable prefill graphs replay the capture module's forward as a
whole), and torch.compile (the piecewise prefill graphs, which compile the class's ``forward``)
traces both wrappers. ``LogitsProcessor`` packs it last, where the post-norm state would go.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["capture_pre_norm"]

_MARK = "_hsdump_appends_pre_norm"


class _Seen:
    """The final norm's input in the forward under way (one forward at a time per process)."""

    pre_norm: Any = None


def capture_pre_norm(module: Any) -> None:
    """Make ``module`` (the capture module) return its final norm's input as a last aux state."""
    norm = getattr(module, "norm", None)
    if norm is None:
        raise RuntimeError(
            f"{type(module).__name__} has no final norm (.norm): HSDUMP_FINAL_NORM=pre_norm "
            "cannot be captured for this architecture; unset it to dump the post-norm state"
        )
    _tap(norm)
    cls = type(module)
    if not getattr(cls.forward, _MARK, False):
        cls.forward = _appending(cls.forward)


def _tap(norm: Any) -> None:
    forward = norm.forward

    def tapped(x: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(x, *args, **kwargs)
        _Seen.pre_norm = out[1] if isinstance(out, tuple) else x
        return out

    norm.forward = tapped


def _appending(forward: Any) -> Any:
    @functools.wraps(forward)
    def forward_appending_pre_norm(self: Any, *args: Any, **kwargs: Any) -> Any:
        _Seen.pre_norm = None
        out = forward(self, *args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 2):
            return out  # a pipeline stage's proxy tensors, or no aux capture
        hidden, aux = out
        pre_norm, _Seen.pre_norm = _Seen.pre_norm, None
        if pre_norm is None:
            raise RuntimeError(
                "hsdump: the final norm did not run in this forward, so its input cannot be "
                "dumped: unset HSDUMP_FINAL_NORM to dump the post-norm state"
            )
        return hidden, _with_final(aux, pre_norm)

    setattr(forward_appending_pre_norm, _MARK, True)
    return forward_appending_pre_norm


def _with_final(aux: Any, pre_norm: Any) -> Any:
    if isinstance(aux, list | tuple):
        return [*aux, pre_norm]
    import torch

    # SGLang's packer hands a [T, K*H] buffer (DeepSeek-V3 and its wrappers).
    return torch.cat([aux, pre_norm.to(aux.dtype)], dim=-1)
