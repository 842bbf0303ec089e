"""The inference-engine seam (arpo_async.engine): SGLangEngine has exactly the protocol's calls, and a second,
working engine written here (arpo-serve's Engine in this process, no HTTP) is driven by the learner's disk
publisher unchanged: pause, load, resume, version, checksum check and catch-up, with real weights moving."""

from __future__ import annotations

import asyncio
import inspect
from typing import Sequence

import pytest
import torch

from arpo_async.config import LearnerConfig
from arpo_async.engine import EngineReply, InferenceEngine, ServedChecksums
from arpo_async.inference_client import Generation, PolicyClient, parse_version
from arpo_async.model.init_model import create_tiny_model
from arpo_async.sglang_engine import PAUSE_MODES, SGLangEngine
from arpo_async.weight_sync import dtype_name, tensor_checksum
from arpo_serve.engine import Engine, SamplingParams
from learner.train.publisher import WeightPublisher, servers_behind
from learner.train.trainer import Trainer

PROTOCOL_CALLS = sorted(name for name, member in vars(InferenceEngine).items()
                        if inspect.iscoroutinefunction(member) and not name.startswith("_"))


class InProcessEngine:
    """arpo-serve's model runner as an InferenceEngine, in this process: weights from disk only (a weight group
    would need a second process), loads refused unless paused, so the publisher's order is checked too."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.url = f"in-process:{engine.model_dir}"
        self.paused = False
        self.calls: list[str] = []

    async def generate(self, *, input_ids: list[int], images: Sequence[bytes], sampling_params: dict,
                       rid: str, episode_id: str = "") -> Generation:
        prepared = await asyncio.to_thread(self.engine.prepare, rid, list(input_ids), list(images),
                                           SamplingParams.from_json(sampling_params), return_logprob=True)
        [result] = await asyncio.to_thread(self.engine.generate_batch, [prepared])
        version = parse_version(result.weight_version)
        return Generation(text=self.engine.encoder.decode(result.output_ids), output_ids=result.output_ids,
                          logprobs=result.output_logprobs, weight_version=version,
                          token_versions=[version] * len(result.output_ids),
                          finish_reason=result.finish_reason["type"], prompt_tokens=result.prompt_tokens,
                          latency_s=0.0, url=self.url)

    async def healthy(self) -> bool:
        return True

    async def weight_version(self) -> int:
        return parse_version(self.engine.weight_version)

    async def pause(self, mode: str = "retract") -> EngineReply:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}")
        self.calls.append("pause")
        self.paused = True
        return EngineReply(True, "paused")

    async def resume(self) -> EngineReply:
        self.calls.append("resume")
        self.paused = False
        return EngineReply(True, "resumed")

    async def load_weights_from_disk(self, path: str, version: int) -> EngineReply:
        self.calls.append("load")
        if not self.paused:
            return EngineReply(False, "load while paused")
        ok, message = await asyncio.to_thread(self.engine.load_weights, path)
        if ok:
            self.engine.weight_version = str(version)
        return EngineReply(ok, message)

    async def weight_group_ranks(self) -> int:
        return 1

    async def join_weight_group(self, **_: object) -> EngineReply:
        return EngineReply(False, "this engine takes weights from disk only")

    async def begin_weight_update(self) -> EngineReply:
        return EngineReply(False, "this engine takes weights from disk only")

    async def receive_weights(self, **_: object) -> EngineReply:
        return EngineReply(False, "this engine takes weights from disk only")

    async def end_weight_update(self) -> EngineReply:
        return EngineReply(False, "this engine takes weights from disk only")

    async def leave_weight_group(self, group_name: str) -> EngineReply:
        return EngineReply(False, "this engine takes weights from disk only")

    async def served_dtype(self) -> str:
        return dtype_name(next(self.engine.model.parameters()).dtype)

    async def weights_checksums(self) -> ServedChecksums:
        checksums = await asyncio.to_thread(self.engine.checksums)
        return ServedChecksums(checksums, await self.served_dtype(), tensor_checksum)


def test_sglang_engine_has_the_protocols_calls_with_its_parameters():
    engine = SGLangEngine(PolicyClient(["http://127.0.0.1:9/"]), "http://127.0.0.1:9/")
    assert isinstance(engine, InferenceEngine) and engine.url == "http://127.0.0.1:9"
    assert len(PROTOCOL_CALLS) == 14, PROTOCOL_CALLS
    for name in PROTOCOL_CALLS:
        ours, theirs = inspect.signature(getattr(InferenceEngine, name)), inspect.signature(getattr(engine, name))
        assert list(ours.parameters)[1:] == list(theirs.parameters), name  # the same keywords, self aside

    class NoResume(InProcessEngine):
        resume = None  # type: ignore[assignment]

    assert not isinstance(NoResume.__new__(NoResume), InferenceEngine)  # the check itself can fail


async def test_the_disk_publisher_drives_a_second_engine(tmp_path):
    model_dir = create_tiny_model(tmp_path / "policy", seed=0)
    served = InProcessEngine(Engine(model_dir))
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    with torch.no_grad():  # weights the server does not hold yet
        for parameter in trainer.model.parameters():
            parameter.add_(0.01)
    assert isinstance(served, InferenceEngine)
    before = (await served.weights_checksums()).checksums
    publisher = WeightPublisher([served], tmp_path / "weights", verify_every=1)

    await publisher.publish_from(trainer, 1)  # verify_every=1: raises WeightsMismatch unless the load took

    assert (publisher.publications, publisher.verified, publisher.failures) == (1, 1, 0)
    assert served.calls == ["pause", "load", "resume"] and not served.paused
    assert (await served.weights_checksums()).checksums != before
    assert await served.weight_version() == 1
    prompt = served.engine.encoder.tokenize("hello")
    generation = await served.generate(input_ids=prompt, images=[], rid="r1", episode_id="e1",
                                       sampling_params={"max_new_tokens": 3, "temperature": 1.0})
    assert generation.output_ids and set(generation.token_versions) == {1}

    # a server behind the current version (here: told nothing of version 2) is caught up from the disk folder
    await asyncio.to_thread(trainer.save_weights, publisher.folder(2), overwrite=True)
    assert await servers_behind([served], 2) == [served]
    assert await publisher.catch_up(trainer, 2) == [served.url]
    assert await servers_behind([served], 2) == [] and await served.weight_version() == 2
    with pytest.raises(ValueError, match="pause mode"):
        await served.pause("nap")
