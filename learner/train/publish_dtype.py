"""The dtype the learner publishes weights in (``learner.publish_dtype``): the one each inference server holds its
weights in, so a bf16 server gets half the bytes of the learner's float32 master weights.

Role: the publishers' (learner.train.publisher) helper. :class:`PublishDtypes` asks each server once which dtype it
serves (the engine's ``served_dtype``: SGLang's --dtype from GET /get_server_info; "auto" resolved from the model's
config.json as SGLang resolves it, learner.train.weight_check.served_dtype) and remembers it per server; the
publishers cast with arpo_async.weight_sync.cast_floating. Casting before sending is what the server does on load
(SGLang's weight loaders copy into parameters of the served dtype), so the weights it serves and their checksums are
the same either way.

What happens when a server does not say: it is asked again at the next publication, and gets float32 meanwhile
(it casts them itself); a dtype name nobody knows is logged and treated alike.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from arpo_async.engine import InferenceEngine
from arpo_async.inference_client import PolicyRequestError, PolicyUnavailable
from learner.train.weight_check import served_dtype

log = logging.getLogger(__name__)


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The bytes ``tensors`` hold (what a publication of them sends)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class PublishDtypes:
    """The dtype to publish to each server, asked once per server (see the module docstring).

    Args:
        served: cast to each server's dtype (``learner.publish_dtype = "served"``); False: publish as trained.
    """

    def __init__(self, served: bool = True) -> None:
        self.served = served
        self._by_url: dict[str, torch.dtype] = {}

    async def of(self, engine: InferenceEngine, model_dir: Path) -> torch.dtype | None:
        """The dtype ``engine`` serves (None: publish as trained, when casting is off or the server does not
        say). ``model_dir``: the model folder whose config.json resolves "auto"."""
        if not self.served:
            return None
        if engine.url not in self._by_url:
            try:
                self._by_url[engine.url] = served_dtype(await engine.served_dtype(), model_dir)
            except (PolicyUnavailable, PolicyRequestError, ValueError) as error:
                log.warning("%s did not say which dtype it serves (%s): publishing float32 to it this time",
                            engine.url, error)
                return None
        return self._by_url[engine.url]

    async def common(self, engines: Sequence[InferenceEngine], model_dir: Path) -> torch.dtype | None:
        """One dtype for a folder every server loads: theirs when they all serve the same one, else None (each
        casts float32 itself)."""
        dtypes = {await self.of(engine, model_dir) for engine in engines}
        if len(dtypes) == 1:
            return dtypes.pop()
        log.warning("the servers do not all say they serve one dtype (%s; None: no answer or casting off): the "
                    "weights folder is written in float32", sorted(str(d) for d in dtypes))
        return None

    def forget(self, url: str) -> None:
        """Ask ``url`` again next time (it restarted, perhaps with another --dtype)."""
        self._by_url.pop(url, None)
