"""The modelled SGLang server and policy of bench/bench_gpu_model.py (bench/gpu_stand_ins.py): GPU seconds spent
for hand-computed requests, batching, the KV cache bound, the weight version, the radix-cache prefix, and the step
barrier of ARPO's step-synchronous rollout (the arpo schedule)."""

import asyncio

import pytest

from bench.gpu_model import EpisodeModel, InferenceModel
from bench.gpu_stand_ins import BarrierStalled, ModelledPolicy, ModelledServer, StepBarrier

SCALE = 200.0  # modelled seconds per real second: the requests below take a few real milliseconds


def inference(kv_cache_tokens: int = 10_000) -> InferenceModel:
    return InferenceModel(servers=1, prefill_s_per_token=1e-3, image_token_factor=2.0, decode_base_s=0.01,
                          decode_s_per_context_token=1e-5, chunk_tokens=1000, kv_cache_tokens=kv_cache_tokens,
                          image_tokens=100, output_tokens=5)


async def serve(server: ModelledServer, requests: int) -> list[int]:
    loop = asyncio.create_task(server.run())
    try:
        # each request: 200 text + 100 image tokens, context 300 (+ 5 output)
        return await asyncio.wait_for(asyncio.gather(*(server.generate(200, 100, 300) for _ in range(requests))), 30)
    finally:
        loop.cancel()


async def test_one_request_costs_its_prefill_and_its_decode_iterations():
    server = ModelledServer(inference(), SCALE)
    await serve(server, 1)
    # prefill (200 + 2 x 100) x 1 ms = 0.4 s; then 4 decode iterations (the prefill samples the first of the 5
    # tokens) of 10 ms + 305 context tokens x 10 us
    assert server.busy_s == pytest.approx(0.4 + 4 * 0.01305, rel=1e-3)


async def test_two_requests_share_the_chunk_and_the_decode_iterations():
    server = ModelledServer(inference(), SCALE)
    await serve(server, 2)
    # one chunk of 600 prompt tokens (0.8 s), then 4 iterations decoding both (610 context tokens)
    assert server.busy_s == pytest.approx(0.8 + 4 * (0.01 + 610e-5), rel=1e-3)


async def test_the_kv_cache_bound_serialises_requests():
    server = ModelledServer(inference(kv_cache_tokens=400), SCALE)  # room for one 305-token sequence
    await serve(server, 2)
    assert server.busy_s == pytest.approx(2 * (0.4 + 4 * 0.01305), rel=1e-3)


async def test_a_reply_reports_the_weights_loaded_before_it_finished():
    server = ModelledServer(inference(), SCALE)
    await server.update_weights(3, 0.1)
    assert await serve(server, 1) == [3] and server.paused_s == pytest.approx(0.1)


async def test_the_policy_prefills_only_what_the_episode_step_before_left_in_the_cache():
    server = ModelledServer(inference(), SCALE)
    episode = EpisodeModel(max_steps=15, length_alpha=1.0, budget_share=1.0, action_s_min=0.3, action_s_max=3.0,
                           reset_s=0.1, success_share=0.5)
    policy = ModelledPolicy([server], episode, image_pad_id=9, output_ids=[5, 6])
    loop = asyncio.create_task(server.run())
    try:
        first = await policy.generate(input_ids=[1, 2, 9, 3], images=[b"a"], sampling_params={}, episode_id="e")
        await policy.generate(input_ids=[1, 2, 9, 3, 4, 9, 5], images=[b"a", b"b"], sampling_params={},
                              episode_id="e")
        await policy.generate(input_ids=[1, 2, 9, 4, 9, 5], images=[b"b", b"c"], sampling_params={},
                              episode_id="e")
    finally:
        loop.cancel()
    assert first.text.startswith("Thought:") and "finished" not in first.text  # 15 steps: not the last
    # prompts of 103, 205 and 204 tokens (100 per image); cached: 103 of the second (1, 2, image a, 3), 2 of the
    # third (its third unit is image b where the second prompt had image a)
    assert (policy.prompt_tokens, policy.cached_tokens) == (103 + 205 + 204, 103 + 2)


@pytest.mark.parametrize("max_steps, budget_share, ends_with", [(1, 0.0, "click"), (3, 1.0, "click"),
                                                                  (3, 0.0, "finished")])
async def test_an_episode_at_the_budget_clicks_to_the_end_and_a_shorter_one_says_finished(max_steps, budget_share,
                                                                                          ends_with):
    """One-click tasks (grid4: max_steps = 1) and episodes that run out of budget execute an action at every step and
    are truncated by the actor; an episode drawn shorter than the budget ends with finished."""
    server = ModelledServer(inference(), SCALE)
    episode = EpisodeModel(max_steps=max_steps, length_alpha=50.0, budget_share=budget_share, action_s_min=0.3,
                           action_s_max=3.0, reset_s=0.1, success_share=0.5)  # alpha 50: a drawn length is 1
    policy = ModelledPolicy([server], episode, image_pad_id=9, output_ids=[5, 6])
    loop = asyncio.create_task(server.run())
    try:
        steps = max_steps if budget_share else 1
        replies = [await policy.generate(input_ids=[1, 9], images=[b"a"], sampling_params={}, episode_id="e")
                   for _ in range(steps)]
    finally:
        loop.cancel()
    assert all("click(" in r.text for r in replies[:-1])
    assert ("finished(" in replies[-1].text) == (ends_with == "finished")
    assert ("click(" in replies[-1].text) == (ends_with == "click")
    assert "e" not in policy._episodes  # the episode is over either way


async def test_the_step_barrier_starts_no_step_before_every_running_episode_has_finished_the_one_before():
    """ARPO's loop: a round's episodes take each step together; an episode that has ended is not waited for, and
    once the whole round has ended the barrier takes the next round."""
    barrier = StepBarrier(3)
    log: list[tuple[str, str, int]] = []

    async def episode(name: str, steps: int, work_s: float) -> None:
        for k in range(steps):
            await barrier.arrive()
            log.append(("start", name, k))
            await asyncio.sleep(work_s)
            log.append(("end", name, k))
            await barrier.arrive()
        barrier.leave()

    lengths = {"a": 1, "b": 3, "c": 2}
    await asyncio.wait_for(asyncio.gather(episode("a", 1, 0.0), episode("b", 3, 0.01), episode("c", 2, 0.03)), 10)
    for i, (what, _, k) in enumerate(log):
        if what == "start" and k:  # every episode still running at step k - 1 ended it before this start
            ended_before = {n for w, n, j in log[:i] if w == "end" and j == k - 1}
            assert ended_before == {n for n, steps in lengths.items() if steps >= k}
    assert barrier.phases == 2 * 3  # two per step of the longest episode
    log.clear()
    await asyncio.wait_for(asyncio.gather(*(episode(n, 2, 0.0) for n in "xyz")), 10)  # the next round
    assert len(log) == 3 * 2 * 2 and barrier.phases == 2 * 3 + 2 * 2
    with pytest.raises(ValueError, match="at least one party"):
        StepBarrier(0)


async def test_a_round_whose_episode_never_arrives_stops_with_a_clear_error_instead_of_hanging():
    barrier = StepBarrier(2, stall_s=0.05)  # the second episode of the round failed before its first generation
    with pytest.raises(BarrierStalled, match="1 of 2 running episodes"):
        await asyncio.wait_for(barrier.arrive(), 5)
    assert barrier.stalled and "stalled" in barrier.stalled and barrier.phases == 0


@pytest.mark.parametrize("synchronous", [False, True])
async def test_with_the_step_barrier_a_round_s_generations_return_together(synchronous):
    """Without the barrier a short prompt's reply returns while a long one is still being generated; with it
    (ARPO's batched generate) every reply of the round waits until the slowest generation is done."""
    server = ModelledServer(inference(), SCALE)
    episode = EpisodeModel(max_steps=15, length_alpha=1.0, budget_share=1.0, action_s_min=0.3, action_s_max=3.0,
                           reset_s=0.1, success_share=0.5)
    policy = ModelledPolicy([server], episode, image_pad_id=9, output_ids=[5, 6],
                            barrier=StepBarrier(2) if synchronous else None)
    still_generating: dict[str, int] = {}

    async def ask(name: str, prompt_tokens: int) -> None:
        await policy.generate(input_ids=list(range(10, 10 + prompt_tokens)), images=[], sampling_params={},
                              episode_id=name)
        still_generating[name] = len(server._waiting) + len(server._running)

    loop = asyncio.create_task(server.run())
    try:
        await asyncio.wait_for(asyncio.gather(ask("short", 10), ask("long", 5000)), 30)
    finally:
        loop.cancel()
    assert still_generating == ({"short": 0, "long": 0} if synchronous else {"short": 1, "long": 0})
