"""Weight publisher: new weights on disk -> every inference server, one server at a time.

Owns: the published weight folders (``<run>/weights/v<N>``) and their pruning.
Protocol per server (REFERENCE.md section 4, as slime and AReaL do it): pause_generation ->
update_weights_from_disk(model_path, weight_version) -> continue_generation. Updating one server at a time
keeps the others generating. A server that refuses the update raises PublishError, naming the server.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from actors.policy_client import PolicyClient


class PublishError(RuntimeError):
    """An inference server did not load the new weights."""


class WeightPublisher:
    """Pushes saved checkpoints to inference servers and keeps the last ``keep`` folders on disk.

    Args:
        client: HTTP client for the servers' admin endpoints.
        urls: every inference server (each gets the update directly, never through a router).
        weights_root: where versioned weight folders live.
        keep: how many published folders to keep (the server may still read the newest).
    """

    def __init__(self, client: PolicyClient, urls: list[str], weights_root: Path, keep: int = 2) -> None:
        self._client = client
        self._urls = list(urls)
        self.weights_root = weights_root
        self._keep = keep

    def folder(self, version: int) -> Path:
        """Where the checkpoint of ``version`` is (to be) saved."""
        return self.weights_root / f"v{version}"

    async def publish(self, version: int) -> float:
        """Load ``folder(version)`` on every server under ``version``; returns the seconds it took.

        Raises:
            PublishError: a server answered success=false; the message names it.
            actors.policy_client.PolicyUnavailable: a server stayed unreachable.
        """
        started = time.perf_counter()
        path = str(self.folder(version).resolve())
        for url in self._urls:
            await self._client.pause_generation(url)
            try:
                reply = await self._client.update_weights_from_disk(url, path, version)
            finally:
                await self._client.continue_generation(url)
            if not reply.get("success", False):
                raise PublishError(f"{url} did not load {path}: {reply.get('message', reply)}")
        self._prune(version)
        return time.perf_counter() - started

    def _prune(self, newest: int) -> None:
        for old in self.weights_root.glob("v*"):
            suffix = old.name[1:]
            if suffix.isdigit() and int(suffix) <= newest - self._keep:
                shutil.rmtree(old, ignore_errors=True)
