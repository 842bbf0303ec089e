"""HTTP client for inference servers that speak SGLang's native API (SGLang itself, or arpo-serve).

Role: the HTTP transport to inference servers and generation, in the shared contract, because both roles use
it: actors call ``generate`` (``PolicyClient`` is one implementation of ``actors.policy.Policy``); the learner
reaches each server through ``arpo_async.sglang_engine.SGLangEngine`` (the learner's ``InferenceEngine``,
arpo_async.engine), which sends SGLang's control routes (pause, weight updates, checksums) with this client's
session and retry policy, to each server directly (a pause or a weight update must reach every server, while
sglang-router spreads requests over them; sglang 0.5.23, python/sglang/srt/entrypoints/http_server.py).

Owns: one aiohttp session (create the client inside the running event loop, close it with ``aclose`` or
``async with``), the retry policy, and the episode -> server assignment.

Invariants:
- one episode always goes to the same server (``server_for``: a stable hash, the same in every process), so
  the server's prefix cache holds the episode's growing prompt;
- a returned ``Generation`` has one log-prob and one policy version per output token, read from the server;
- connection failures, timeouts and 5xx answers are retried with capped exponential backoff and become
  ``PolicyUnavailable`` when the server stays down; a 4xx answer or a malformed response is
  ``PolicyRequestError`` at once (retrying cannot fix the request).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import os
import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Self, Sequence

import aiohttp
import tenacity

from arpo_async.config import ActorConfig
from arpo_async.text import loads_json

log = logging.getLogger(__name__)

_ACTOR_DEFAULTS = ActorConfig()
"""The run config's defaults (actors.policy_attempts, actors.policy_max_wait_s): the library uses the same."""

SGLANG_INITIAL_VERSION = "default"
"""SGLang's ``weight_version`` before any update names one; read as policy version 0."""


class PolicyUnavailable(RuntimeError):
    """The inference server could not be reached (refused, reset, timed out or 5xx) after every retry."""


class GenerationAborted(RuntimeError):
    """The server ended a generation with finish_reason "abort" (it was paused with mode abort, the request was
    aborted, or the server gave up on it): the reply is not the policy's, so the episode ends as ABORTED."""


class PolicyRequestError(RuntimeError):
    """The server rejected the request (4xx), or answered without the fields we need. Not retried.

    Attributes:
        status: the HTTP status (0 when the response was 2xx but malformed).
        url: the endpoint that answered.
        body: the decoded error body (JSON value or text), when there was one.
    """

    def __init__(self, message: str, *, status: int = 0, url: str = "", body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.url = url
        self.body = body


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before declaring a server unavailable.

    Waits between attempts are drawn uniformly from ``[0, min(base_delay_s * 2**i, max_delay_s)]`` ("full
    jitter", AWS Architecture Blog, "Exponential Backoff And Jitter", 2015): hundreds of actors that lost the same
    server spread their retries instead of hitting it in step when it comes back. The call gives up after
    ``attempts`` tries, so the server has on average half the sum of the caps to come back. Longer windows ride
    out server restarts at the price of actors waiting longer before reporting ABORTED.
    """

    attempts: int = _ACTOR_DEFAULTS.policy_attempts
    """Tries per call, the first included (>= 1); default: the run config's ``actors.policy_attempts``."""
    base_delay_s: float = 0.25
    """Wait after the first failure, seconds."""
    max_delay_s: float = _ACTOR_DEFAULTS.policy_max_wait_s
    """Cap on any single wait, seconds; default: the run config's ``actors.policy_max_wait_s``."""
    request_timeout_s: float = 600.0
    """Whole-request timeout for /generate, seconds (a long multi-image generation on a busy server)."""
    connect_timeout_s: float = 5.0
    """TCP connect timeout, seconds."""
    admin_timeout_s: float = 600.0
    """Timeout of health, info and weight calls, seconds (loading 7B weights from disk takes a while)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("retry delays must be >= 0")
        if min(self.request_timeout_s, self.connect_timeout_s, self.admin_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")

    def retrying(self) -> tenacity.AsyncRetrying:
        """tenacity's retry loop for this policy: up to ``attempts`` tries of a call that raises ``RetryableError``,
        waiting uniform in [0, min(base_delay_s * 2**(i-1), max_delay_s)] after the i-th failure
        (``wait_random_exponential``: full jitter); the last failure is re-raised."""
        return tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=tenacity.wait_random_exponential(multiplier=self.base_delay_s, max=self.max_delay_s),
            retry=tenacity.retry_if_exception_type(RetryableError), reraise=True)


@dataclass(frozen=True)
class Generation:
    """One /generate answer.

    Attributes:
        text: the decoded reply (special tokens skipped as the server was asked).
        output_ids: sampled token ids, in order (length T; the end token included when the server returns it).
        logprobs: behaviour log-prob of each output token under the sampling policy (length T, natural log).
        weight_version: the policy version the server reported for the request (its last version).
        token_versions: the policy version that produced each token (length T); differs from a constant list
            only when weights changed mid-request and the server reported ``weight_versions`` spans.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` (the server gave up on the request: the
            caller decides; it is not the policy's fault).
        prompt_tokens: prompt length in tokens as the server counted it (image tokens expanded; 0 when no server
            counted it, e.g. a local embedded policy).
        latency_s: seconds of the successful HTTP attempt.
        attempts: HTTP attempts made (1 when no retry was needed).
        url: the server that answered.
    """

    text: str
    output_ids: list[int]
    logprobs: list[float]
    weight_version: int
    token_versions: list[int]
    finish_reason: str
    prompt_tokens: int
    latency_s: float
    attempts: int = 1
    url: str = ""
    meta_info: dict = field(default_factory=dict, repr=False, compare=False)
    """The server's raw meta_info (for metrics such as cached_tokens); not part of the contract."""


def image_data_uri(data: bytes) -> str:
    """PNG or JPEG bytes -> ``data:image/...;base64,...`` (SGLang's ``image_data`` accepts data URIs).

    Raises:
        ValueError: the bytes are neither PNG nor JPEG.
    """
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        mime = "png"
    elif data[:3] == b"\xff\xd8\xff":
        mime = "jpeg"
    else:
        raise ValueError(f"image bytes are neither PNG nor JPEG (starts with {data[:8]!r})")
    return f"data:image/{mime};base64,{base64.b64encode(data).decode('ascii')}"


MAX_VERSION = 2**31
"""Policy versions are below this (they travel as int32 token versions)."""


def parse_version(raw: Any) -> int:
    """A server's ``weight_version`` -> integer policy version (``"default"`` -> 0).

    Raises:
        PolicyRequestError: anything but a non-negative integer string / int below 2**31 (a policy version travels
            as int32) or SGLang's ``"default"``: a fraction, ``Infinity``, ``1e400``, a bool, a string of 10^30.
    """
    if raw == SGLANG_INITIAL_VERSION:
        return 0
    try:
        if isinstance(raw, float) and not raw.is_integer():
            raise ValueError(raw)
        v = int(raw)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        raise PolicyRequestError(f"server weight_version {str(raw)[:40]!r} is not an integer policy version "
                                 f"(publish weights with an integer weight_version)") from None
    if not 0 <= v < MAX_VERSION or isinstance(raw, bool):
        raise PolicyRequestError(f"server weight_version {str(raw)[:40]!r} is not an integer in [0, 2**31)")
    return v


def _token_versions(meta: dict, n: int, version: int) -> list[int]:
    """Per-token versions from ``meta_info.weight_versions`` spans ({version, start, end}, end exclusive,
    indices into the output tokens), else ``version`` for every token."""
    spans = meta.get("weight_versions")
    if not spans:
        return [version] * n
    out: list[int] = []
    try:
        for span in sorted(spans, key=lambda s: int(s["start"])):
            start, end = int(span["start"]), int(span["end"])
            if start != len(out) or end < start:
                raise ValueError(f"span {span} does not continue at token {len(out)}")
            out += [parse_version(span["version"])] * (end - start)
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyRequestError(f"malformed weight_versions {spans!r}: {exc}") from None
    if len(out) != n:
        raise PolicyRequestError(f"weight_versions cover {len(out)} tokens, the output has {n}")
    return out


def _parse_generation(body: Any, *, latency_s: float, attempts: int, url: str) -> Generation:
    """SGLang /generate JSON -> Generation; PolicyRequestError names the first missing or bad field."""
    def bad(msg: str) -> PolicyRequestError:
        return PolicyRequestError(f"malformed /generate response from {url}: {msg}", url=url)

    if not isinstance(body, dict):
        raise bad(f"expected a JSON object, got {type(body).__name__}")
    meta = body.get("meta_info")
    if not isinstance(body.get("text"), str) or not isinstance(meta, dict):
        raise bad("missing 'text' or 'meta_info'")
    lps = meta.get("output_token_logprobs")
    if not isinstance(lps, list):
        raise bad("missing meta_info.output_token_logprobs (was return_logprob honoured?)")
    try:
        logprobs = [float(e[0]) for e in lps]
        ids_from_lps = [int(e[1]) for e in lps]
    except (TypeError, ValueError, IndexError, OverflowError):  # OverflowError: int(1e400)
        raise bad("output_token_logprobs entries must be [logprob, token_id, text|null]") from None
    if not all(math.isfinite(lp) and lp <= 0 for lp in logprobs):
        raise bad("a log-prob is not a finite number <= 0")
    if not all(0 <= i < MAX_VERSION for i in ids_from_lps):
        raise bad("a token id is not an integer in [0, 2**31)")
    output_ids = body.get("output_ids", ids_from_lps)
    if not isinstance(output_ids, list) or output_ids != ids_from_lps:
        raise bad(f"output_ids ({len(output_ids) if isinstance(output_ids, list) else output_ids!r}) disagree "
                  f"with the token ids of output_token_logprobs ({len(ids_from_lps)})")
    if "weight_version" not in meta:
        raise bad("missing meta_info.weight_version")
    version = parse_version(meta["weight_version"])
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if not isinstance(finish_type, str):
        raise bad(f"missing meta_info.finish_reason.type (got {finish!r})")
    prompt_tokens = meta.get("prompt_tokens")
    if not isinstance(prompt_tokens, int):
        raise bad("missing meta_info.prompt_tokens")
    return Generation(
        text=body["text"], output_ids=ids_from_lps, logprobs=logprobs, weight_version=version,
        token_versions=_token_versions(meta, len(ids_from_lps), version), finish_reason=finish_type,
        prompt_tokens=prompt_tokens, latency_s=latency_s, attempts=attempts, url=url, meta_info=meta,
    )


def error_message(text: str) -> str:
    """The human part of an error body (SGLang: {"error": {"message"}} or {"message"} or {"detail"})."""
    try:
        body = loads_json(text)
    except (ValueError, RecursionError):
        return text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return text.strip()[:500]


class RetryableError(Exception):
    """One failed attempt that may succeed later (a connection error, a timeout, a 5xx): what
    :meth:`RetryPolicy.retrying` retries. Raised by the HTTP attempts of PolicyClient and OpenAIChatPolicy."""


class HttpClient:
    """One aiohttp session, opened on first use with ``retry``'s timeouts and at most ``max_connections``
    connections, closed by :meth:`aclose` or ``async with``. The base of PolicyClient and
    actors.openai_policy.OpenAIChatPolicy. Subclasses set ``self.retry`` and ``self._max_connections``."""

    retry: RetryPolicy
    _max_connections: int
    _session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=aiohttp.ClientTimeout(total=self.retry.request_timeout_s,
                                              sock_connect=self.retry.connect_timeout_s))
        return self._session


ADMIN_API_KEY_ENV = "ARPO_ADMIN_API_KEY"
"""The environment variable that carries the admin key (serve.admin_api_key) to arpo-serve and the learner when the
run file sets none: `arpo run` passes the random key it makes for its own server this way, never on a command
line (which ``ps`` shows) or in a file."""


def admin_api_key(configured: str) -> str:
    """The admin key a process uses: ``configured`` (serve.admin_api_key), else $ARPO_ADMIN_API_KEY, else ""."""
    return configured or os.environ.get(ADMIN_API_KEY_ENV, "")


class PolicyClient(HttpClient):
    """Async client for one or more SGLang-compatible inference servers.

    Args:
        urls: base URLs (``http://host:port``), at least one; episodes are spread over them by ``server_for``.
        retry: the retry policy for every call.
        max_connections: cap on simultaneous HTTP connections (one per in-flight generation).
        api_key: sent as ``Authorization: Bearer <api_key>`` with every request (SGLang's and arpo-serve's
            --api-key); empty = no header.
        admin_api_key: sent instead of ``api_key`` with the weight and control calls (:meth:`post_json`,
            :meth:`post_once`), which a server started with --admin-api-key opens to that key alone (SGLang's
            ADMIN_OPTIONAL routes); empty = those calls send ``api_key`` too.

    Use inside a running event loop: ``async with PolicyClient([...]) as client: ...``.
    """

    def __init__(self, urls: Sequence[str], *, retry: RetryPolicy = RetryPolicy(),
                 max_connections: int = 1024, api_key: str = "", admin_api_key: str = "") -> None:
        if not urls:
            raise ValueError("PolicyClient needs at least one server URL")
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._admin_auth = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else self._auth
        self.urls = [u.rstrip("/") for u in urls]
        self.retry = retry
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self.server_faults: collections.Counter[str] = collections.Counter()
        """/generate answers that could not be used (malformed, non-finite, nested too deeply), by server URL."""

    def server_for(self, episode_id: str) -> str:
        """The server that serves every request of ``episode_id``: ``urls[crc32(episode_id) % len(urls)]``.

        CRC-32 rather than ``hash()`` so every process (and every restart) agrees.
        """
        return self.urls[zlib.crc32(episode_id.encode("utf-8")) % len(self.urls)]

    # ------------------------------------------------------------------------------------------ transport

    async def _once(self, method: str, url: str, *, body: bytes | None, timeout_s: float,
                    admin: bool = False) -> tuple[Any, float]:
        """One HTTP attempt -> (parsed JSON or text, seconds), with the admin key when ``admin``. Raises
        RetryableError or PolicyRequestError."""
        started = time.perf_counter()
        try:
            async with self._http().request(
                method, url, data=body,
                headers={**(self._admin_auth if admin else self._auth), **({"Content-Type": "application/json"} if body is not None else {})},
                timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.retry.connect_timeout_s),
            ) as resp:
                text = (await resp.read()).decode("utf-8", "replace")  # a body that is not UTF-8 stays readable
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        elapsed = time.perf_counter() - started
        if status >= 500:
            raise RetryableError(f"HTTP {status}: {error_message(text)}")
        try:
            parsed: Any = loads_json(text) if text else None
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
            parsed = text
        if status >= 400:
            raise PolicyRequestError(f"{url} answered HTTP {status}: {error_message(text)}",
                                     status=status, url=url, body=parsed) from None
        return parsed, elapsed

    async def _call(self, method: str, url: str, *, body: bytes | None = None,
                    timeout_s: float | None = None, admin: bool = False) -> tuple[Any, float, int]:
        """_once with retries (:meth:`RetryPolicy.retrying`) -> (answer, seconds of the successful attempt,
        attempts). Raises PolicyUnavailable after the last retryable failure, PolicyRequestError at once."""
        try:
            async for attempt in self.retry.retrying():  # ends after a success; a final failure is re-raised
                with attempt:
                    answer, elapsed = await self._once(method, url, body=body, admin=admin,
                                                       timeout_s=timeout_s or self.retry.admin_timeout_s)
        except RetryableError as exc:
            raise PolicyUnavailable(f"{url} unavailable after {self.retry.attempts} attempts: {exc}") from exc
        return answer, elapsed, attempt.retry_state.attempt_number

    async def get_json(self, url: str) -> dict:
        """GET ``url`` (with retries) -> its JSON object. Raises PolicyUnavailable, or PolicyRequestError (4xx, or
        an answer that is not a JSON object)."""
        answer, _, _ = await self._call("GET", url)
        if not isinstance(answer, dict):
            raise PolicyRequestError(f"{url} did not return a JSON object", url=url)
        return answer

    async def post_json(self, url: str, payload: dict, *, accept_failure_body: bool = False) -> dict:
        """POST a small JSON body (admin calls) with retries. With ``accept_failure_body``, a 4xx answer whose JSON
        carries ``success`` (SGLang answers a failed weight update with HTTP 400 + {"success": false, "message"}) is
        returned rather than raised, so the caller can report the server's own message."""
        try:
            answer, _, _ = await self._call("POST", url, body=json.dumps(payload).encode(), admin=True)
        except PolicyRequestError as exc:
            if accept_failure_body and isinstance(exc.body, dict) and "success" in exc.body:
                return exc.body
            raise
        return answer if isinstance(answer, dict) else {"success": True, "message": answer}

    # ------------------------------------------------------------------------------------------ generation

    async def generate(self, *, input_ids: list[int], images: Sequence[bytes], sampling_params: dict,
                       rid: str, episode_id: str) -> Generation:
        """Sample one reply on the episode's server (``server_for(episode_id)``): :meth:`generate_on` there."""
        return await self.generate_on(self.server_for(episode_id), input_ids=input_ids, images=images,
                                      sampling_params=sampling_params, rid=rid)

    async def generate_on(self, url: str, *, input_ids: list[int], images: Sequence[bytes], sampling_params: dict,
                          rid: str) -> Generation:
        """Sample one reply on the server at ``url``.

        Posts SGLang's /generate with ``input_ids`` (one ``<|image_pad|>`` per image: SGLang 0.5.23 expands each
        from its own image processing to the ids the trainer sees, and refuses ids already expanded;
        PromptEncoder.collapse_image_pads), ``image_data`` (one data URI per image placeholder, in prompt order), ``sampling_params``,
        ``return_logprob=True`` and ``logprob_start_len=-1``: in SGLang -1 puts the log-prob window at the end
        of the prompt, so only output tokens get log-probs (no prompt log-probs computed or sent).

        Args:
            input_ids: prompt token ids (length P).
            images: PNG or JPEG bytes, one per image in the prompt, in order.
            sampling_params: SGLang sampling params (``max_new_tokens``, ``temperature``, ``regex``, ...).
            rid: request id, unique per request (used by the server for abort and logging).
        Returns:
            Generation with T output ids, their behaviour log-probs and policy versions.
        Raises:
            PolicyUnavailable: the server stayed unreachable / 5xx through every retry.
            PolicyRequestError: HTTP 4xx (e.g. prompt too long, bad regex) or a malformed response.
            ValueError: an image is neither PNG nor JPEG.
        """
        url = url.rstrip("/")
        payload_head = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                        "return_logprob": True, "logprob_start_len": -1, "rid": rid, "stream": False}

        def encode() -> bytes:  # base64 + JSON of megabytes of screenshots: off the event loop
            payload = dict(payload_head)
            if images:
                payload["image_data"] = [image_data_uri(b) for b in images]
            return json.dumps(payload).encode()

        body = await asyncio.to_thread(encode)
        answer, elapsed, attempts = await self._call("POST", f"{url}/generate", body=body,
                                                     timeout_s=self.retry.request_timeout_s)
        try:
            return _parse_generation(answer, latency_s=elapsed, attempts=attempts, url=url)
        except Exception as error:  # noqa: BLE001 - whatever the answer holds, it is the server's fault
            self.server_faults[url] += 1
            faults = self.server_faults[url]
            if faults <= 5 or faults % 100 == 0:
                log.warning("%s answered /generate with something unusable (%d such answers so far): %s", url,
                            faults, str(error)[:300])
            if isinstance(error, PolicyRequestError) and url in str(error):
                raise
            what = str(error) if isinstance(error, PolicyRequestError) else f"{type(error).__name__}: {error}"
            raise PolicyRequestError(f"malformed /generate response from {url}: {what[:300]}", url=url) from error

    # ------------------------------------------------------------------------------------------ admin

    async def health(self, url: str | None = None) -> bool:
        """True when ``url`` (default: every server) answers GET /health with 200; one attempt, no retry."""
        for u in [url.rstrip("/")] if url else self.urls:
            try:
                await self._once("GET", f"{u}/health", body=None, timeout_s=self.retry.connect_timeout_s)
            except (RetryableError, PolicyRequestError):
                return False
        return True

    async def post_once(self, url: str, payload: dict, timeout_s: float | None = None) -> dict:
        """POST once, no retry (a collective's partner must not be asked twice). A 4xx answer with ``success``
        in its JSON is returned. Raises PolicyUnavailable (unreachable, 5xx, timeout) or PolicyRequestError."""
        try:
            answer, _ = await self._once("POST", url, body=json.dumps(payload).encode(), admin=True,
                                         timeout_s=timeout_s or self.retry.admin_timeout_s)
        except RetryableError as exc:
            raise PolicyUnavailable(f"{url}: {exc}") from exc
        except PolicyRequestError as exc:
            if isinstance(exc.body, dict) and "success" in exc.body:
                return exc.body
            raise
        return answer if isinstance(answer, dict) else {"success": True, "message": answer}
