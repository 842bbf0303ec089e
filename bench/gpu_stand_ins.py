"""GPU stand-ins that apply the GPU timing model (bench/gpu_model.py) around the real actor and learner code.

Role: what bench/bench_gpu_model.py puts where the GPUs would be (its desktops' stand-ins are
bench/desktop_stand_ins.py's). Each quacks like the product component it replaces and spends modelled time by
sleeping ``modelled / time_scale`` real seconds:

- :class:`ModelledServer`: one SGLang server on one H100, continuous batching (mixed chunks: each iteration
  prefills up to ``chunk_tokens`` of waiting prompts and decodes one token of every running sequence), KV cache
  room bounding the running sequences, paused while weights load;
- :class:`ModelledPolicy`: ``PolicyClient.generate`` for the EpisodeRunner: counts the prompt's tokens as the 7B
  VLM would (``image_tokens`` per screenshot), finds the prefix the radix cache holds from the episode's previous
  step, asks its episode's server, and replies with a UI-TARS click, or ``finished`` at the episode's drawn length
  (an episode drawn at the budget, ``max_steps``, clicks to the end and the actor truncates it: ``max_steps = 1``
  models one-click tasks such as grid4);
- :class:`StepBarrier` (the ``arpo`` schedule): ARPO's own rollout loop, where the episodes of a round take each
  step together (one generation batch, then every desktop's action, each waited for to its slowest);
- :class:`ModelledTrainer` (``Trainer.train_batch``) and :class:`ModelledPublisher` (``publish_from``, ``catch_up``).

Nothing here is imported by actors/, learner/, arpo_async/ or arpo_serve/.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import random
import threading
import time
from dataclasses import dataclass, field

from bench.gpu_model import EpisodeModel, InferenceModel, TrainingModel

REPLY = "Thought: I click the red button.\nAction: click(start_box='<|box_start|>(640,360)<|box_end|>')"
MAX_CATCH_UP_S = 0.5
"""Real seconds a modelled server may run behind (event-loop lag) and still catch up; beyond, the time is lost."""
FINISHED = "Thought: the task is done.\nAction: finished(content='done')"


@dataclass
class _Request:
    text_tokens: int
    image_tokens: int
    context: int
    """Tokens the sequence holds in the KV cache when done (prompt + output)."""
    output_tokens: int
    done: asyncio.Future
    prefilled: float = 0.0
    """Share of the prompt prefilled so far (0..1)."""


class ModelledServer:
    """One modelled SGLang server; :meth:`run` is its scheduler loop (start it as a task).

    Accounting, in modelled seconds: ``busy_s`` (iterations run), ``paused_s`` (weight loads). A request's
    ``saturated_s`` cost (prefill + its decode tokens at a full KV cache) is summed in ``saturated_s`` for the
    rollout capacity.
    """

    def __init__(self, model: InferenceModel, time_scale: float) -> None:
        self.model, self.scale = model, time_scale
        self.version = 0
        self.busy_s = self.paused_s = self.saturated_s = 0.0
        self.requests = 0
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[tuple[float, int, _Request]] = []  # heap of (finishing iteration, tiebreak, request)
        self._ids = itertools.count()
        self._iteration = 0.0
        self._context = 0  # KV tokens held by prefilling and running sequences
        self._wake = asyncio.Event()
        self._resume = asyncio.Event()
        self._resume.set()
        self._free_at: float | None = None
        """Real time at which the modelled GPU finished its last work; None after an idle spell or a pause."""

    async def generate(self, text_tokens: int, image_tokens: int, context: int) -> int:
        """Prefill the new prompt tokens, decode ``output_tokens``; returns the weight version at the end."""
        m = self.model
        request = _Request(text_tokens, image_tokens, context + m.output_tokens, m.output_tokens,
                           asyncio.get_running_loop().create_future())
        self.saturated_s += m.prefill_s(text_tokens, image_tokens) + m.output_tokens * m.decode_token_s_saturated(
            request.context)
        self.requests += 1
        self._waiting.append(request)
        self._wake.set()
        return await request.done

    async def update_weights(self, version: int, sync_s: float) -> None:
        """Pause generation, load weights for ``sync_s`` modelled seconds, resume at ``version``."""
        self._resume.clear()
        self._wake.set()  # a decode-only wait ends now; the scheduler loop then waits for the resume
        self._free_at = None
        try:
            await asyncio.sleep(sync_s / self.scale)
            self.paused_s += sync_s
            self.version = version
        finally:
            self._resume.set()

    async def run(self) -> None:
        """The scheduler loop (until cancelled)."""
        while True:
            await self._resume.wait()
            chunk = self._take_chunk()
            if chunk:
                await self._iterate(chunk)
            elif self._running:
                await self._decode_until_event()
            else:
                self._wake.clear()
                self._free_at = None
                await self._wake.wait()

    def _start(self) -> float:
        """Real time at which the next GPU work starts: where the last ended while the GPU has been busy without
        a break (so a late wake-up of this event loop costs no modelled GPU time: the work runs back to back until
        it has caught up, at most MAX_CATCH_UP_S behind), else now."""
        now = time.monotonic()
        return now if self._free_at is None else max(self._free_at, now - MAX_CATCH_UP_S)

    def _take_chunk(self) -> list[tuple[_Request, float]]:
        """Waiting prompts for one prefill chunk: (request, share of its prompt in this chunk), in order; a
        prompt is admitted only when its whole context fits in the KV cache room left."""
        m, budget, out = self.model, float(self.model.chunk_tokens), []
        for request in self._waiting:
            if budget <= 0:
                break
            if request.prefilled == 0.0:
                if self._context + request.context > m.kv_cache_tokens and (self._running or out):
                    break
                self._context += request.context
            total = request.text_tokens + request.image_tokens
            share = min(1.0 - request.prefilled, budget / total) if total else 1.0 - request.prefilled
            budget -= share * total
            out.append((request, share))
        return out

    async def _iterate(self, chunk: list[tuple[_Request, float]]) -> None:
        """One mixed iteration: the chunk's prefill plus one decode token for every running sequence."""
        m = self.model
        dt = sum(m.prefill_s(r.text_tokens * s, r.image_tokens * s) for r, s in chunk)
        if self._running:
            dt += m.decode_iteration_s(self._running_context())
        self._free_at = self._start() + dt / self.scale
        await asyncio.sleep(max(0.0, self._free_at - time.monotonic()))
        self.busy_s += dt
        if self._running:
            self._iteration += 1.0
            self._finish_due()
        for request, share in chunk:
            request.prefilled += share
            if request.prefilled >= 1.0 - 1e-9:
                self._waiting.remove(request)
                # the prefill iteration samples the first output token
                heapq.heappush(self._running, (self._iteration + request.output_tokens - 1, next(self._ids), request))
        self._finish_due()

    async def _decode_until_event(self) -> None:
        """Decode-only iterations until the next sequence finishes or a prompt arrives (the iteration count is
        advanced by the modelled time that passed)."""
        step_s = self.model.decode_iteration_s(self._running_context())
        horizon = (self._running[0][0] - self._iteration) * step_s
        self._wake.clear()
        start = self._start()
        try:  # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation racing the event
            async with asyncio.timeout(max(0.0, start + horizon / self.scale - time.monotonic())):
                await self._wake.wait()
        except TimeoutError:
            pass
        elapsed = max(0.0, min(horizon, (time.monotonic() - start) * self.scale))
        self._free_at = start + elapsed / self.scale
        self.busy_s += elapsed
        self._iteration += elapsed / step_s
        self._finish_due()

    def _running_context(self) -> int:
        return sum(r.context for _, _, r in self._running)

    def _finish_due(self) -> None:
        while self._running and self._running[0][0] <= self._iteration + 1e-6:
            _, _, request = heapq.heappop(self._running)
            self._context -= request.context
            if not request.done.done():
                request.done.set_result(self.version)


class BarrierStalled(RuntimeError):
    """A :class:`StepBarrier` waited ``stall_s`` for an episode that never arrived."""


class StepBarrier:
    """ARPO's step-synchronous rollout, for the ``arpo`` schedule of bench/bench_gpu_model.py.

    ARPO's trainer (dvlab-research/ARPO, verl/trainer/ray_trainer.py, ``fit``) runs a round's episodes one step at a
    time: ``generate_sequences`` on the prompts of every running episode as one batch, then ``worker.step`` on
    every desktop and ``ray.get`` on all of them, so each step waits for the slowest generation and then for the
    slowest desktop. Here each episode of a round calls :meth:`arrive` before its
    generation (every running episode has observed: the batch starts together) and after it (the batch returns
    together), and :meth:`leave` once its last generation has returned; the round's next step starts only when
    every running episode has arrived. ``parties`` episodes make a round (ARPO runs one desktop per trajectory of
    the batch: examples/osworld_full_arpo.sh, 128 desktops for 16 tasks x 8 rollouts); when the last one leaves,
    the barrier waits for the next round's ``parties``. An episode's last action is not waited for (it runs after
    its last generation), which can only favour this schedule.

    An episode that ends without reaching the barrier (its desktop failed before its first generation) would hold
    its round forever: after ``stall_s`` real seconds without a release, :meth:`arrive` raises and ``stalled`` says
    why, so the benchmark stops with that message instead of measuring a stuck round.

    Raises:
        ValueError: ``parties`` < 1 or ``stall_s`` <= 0.
    """

    def __init__(self, parties: int, stall_s: float = 300.0) -> None:
        if parties < 1 or stall_s <= 0:
            raise ValueError(f"a step barrier needs at least one party and a positive stall time, not {parties} "
                             f"and {stall_s}")
        self.parties, self.stall_s = parties, stall_s
        self._expected = parties  # episodes of this round still running
        self._arrived = 0
        self._release = asyncio.Event()
        self.phases = 0
        """Phases released so far (two per step of a round)."""
        self.stalled: str | None = None
        """Why the barrier stalled (an episode of the round never arrived), or None."""

    async def arrive(self) -> None:
        """Wait until every running episode of the round has arrived at this point.

        Raises:
            BarrierStalled: ``stall_s`` passed without a release (``stalled`` holds the message).
        """
        self._arrived += 1
        if self._arrived >= self._expected:
            self._open()
            return
        release = self._release
        try:
            async with asyncio.timeout(self.stall_s):
                await release.wait()
        except TimeoutError:
            self.stalled = (f"step barrier stalled: {self._arrived} of {self._expected} running episodes of the "
                            f"round arrived within {self.stall_s:g} s (an episode ended without reaching it)")
            raise BarrierStalled(self.stalled) from None

    def leave(self) -> None:
        """One episode of the round has ended: the others no longer wait for it."""
        self._expected -= 1
        if self._expected <= 0:  # the round is over; the next one starts with `parties` episodes
            self._expected, self._arrived = self.parties, 0
        elif self._arrived and self._arrived >= self._expected:
            self._open()

    def _open(self) -> None:
        self._release.set()
        self._release = asyncio.Event()
        self._arrived = 0
        self.phases += 1


@dataclass
class _Episode:
    steps: int
    done: int = 0
    key: list = field(default_factory=list)


class ModelledPolicy:
    """``PolicyClient.generate`` against modelled servers (see the module docstring).

    Args:
        servers: the modelled servers; an episode sticks to one (the radix cache holds its prefix there).
        episode: draws each episode's length.
        image_pad_id: the encoder's ``<|image_pad|>`` id (one per screenshot in the collapsed ids it sends).
        output_ids: token ids returned for every reply (their count is not the modelled output length).
        seed: seeds the episode lengths.
        screens_by_step: key the radix cache's screenshots by the episode's observation index instead of their
            bytes (real desktops: a static screen gives equal bytes, where an app's screen would change with
            every action, as the in-process desktop's screenshots do).
        barrier: ARPO's step-synchronous rollout (the ``arpo`` schedule): every generation waits at the barrier
            before it starts and after it returns; None (every other schedule): each episode at its own pace.
    """

    def __init__(self, servers: list[ModelledServer], episode: EpisodeModel, image_pad_id: int,
                 output_ids: list[int], seed: int = 0, screens_by_step: bool = False,
                 barrier: StepBarrier | None = None) -> None:
        from arpo_async.inference_client import Generation

        self._generation = Generation
        self.servers, self.episode = servers, episode
        self.image_pad_id, self.output_ids = image_pad_id, output_ids
        self.logprobs = [-0.05 * (i % 7) for i in range(len(output_ids))]
        self._rng = random.Random(seed)
        self._episodes: dict[str, _Episode] = {}
        self.screens_by_step = screens_by_step
        self.barrier = barrier
        self.steps = self.cached_tokens = self.prompt_tokens = 0

    async def generate(self, *, input_ids, images, sampling_params, rid=None, episode_id="", **_):
        ep = self._episodes.get(episode_id)
        if ep is None:
            ep = self._episodes[episode_id] = _Episode(self.episode.steps(self._rng))
        server = self.servers[hash(episode_id) % len(self.servers)]
        per_image = server.model.image_tokens
        # the prompt's screenshots are the episode's last len(images) observations, this step's the last one
        shots = iter(range(ep.done + 1 - len(images), ep.done + 1) if self.screens_by_step else images)
        key = [("image", hash(next(shots))) if i == self.image_pad_id else i for i in input_ids]
        common = next((n for n, (a, b) in enumerate(zip(key, ep.key)) if a != b), min(len(key), len(ep.key)))
        ep.key = key
        new_images = sum(1 for unit in key[common:] if isinstance(unit, tuple))
        new_text = len(key) - common - new_images
        context = len(key) + (per_image - 1) * len(images)
        self.prompt_tokens += context
        self.cached_tokens += context - new_text - new_images * per_image
        if self.barrier is not None:
            await self.barrier.arrive()  # the round's generation batch starts once every episode has observed
        started = time.monotonic()
        version = await server.generate(new_text, new_images * per_image, context)
        latency_s = (time.monotonic() - started) * server.scale
        ep.done += 1
        self.steps += 1
        last = ep.done >= ep.steps
        if last:
            del self._episodes[episode_id]
        if self.barrier is not None:
            await self.barrier.arrive()  # ... and returns when its slowest generation is done
            if last:
                self.barrier.leave()
        # an episode of episode.max_steps steps runs out of the actor's budget (actors.max_steps, the same number):
        # every step is an app action and the actor truncates it; a shorter one ends by saying finished
        finished = last and ep.steps < self.episode.max_steps
        n = len(self.output_ids)
        return self._generation(text=FINISHED if finished else REPLY, output_ids=list(self.output_ids),
                                logprobs=list(self.logprobs), weight_version=version, token_versions=[version] * n,
                                finish_reason="stop", prompt_tokens=0, latency_s=latency_s)


class ModelledTrainer:
    """``Trainer.train_batch`` that spends the modelled training time (blocking: the training loop runs it in a
    thread). Tokens per sample are counted as the 7B VLM sees them: the prompt with ``image_tokens`` per
    screenshot (``tiny_pads_per_image`` is what the bench's tokenizer expanded each to) plus the output."""

    def __init__(self, model: TrainingModel, time_scale: float, image_tokens: int, tiny_pads_per_image: int,
                 output_tokens: int) -> None:
        self.model, self.scale = model, time_scale
        self.image_tokens, self.tiny_pads, self.output_tokens = image_tokens, tiny_pads_per_image, output_tokens
        self.steps = 0
        self.busy_s = 0.0
        self.log: list[tuple[float, float]] = []
        """(time.monotonic() at the end, modelled seconds) per batch."""
        self._lock = threading.Lock()

    def tokens(self, sample) -> int:
        """Tokens of one TrainSample as the 7B VLM trains on it."""
        images = len(sample.images)
        return len(sample.prompt_ids) + images * (self.image_tokens - self.tiny_pads) + self.output_tokens

    def train_batch(self, samples, *, minibatches: int = 1) -> dict[str, float]:
        tokens = sum(self.tokens(s) for s in samples)
        seconds = self.model.batch_s(tokens, minibatches)
        time.sleep(seconds / self.scale)
        with self._lock:
            self.steps += minibatches
            self.busy_s += seconds
            self.log.append((time.monotonic(), seconds))
        return {"loss": 0.0, "tokens": float(tokens), "seconds": seconds, "samples": float(len(samples)),
                "optimizer_steps": float(minibatches)}


class ModelledPublisher:
    """``publish_from``: loads the new weights into every modelled server, one at a time (``weight_sync_s``
    each, generation paused there meanwhile), as learner.train.publisher does; returns the modelled seconds."""

    def __init__(self, servers: list[ModelledServer], model: TrainingModel) -> None:
        self.servers, self.model = servers, model
        self.paused: dict = {}  # the resync's view (learner.train.server_book): modelled servers never pause or lag
        self.busy_s = 0.0
        self.log: list[tuple[float, float]] = []

    async def keep_initial(self, trainer) -> None:
        """learner.train.publisher's ``keep_initial``: nothing (a modelled run writes no weights folder)."""

    async def publish_from(self, trainer, version: int) -> float:
        for server in self.servers:
            await server.update_weights(version, self.model.weight_sync_s)
        seconds = self.model.weight_sync_s * len(self.servers)
        self.busy_s += seconds
        self.log.append((time.monotonic(), seconds))
        return seconds

    async def behind(self, version: int) -> list:
        """learner.train.server_book's ``behind``: no modelled server is ever behind."""
        return []

    async def catch_up(self, trainer, version: int, behind=None) -> list[str]:
        """learner.train.publisher's ``catch_up``: the modelled servers never restart, so none is ever behind."""
        return []
