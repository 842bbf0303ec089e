"""Grammar poisoning against the real `arpo-serve` (issue 48 item 3). On b190f2c a client evicted the action grammar
from the 64-entry cache, then queued distinct grammars that each compile in about a second: the compile queue had no
bound, the action grammar timed out behind them and was refused with 400 until restart, so every actor's /generate
failed. Now the run's grammar is pinned once asked a few times, a client's fifth pending compile is refused with 503
and Retry-After, another client's grammar is compiled in turn, and a compile that outlasts its request's wait is
kept, so the grammar is served when asked again."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from actors.uitars.grammar import action_regex
from arpo_async.grammar import CACHE_SIZE, COMPILES_PER_CLIENT, PIN_AFTER_REQUESTS
from tests.support import ServeProcess, free_port, until

RUN_GRAMMAR = action_regex(max_x=999, max_y=999, fixed_width=True)
"""The actors' action grammar (relative1000 coordinates), as an `arpo run` actor sends it."""
PROMPT = [100] * 4
"""Plain text tokens of the tiny tokenizer."""
PER_CLIENT = "grammars waiting to compile, the most per client"
"""What the refusal of a client's compile over the bound says."""


def slow_regex(n: int, tag: str) -> str:
    """A distinct regex (by ``tag``) of about 11 n characters, far under the size cap, that compiles in seconds on
    the tiny tokenizer: about 2 s for n=100 and 6 s for n=140 on one loaded core (ambiguous runs of letters)."""
    return "".join(f"[a-z]{{1,{i}}}" for i in range(1, n)) + tag


@pytest.fixture
def server(tiny_model, tmp_path):
    """A fresh arpo-serve per test: a flood leaves its compile thread busy for seconds."""
    proc = ServeProcess(tiny_model, free_port(), tmp_path)
    proc.start()
    try:
        yield proc.url
    finally:
        proc.stop()


async def _generate(session: aiohttp.ClientSession, url: str, regex: str,
                    max_new_tokens: int = 4) -> tuple[int, dict, dict]:
    body = {"input_ids": PROMPT, "sampling_params": {"regex": regex, "max_new_tokens": max_new_tokens,
                                                     "temperature": 1.0}}
    async with session.post(f"{url}/generate", json=body) as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def _grammar_state(session: aiohttp.ClientSession, url: str) -> dict:
    """The server's grammar counts (internal_states: grammars_cached, grammars_pinned, grammar_compiles_pending)."""
    async with session.get(f"{url}/get_server_info") as resp:
        return (await resp.json())["internal_states"][0]


def _other_client() -> aiohttp.ClientSession:
    """A client on another loopback address (127.0.0.2): arpo-serve tells clients apart by their IP address."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))


async def test_a_grammar_flood_is_refused_per_client_while_the_runs_grammar_keeps_answering(server):
    """The attack as filed: the run's grammar in use, CACHE_SIZE + 6 distinct grammars to evict it, then 12 slow
    distinct grammars at once. The flood gets 503 with Retry-After once its client has COMPILES_PER_CLIENT
    pending; the run's grammar, asked from that very client while its queue is full, is answered (pinned: no
    compile), and a new grammar from another client is compiled in turn, never refused."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for _ in range(PIN_AFTER_REQUESTS):  # the run's first steps
            status, out, _ = await _generate(s, server, RUN_GRAMMAR)
            assert status == 200 and out["text"].startswith("Thought: "), out
        for i in range(CACHE_SIZE + 6):  # eviction pressure, one at a time (each compiles in milliseconds)
            status, out, _ = await _generate(s, server, f"(evict{i}|x)", max_new_tokens=1)
            assert status == 200, out
        state = await _grammar_state(s, server)
        assert state["grammars_pinned"] == 1 and state["grammars_cached"] == CACHE_SIZE + 1, state

        flood = [asyncio.create_task(_generate(s, server, slow_regex(100, f"flood{i}"))) for i in range(12)]
        refused = await until(lambda: [t.result() for t in flood if t.done() and t.result()[0] == 503],
                              timeout=120, what="a 503 for the flood")
        # the flooding client's queue is full now (a refusal came back): the run's grammar still answers
        for _ in range(3):
            async with asyncio.timeout(120):
                status, out, _ = await _generate(s, server, RUN_GRAMMAR)
            assert status == 200 and out["text"].startswith("Thought: "), out  # sampled under the grammar
        async with _other_client() as other:  # a new grammar of another client: compiled in turn
            status, out, _ = await until(lambda: _generate(other, server, "(left|right)"), timeout=180,
                                         what="the other client's grammar", ok=lambda r: r[0] != 503, every_s=0.5)
            assert status == 200 and out["text"] in ("left", "right"), out
        chat = {"messages": [{"role": "user", "content": "pick"}], "regex": RUN_GRAMMAR, "max_tokens": 4}
        async with s.post(f"{server}/v1/chat/completions", json=chat) as resp:  # the OpenAI route: also pinned
            answer = await resp.json()
        assert resp.status == 200 and answer["choices"][0]["message"]["content"].startswith("Thought: "), answer
        results = await asyncio.gather(*flood)

    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 503}, results  # never 400 (a refused grammar) nor 500
    over = [r for r in results if PER_CLIENT in r[1].get("error", {}).get("message", "")]
    assert len(over) >= 1 and refused, statuses
    assert all(r[0] == 503 and int(r[2]["Retry-After"]) >= 1 for r in over), over
    assert f"already has {COMPILES_PER_CLIENT} " in over[0][1]["error"]["message"]


async def test_a_grammar_that_outlasts_its_wait_is_served_when_asked_again(server):
    """b190f2c refused a grammar whose compile outlasted the 10 s wait with 400 until restart. Three slow grammars
    queued ahead make the fourth wait past 10 s: it gets 503 (Retry-After), its compile goes on, and asking again
    gets it, compiled once. Sizes grow until a wait runs out (a fast machine compiles each in under 10 / 4 s)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for size in (140, 170, 200):
            ahead = [asyncio.create_task(_generate(s, server, slow_regex(size, f"ahead{size}-{i}")))
                     for i in range(COMPILES_PER_CLIENT - 1)]
            await until(lambda: _grammar_state(s, server), timeout=120, what="the grammars queued ahead",
                        ok=lambda state: state["grammar_compiles_pending"] == len(ahead))
            target = slow_regex(size, f"target{size}")
            status, out, headers = await _generate(s, server, target)
            await asyncio.gather(*ahead)
            if status == 503:
                break
            assert status == 200, out
        assert status == 503 and "did not compile within" in out["error"]["message"], out
        assert int(headers["Retry-After"]) >= 1
        status, out, _ = await until(lambda: _generate(s, server, target), timeout=300, every_s=1.0,
                                     what="the timed-out grammar compiled", ok=lambda r: r[0] != 503)
        assert status == 200 and re.fullmatch("[a-z]+", out["text"]), out  # letters only, as the grammar allows
