"""A torch ``Dataset`` over a hidden-state store, for drafter training."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

if TYPE_CHECKING:
    import torch

    from hsdump._store.provenance import Provenance
    from hsdump._store.store import HiddenStateStore

__all__ = ["HiddenStateDataset"]


class HiddenStateDataset(Dataset[dict[str, "torch.Tensor"]]):
    """Random access to a store's committed samples, safe with forked DataLoader workers.

    The index (sample IDs and lengths) is read once when the dataset is built; each worker process
    opens its own read-only handle on first access, so no zarr state crosses a fork.

    ``dataset[i]`` returns a dict:

    - ``input_ids``: int64 ``[T]``
    - ``loss_mask``: uint8 ``[T]`` (all ones when the sample was stored without a mask)
    - ``aux_hidden_states``: ``[T, K, H]`` in the stored dtype (bf16 normally)
    - ``final_hidden_state``: ``[T, H]``

    Args:
        path: The store (a path, URL or zarr ``Store``), as for `hsdump.open_store`.
        sample_ids: Restrict to these IDs, in this order (default: every committed sample).
        verify: Recompute each sample's checksum when it is read.

    Attributes:
        path: The store, as given.
        sample_ids: The samples, in dataset order.
        lengths: Each sample's token count, in dataset order.
        provenance: What the store records about its states (layer ids, ``final_norm``...);
            None for a store with no committed sample.
    """

    def __init__(
        self, path: Any, *, sample_ids: list[str] | None = None, verify: bool = False
    ) -> None:
        from hsdump._store.store import open_store

        self.path = path
        self._verify = verify
        store = open_store(path, "r")
        ids = list(store) if sample_ids is None else list(sample_ids)
        lengths = store.lengths()
        missing = [s for s in ids if s not in lengths]
        if missing:
            from hsdump._exceptions import SampleNotFoundError

            raise SampleNotFoundError(
                f"{len(missing)} requested samples are not committed in {path}, "
                f"first {missing[0]!r}: pass only committed ids (see store.committed_ids())"
            )
        self.sample_ids: list[str] = ids
        self.lengths: list[int] = [lengths[s] for s in ids]
        self.provenance: Provenance | None = store.provenance
        self._store: HiddenStateStore | None = store
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _handle(self) -> HiddenStateStore:
        if self._store is None or self._pid != os.getpid():
            from hsdump._store.store import open_store

            self._store = open_store(self.path, "r")
            self._pid = os.getpid()
        return self._store

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import torch

        hs = self._handle().get(self.sample_ids[i], verify=self._verify)
        mask = (
            hs.loss_mask
            if hs.loss_mask is not None
            else torch.ones(hs.num_tokens, dtype=torch.uint8)
        )
        return {
            "input_ids": hs.input_ids,
            "loss_mask": mask,
            "aux_hidden_states": hs.aux_hidden_states,
            "final_hidden_state": hs.final_hidden_state,
        }

    def __getstate__(self) -> dict[str, Any]:
        # A pickled dataset (spawned workers) reopens the store on first use.
        state = self.__dict__.copy()
        state["_store"] = None
        return state
