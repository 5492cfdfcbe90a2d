"""The reference server: a transformers causal LM behind the SGLang-compatible front end.

It lets users see the whole pipeline work before they have an SGLang deployment, and gives the
tests a producer that runs a real model. It follows SGLang's conventions exactly: aux layer id
``i`` is transformers' ``hidden_states[i]`` (the input of decoder layer ``i``), the default layers
are ``[2, N // 2, N - 3]``, and the final state is the post-norm last hidden state
(``hidden_states[-1]``). Only requests that opted in (see `hsdump._protocol.is_opted_in`)
are dumped, so health checks and other clients' traffic leave no trace in the dump root.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio.to_thread

from hsdump._exceptions import ConfigError
from hsdump._protocol import (
    Capabilities,
    DType,
    DumpMeta,
    FinalNorm,
    ProducerInfo,
    ProducerManifest,
    default_dump_dir,
    dtype_spec,
    is_opted_in,
    write_dump,
    write_error,
    write_manifest,
)
from hsdump._servers.http_app import (
    GenerateRequest,
    RequestRejected,
    SGLangCompatibleServer,
    prefill_response,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

__all__ = [
    "ReferenceEngine",
    "ReferenceServer",
    "build_default_model",
    "capture_states",
    "default_device",
    "default_layer_ids",
    "inference_model",
    "load_model",
]

logger = logging.getLogger(__name__)

PRODUCER_NAME = "hsdump-reference"
DEFAULT_SEED = 0
#: The built-in model: small enough to extract the bundled dataset in seconds on two CPU cores.
DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
}
_MAX_GENERATED = 64  # the reference server only exists for prefills; cap the toy decode loop


def _version() -> str:
    from hsdump import __version__

    return __version__


def build_default_model(seed: int = DEFAULT_SEED, **overrides: Any) -> PreTrainedModel:
    """A small random Llama built from a config with a fixed seed (no download).

    Its final norm's weights are drawn from [0.5, 1.5), not left all ones as transformers
    initialises them, so that the pre-norm and post-norm final states differ as in a trained
    model.

    Args:
        seed: The torch seed used to initialise the weights; equal seeds give equal weights.
        **overrides: ``LlamaConfig`` fields replacing those of `DEFAULT_CONFIG`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**DEFAULT_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.copy_(0.5 + torch.rand(norm.shape, generator=torch.Generator().manual_seed(seed)))
    return inference_model(model)


def default_layer_ids(num_layers: int) -> list[int]:
    """SGLang's EAGLE-3 default aux layers ``[2, N // 2, N - 3]``, deduplicated for tiny models."""
    wanted = (2, num_layers // 2, num_layers - 3)
    return sorted({min(max(i, 0), num_layers - 1) for i in wanted})


def capture_states(
    model: PreTrainedModel,
    ids: list[int],
    layer_ids: list[int],
    final_norm: FinalNorm = "post_norm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The states SGLang dumps for one prompt, in the model's dtype and on its device.

    Returns:
        The aux states ``[T, K, H]`` (``hidden_states[i]`` for each of ``layer_ids``) and the
        final state ``[T, H]``: the lm_head input (``hidden_states[-1]``) when ``post_norm``,
        the last decoder layer's output before the final norm when ``pre_norm``.
    """
    import torch

    base: Any = model.base_model
    before_norm: list[torch.Tensor] = []
    hook = None
    if final_norm == "pre_norm":  # transformers' hidden_states holds no pre-norm final state
        hook = base.norm.register_forward_hook(lambda _m, args, _o: before_norm.append(args[0]))
    x = torch.tensor([ids], device=model.device)
    try:
        with torch.inference_mode():
            hidden = base(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        if hook is not None:
            hook.remove()
    aux = torch.stack([hidden[i][0] for i in layer_ids], dim=1)
    return aux, (before_norm[0] if before_norm else hidden[-1])[0]


def load_model(
    model: str | os.PathLike[str], device: str, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Load a local causal LM in ``dtype``, or the device's choice when None."""
    import torch
    from transformers import AutoModelForCausalLM

    # bf16 matmuls are slow on most CPUs: compute in fp32 there, dump bf16 like SGLang does.
    chosen: Any = dtype or ("auto" if device.startswith("cuda") else torch.float32)
    try:
        return inference_model(AutoModelForCausalLM.from_pretrained(os.fspath(model), dtype=chosen))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load a causal LM from {os.fspath(model)!r}: {exc}. Pass a local directory "
            "holding a transformers model (config.json and weights), or none for the built-in one"
        ) from exc


def inference_model(model: Any, device: str | None = None) -> PreTrainedModel:
    """The model in inference mode, on ``device`` when given."""
    if device is not None:
        model = model.to(device)
    return cast("PreTrainedModel", model.eval())


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ReferenceEngine:
    """Runs prefills on a transformers model and dumps opted-in requests (an ``Engine``).

    Args:
        model: A loaded causal LM (with ``output_hidden_states`` support).
        dump_dir: The dump root.
        layer_ids: Aux layer ids (``hidden_states`` indices); SGLang's default when None.
        model_path: What to report as the model path.
        dtype: The protocol dtype the states are dumped in (bf16, as SGLang serves models).
        final_norm: The final state dumped: ``post_norm``, the lm_head input, or ``pre_norm``,
            the final norm's input (as the SGLang plugin's ``HSDUMP_FINAL_NORM``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        dump_dir: str | os.PathLike[str],
        layer_ids: list[int] | None = None,
        model_path: str = "",
        dtype: DType = "bfloat16",
        final_norm: FinalNorm = "post_norm",
    ):
        config = model.config
        self.model = model
        self.dump_dir = Path(dump_dir)
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 4096)
        self.layer_ids = self._check_layers(layer_ids)
        self.model_path = model_path
        self.final_norm: FinalNorm = final_norm
        self.dtype = dtype_spec(dtype)
        self.producer = ProducerInfo(name=PRODUCER_NAME, version=_version())
        self._lock = threading.Lock()  # one forward pass at a time, as one GPU would run them
        self._in_flight: set[str] = set()

    def _check_layers(self, layer_ids: list[int] | None) -> list[int]:
        if layer_ids is None:
            return default_layer_ids(self.num_layers)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if not layer_ids or bad:
            raise ConfigError(
                f"layer ids {layer_ids} are not hidden_states indices of this model: "
                f"use 1 or more ids in [0, {self.num_layers - 1}]"
            )
        return list(layer_ids)

    def manifest(self) -> ProducerManifest:
        """The producer manifest this engine announces in its dump root."""
        return ProducerManifest(
            producer=self.producer,
            layer_ids=self.layer_ids,
            final_norm=self.final_norm,
            hidden_size=self.hidden_size,
            dtype=self.dtype.name,
            model_path=self.model_path,
            # No prefix cache and no chunking: a capture always covers the whole prompt.
            capabilities=Capabilities(
                chunked_prefill_assembly=False, prefix_cache_guard=True, row_moments=True
            ),
        )

    def server_info(self) -> dict[str, Any]:
        """The flat settings SGLang's ``/server_info`` reports, for the fields hsdump checks."""
        return {
            "model_path": self.model_path,
            "version": _version(),
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
            "max_req_input_len": self.context_length,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            # Not in SGLang's body: they let a client check the producer manifest against the model.
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "skip_tokenizer_init": True,
            "tp_size": 1,
            "dp_size": 1,
            "enable_return_aux_hidden_states": True,
            "return_aux_hidden_state_layer_ids": self.layer_ids,
        }

    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/model_info`` body."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
        }

    async def generate(self, request: GenerateRequest) -> dict[str, Any]:
        """Validate the request like SGLang does, run it, and dump it if it opted in."""
        started = time.perf_counter()
        ids = self._check_input(request)
        rid = request.rid or f"ref-{os.urandom(8).hex()}"
        if rid in self._in_flight:
            raise RequestRejected(400, f"Duplicate request ID {rid}")
        self._in_flight.add(rid)
        try:
            max_new = int(request.sampling_params.get("max_new_tokens", 0) or 0)
            output = await anyio.to_thread.run_sync(self._run, rid, ids, max_new)
        finally:
            self._in_flight.discard(rid)
        body = prefill_response(rid, len(ids), started)
        body["output_ids"] = output
        body["meta_info"]["completion_tokens"] = len(output)
        return body

    def _check_input(self, request: GenerateRequest) -> list[int]:
        ids = request.input_ids
        if ids is None:
            raise RequestRejected(400, "this server runs without a tokenizer: send input_ids")
        if not ids:
            raise RequestRejected(400, "input_ids is empty")
        if len(ids) > self.context_length:
            raise RequestRejected(
                400,
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens).",
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestRejected(
                400, f"The input_ids contain values outside the vocabulary [0, {self.vocab_size})."
            )
        return ids

    def _run(self, rid: str, ids: list[int], max_new_tokens: int) -> list[int]:
        with self._lock:
            if not is_opted_in(rid):
                return self._decode(ids, max_new_tokens)
            try:
                aux, final = self._capture(ids)
                self._dump(rid, ids, aux, final)
            except Exception as exc:
                # Publish the failure so the client gives up at once instead of timing out.
                logger.exception("capture of request %s failed", rid)
                write_error(self.dump_dir, rid, f"{type(exc).__name__}: {exc}", self.producer)
                raise RequestRejected(500, f"capture failed: {exc}") from exc
            return self._decode(ids, max_new_tokens)

    def _capture(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        aux, final = capture_states(self.model, ids, self.layer_ids, self.final_norm)
        dtype = self.dtype.torch_dtype()
        return aux.to(dtype).cpu(), final.to(dtype).cpu()

    def _dump(self, rid: str, ids: list[int], aux: torch.Tensor, final: torch.Tensor) -> None:
        meta = DumpMeta(
            rid=rid,
            input_ids=ids,
            num_tokens=len(ids),
            layer_ids=self.layer_ids,
            final_norm=self.final_norm,
            hidden_size=self.hidden_size,
            dtype=self.dtype.name,
            aux_shape=(len(ids), len(self.layer_ids), self.hidden_size),
            final_shape=(len(ids), self.hidden_size),
            producer=self.producer,
            model_path=self.model_path,
        )
        bits = [self.dtype.bits_of(t) for t in (aux, final)]
        write_dump(self.dump_dir, meta, bits[0], bits[1], moments=True)

    def _decode(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """A greedy decode without cache, enough for health checks and warmups."""
        import torch

        budget = min(max_new_tokens, _MAX_GENERATED, self.context_length - len(ids))
        tokens, out = list(ids), []
        with torch.inference_mode():
            for _ in range(max(budget, 0)):
                logits = self.model(input_ids=torch.tensor([tokens], device=self.model.device))
                out.append(int(logits.logits[0, -1].argmax()))
                tokens.append(out[-1])
        return out


class ReferenceServer:
    """A loopback HTTP server speaking SGLang's API and dumping through the hsdump protocol.

    Starts in-process (a background thread) and works from sync code, a script or a notebook::

        with ReferenceServer(dump_dir="/dev/shm/hsdump") as server:
            ...  # point HiddenStateClient at server.url with the same dump_dir

    Args:
        model: A local model directory, a loaded transformers causal LM, or None for the built-in
            small Llama (`build_default_model`).
        dump_dir: The dump root; ``$HSDUMP_DUMP_DIR`` or ``/dev/shm/hsdump`` when None.
        host: Interface to bind (loopback unless told otherwise).
        port: TCP port; 0 picks a free one.
        layer_ids: Aux layer ids (``hidden_states`` indices); SGLang's default when None.
        device: ``"cpu"``, ``"cuda"``...; a GPU when one is present, else the CPU.
        dtype: The protocol dtype the states are dumped in.
        final_norm: ``post_norm`` (the lm_head input, for SpecForge) or ``pre_norm`` (the
            final norm's input, for speculators).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel | None = None,
        *,
        dump_dir: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        layer_ids: list[int] | None = None,
        device: str | None = None,
        dtype: DType = "bfloat16",
        final_norm: FinalNorm = "post_norm",
    ):
        self.dump_dir = Path(dump_dir) if dump_dir is not None else default_dump_dir()
        self.device = device or default_device()
        self.engine = ReferenceEngine(
            self._model(model),
            dump_dir=self.dump_dir,
            layer_ids=layer_ids,
            model_path=self._model_path(model),
            dtype=dtype,
            final_norm=final_norm,
        )
        self._http = SGLangCompatibleServer(self.engine, host=host, port=port)
        self._manifest_path: Path | None = None

    def _model(self, model: str | os.PathLike[str] | PreTrainedModel | None) -> PreTrainedModel:
        if model is None:
            return inference_model(build_default_model(), self.device)
        if isinstance(model, str | os.PathLike):
            return inference_model(load_model(model, self.device), self.device)
        return inference_model(model)

    @staticmethod
    def _model_path(model: object) -> str:
        if model is None:
            return f"builtin:llama-seed{DEFAULT_SEED}"
        if isinstance(model, str | os.PathLike):
            return os.fspath(model)
        return str(getattr(getattr(model, "config", None), "name_or_path", "") or "in-memory")

    @property
    def url(self) -> str:
        """Base URL of the running server."""
        return self._http.url

    @property
    def layer_ids(self) -> list[int]:
        """The aux layer ids dumped."""
        return self.engine.layer_ids

    def start(self) -> None:
        """Announce the producer in the dump root and start serving."""
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            self._manifest_path = write_manifest(self.dump_dir, self.engine.manifest())
        except OSError as exc:
            raise ConfigError(
                f"cannot write to the dump root {self.dump_dir}: {exc.strerror or exc}. Choose a "
                "directory this user may write (--dump-dir, HSDUMP_DUMP_DIR)"
            ) from exc
        try:
            self._http.start()
        except BaseException:
            self._remove_manifest()
            raise
        logger.info("reference server on %s dumping into %s", self.url, self.dump_dir)

    def stop(self) -> None:
        """Stop serving and withdraw the producer manifest."""
        self._http.stop()
        self._remove_manifest()

    def _remove_manifest(self) -> None:
        if self._manifest_path is not None:
            self._manifest_path.unlink(missing_ok=True)
            self._manifest_path = None

    def __enter__(self) -> ReferenceServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
