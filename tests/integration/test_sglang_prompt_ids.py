"""The prompt ids SGLang 0.5.23 runs are the prompt ids the learner trains on (issue item 2(d)).

Each scenario runs a real episode of our actors (``EpisodeRunner.run_task``: ``build_messages``, ``PromptEncoder``,
``PolicyClient``) on a real desktop container (``DesktopEnv``, one per screen size, shared by the scenarios and put
back to its boot state between episodes) running the built-in grid4-green task's app (its setup and evaluator; the
instruction is replaced by one with quotes and apostrophes), so screenshots (PNG or JPEG) come from the real
controller and the scripted clicks, typing and keys land on a real app. Only the inference server is a stand-in:
a local HTTP server that records each ``/generate`` body exactly as sent and answers with scripted replies (several
steps, so later prompts hold earlier replies, box tokens re-added; replies of constrained configs match the actors'
own action grammar) and with ``meta_info.prompt_tokens`` as SGLang counts it: the received ids with each
``<|image_pad|>`` expanded for its image's real size. So every step passes the actors' prompt-length guard
(actors/episode.py: a count other than ``len(Step.prompt_ids)`` ends the episode ABORTED,
``test_a_wrong_prompt_count_aborts_the_episode``), and SGLang's own ids must have that length too. Every recorded
body then goes through SGLang's own request preprocessing (tests/sglang_prompt_driver.py, in the SGLang test
environment: ``QwenVLImageProcessor`` built as SGLang's tokenizer process builds it, ``process_mm_data_async`` on
the body's ``input_ids`` and ``image_data``), and the ids SGLang would run must equal, token for token, the step's
``Step.prompt_ids`` (what the learner trains on), with SGLang's image grids equal to our ``smart_resize``.

Scenarios: the actor settings of ``arpo_async/config.py``'s defaults, configs/grid4.toml, examples/run-default.toml
and examples/uitars-1.5-7b.toml (``max_steps`` raised to 4 for multi-step prompts), with the image processor
settings they imply: the tiny model as ``arpo init-model`` writes it (``model = ""``), ``--max-pixels 62720``,
UI-TARS-1.5-7B's preprocessor_config.json (min_pixels 3136, max_pixels 12845056, no ``size``), one without any
pixel keys (Qwen2-VL's defaults 3136 / 1003520) and one with ``size`` only (max 2,116,800); screens of 1280x720
(every config), 1920x1080 (OSWorld), 1366x768 and 1024x768; PNG and JPEG screenshots. Three scenarios run under
other SGLang settings: ``SGLANG_MM_AVOID_RETOKENIZE=0`` (SGLang decodes the ids and tokenizes the text again) and
``--mm-preprocess-cache-size-mb 64`` (its cached-artifact path).

Scenarios of different screen sizes run at the same time (one desktop each); those of one size run one after
the other on its desktop.

What SGLang needs (found here): one ``<|image_pad|>`` per image (``PromptEncoder.collapse_image_pads``; the actors
send that). Sent with the pads already expanded, SGLang's processor refuses the request
(``test_expanded_pads_are_refused``).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from PIL import Image

from actors.desktop_env import DesktopEnv
from actors.episode import EpisodeRunner, load_task
from arpo_async.prompt import build_messages
from arpo_async.config import ActorConfig, load_config
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.messages import Outcome
from arpo_async.model.inputs import ModelInputError, PromptEncoder
from tests.support import catch_all_http_server, labelled

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "sglang_prompt_driver.py"
STEPS = 4

PREPROCESSOR_VARIANTS: dict[str, dict | None] = {
    "tiny": None,  # as create_tiny_model writes it: min 3136, max 28*28*16, both as min/max_pixels and size
    "tiny-max80": {"min_pixels": 3136, "max_pixels": 28 * 28 * 80,
                   "size": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 80}},
    "uitars-1.5": {"min_pixels": 3136, "max_pixels": 16384 * 28 * 28},  # UI-TARS-1.5-7B's layout and values
    "no-pixel-keys": {},  # PromptEncoder's and transformers' defaults: 56*56 .. 28*28*1280
    "size-2116800": {"size": {"shortest_edge": 3136, "longest_edge": 2_116_800}},
}
"""preprocessor_config.json variants written over the tiny model's (its tokenizer and config stay)."""

# (name, config file or None for the defaults, preprocessor variant, screen, extra overrides, SGLang settings)
SCENARIOS = [
    ("defaults", None, "tiny", (1280, 720), [], {}),
    ("grid4", "configs/grid4.toml", "tiny", (1280, 720), [], {}),
    ("run-default", "examples/run-default.toml", "tiny", (1280, 720), [], {}),
    ("run-default-max80-1366", "examples/run-default.toml", "tiny-max80", (1366, 768), [], {}),
    ("run-default-1024-jpeg", "examples/run-default.toml", "tiny", (1024, 768),
     ['actors.screenshot_format="jpeg"'], {}),
    ("uitars-1280", "examples/uitars-1.5-7b.toml", "uitars-1.5", (1280, 720), [], {}),
    ("uitars-1920", "examples/uitars-1.5-7b.toml", "uitars-1.5", (1920, 1080), [], {}),
    ("uitars-1366", "examples/uitars-1.5-7b.toml", "uitars-1.5", (1366, 768), [], {}),
    ("uitars-no-pixel-keys-1920", "examples/uitars-1.5-7b.toml", "no-pixel-keys", (1920, 1080), [], {}),
    ("uitars-2116800-1920-jpeg", "examples/uitars-1.5-7b.toml", "size-2116800", (1920, 1080),
     ['actors.screenshot_format="jpeg"'], {}),
    ("uitars-1920-retokenize", "examples/uitars-1.5-7b.toml", "uitars-1.5", (1920, 1080), [],
     {"env": {"SGLANG_MM_AVOID_RETOKENIZE": "0"}}),
    ("run-default-retokenize", "examples/run-default.toml", "tiny", (1280, 720), [],
     {"env": {"SGLANG_MM_AVOID_RETOKENIZE": "0"}}),
    ("uitars-1920-preprocess-cache", "examples/uitars-1.5-7b.toml", "uitars-1.5", (1920, 1080), [],
     {"server_args": {"mm_preprocess_cache_size_mb": 64}}),
]

# Replies the scripted server answers, in order. A constrained config uses those its action regex accepts.
CONSTRAINED_REPLIES = [
    "Thought: click the Star button\nAction: click(start_box='(045,730)')",
    "Thought: a\nAction: click(start_box='(999,000)')",
    "Thought: type the file name\nAction: type(content='report final\\n')",
    "Thought: b\nAction: click(start_box='(750,507)')",  # the grid4 app's Yellow button
    "Thought: scroll the list\nAction: scroll(start_box='(100,900)', direction='down')",
    "Thought: save it\nAction: hotkey(key='ctrl s')",
]
FREE_REPLIES = [  # unconstrained UI-TARS-1.5 replies: absolute coordinates, free text
    "Thought: Das Menü „Datei“ öffnen — 文件 🙂; then click \"Save as…\".\nAction: click(start_box='(60,40)')",
    "Thought: Type the name, then press Enter.\n\nAction: type(content='report \\'final\\'.odt\\n')",
    "Thought:  scroll  down\tto the end   \nAction: scroll(start_box='(30,20)', direction='down')",
    "Thought: Copy it.\nAction: hotkey(key='ctrl c')",
]
INSTRUCTION = ("Open the file menu and save the document as 'report final.odt' in ~/Documents "
               "(don't overwrite).")
TASK = "grid4-green"
"""The built-in task whose setup (the button-grid app) and evaluator each episode runs on its desktop."""
SCREENS = sorted({s[3] for s in SCENARIOS})


def image_size(data_uri: str) -> tuple[int, int]:
    """(width, height) of a ``data:image/...;base64,...`` screenshot as a client sends it."""
    return Image.open(io.BytesIO(base64.b64decode(data_uri.split(",", 1)[1]))).size


class ScriptedServer:
    """Records each /generate body as sent and answers with the next scripted reply, counting the prompt as
    SGLang does (``meta_info.prompt_tokens``: the ids with each single ``<|image_pad|>`` expanded for its image's
    real size, plus ``prompt_token_error``); ids whose pads do not match the images are refused with HTTP 400,
    as SGLang's processor refuses them."""

    def __init__(self, replies: list[str], encoder: PromptEncoder, prompt_token_error: int = 0) -> None:
        self.replies, self.encoder, self.error = replies, encoder, prompt_token_error
        self.bodies: list[dict] = []
        self.prompt_tokens: list[int] = []  # what it answered, per body

    async def handle(self, request: web.Request) -> web.Response:
        if request.method != "POST" or request.path != "/generate":  # the only request the actors send
            return web.json_response({"error": {"message": f"no {request.method} {request.path} here"}}, status=404)
        body = json.loads(await request.read())
        self.bodies.append(body)
        try:
            sizes = [image_size(uri) for uri in body.get("image_data") or []]
            prompt_tokens = len(self.encoder.expand_image_pads(body["input_ids"], sizes)) + self.error
        except ModelInputError as exc:
            return web.json_response({"error": {"message": f"refused like SGLang: {exc}"}}, status=400)
        self.prompt_tokens.append(prompt_tokens)
        text = self.replies[(len(self.bodies) - 1) % len(self.replies)]
        ids = self.encoder.tokenize(text) + [self.encoder.eos_token_ids[0]]
        return web.json_response({"text": text, "output_ids": ids, "meta_info": {
            "id": body["rid"], "finish_reason": {"type": "stop", "matched": ids[-1]},
            "prompt_tokens": prompt_tokens, "completion_tokens": len(ids), "cached_tokens": 0,
            "weight_version": "0", "e2e_latency": 0.01, "output_token_logprobs": [[-0.5, t, None] for t in ids]}})


def actor_settings(config_file: str | None, screen: tuple[int, int], overrides: list[str]) -> ActorConfig:
    """The config's actor settings with ``max_steps`` = STEPS and the given screen."""
    return load_config(ROOT / config_file if config_file else None,
                       [f"actors.max_steps={STEPS}", f"actors.screen_width={screen[0]}",
                        f"actors.screen_height={screen[1]}", *overrides]).actors


async def _run_episode(env: DesktopEnv, model_dir: Path, actors: ActorConfig, *, prompt_token_error: int = 0):
    """Run one episode of TASK (instruction INSTRUCTION) on ``env``'s desktop, put back to its boot state first,
    against a ScriptedServer; returns (the server, the trajectory)."""
    encoder = PromptEncoder(model_dir)
    regex = EpisodeRunner(encoder, None, actors).sampling_params.get("regex")
    replies = ([r for r in CONSTRAINED_REPLIES if re.fullmatch(regex, r)] if regex else FREE_REPLIES)
    assert len(replies) >= 2, f"no scripted reply matches the actors' grammar {regex!r}"
    server = ScriptedServer(replies, encoder, prompt_token_error)
    task = {**load_task(TASK).to_dict(), "instruction": INSTRUCTION}
    async with catch_all_http_server(server.handle) as url:
        async with PolicyClient([url], retry=RetryPolicy(attempts=1, request_timeout_s=60.0)) as client:
            traj = await EpisodeRunner(encoder, client, actors).run_task(await env.reset_desktop(), task,
                                                                         desktop=env.desktop.name)
    return server, traj


def _model_variants(tiny_model: Path, root: Path) -> dict[str, Path]:
    base = json.loads((tiny_model / "preprocessor_config.json").read_text())
    out = {}
    for name, pixels in PREPROCESSOR_VARIANTS.items():
        if pixels is None:
            out[name] = tiny_model
            continue
        folder = root / name
        folder.mkdir()
        for f in tiny_model.iterdir():
            if f.name != "preprocessor_config.json":
                (folder / f.name).symlink_to(f)
        config = {k: v for k, v in base.items() if k not in ("min_pixels", "max_pixels", "size")}
        (folder / "preprocessor_config.json").write_text(json.dumps({**config, **pixels}, indent=2))
        out[name] = folder
    return out


def run_sglang(python: Path, cases: list[dict], workdir: Path) -> dict[str, dict]:
    """SGLang's prompt ids for each case (tests/sglang_prompt_driver.py), by case name."""
    cases_path, out_path = workdir / "cases.json", workdir / "out.json"
    cases_path.write_text(json.dumps({"cases": cases}))
    proc = subprocess.run([str(python), str(DRIVER), str(cases_path), str(out_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["name"]: r for r in json.loads(out_path.read_text())["results"]}


def first_difference(encoder: PromptEncoder, ours: list[int], theirs: list[int]) -> str:
    """Where two id lists first differ, with both tokens decoded and some context."""
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

    def tok(ids: list[int], i: int) -> str:
        return f"{ids[i]} {encoder.decode([ids[i]], skip_special_tokens=False)!r}" if i < len(ids) else "(end)"

    context = encoder.decode(ours[max(0, n - 12):n], skip_special_tokens=False)
    return (f"first difference at position {n} of {len(ours)} (ours) / {len(theirs)} (SGLang): ours {tok(ours, n)}, "
            f"SGLang {tok(theirs, n)}; text before it: {context!r}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def desktops(desktop_image):
    """One real desktop (DesktopEnv, the default image) per screen size of SCENARIOS, started together, shared by
    the module's episodes; every container is removed at the end, whatever happened."""
    token = secrets.token_hex(3)
    envs = {screen: DesktopEnv(ActorConfig(image=desktop_image, screen_width=screen[0], screen_height=screen[1]),
                               run_id=f"t-sgl-{token}-{screen[0]}x{screen[1]}")
            for screen in SCREENS}
    try:
        started = await asyncio.gather(*(env.__aenter__() for env in envs.values()), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        yield envs
    finally:
        for env in envs.values():
            await env.__aexit__(None, None, None)
        left = [c for env in envs.values() for c in await labelled(env.fleet.run_id)]
        assert not left, f"desktop containers left running: {left}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def episodes(desktops, sglang_python, tiny_model, tmp_path_factory):
    """Every scenario's episode on the desktop of its screen size, and SGLang's prompt ids for each of its
    requests (one driver run)."""
    root = tmp_path_factory.mktemp("sglang-prompt-ids")
    models = _model_variants(Path(tiny_model), root)

    async def run_screen(screen):  # one desktop: its scenarios one after the other
        out = {}
        for name, config_file, variant, size, overrides, _ in SCENARIOS:
            if size == screen:
                actors = actor_settings(config_file, screen, overrides)
                t0 = time.perf_counter()
                server, traj = await _run_episode(desktops[screen], models[variant], actors)
                print(f"{name}: {traj.outcome} in {time.perf_counter() - t0:.1f} s")
                assert not traj.error and len(traj.steps) == STEPS == len(server.bodies), (name, traj.outcome,
                                                                                           traj.error)
                out[name] = (models[variant], server, traj, actors)
        return out

    t0 = time.perf_counter()
    parts = await asyncio.gather(*(run_screen(screen) for screen in SCREENS), return_exceptions=True)
    for part in parts:  # every desktop's episodes have ended (none runs on during teardown): report the first fault
        if isinstance(part, BaseException):
            raise part
    runs = {name: run for part in parts for name, run in part.items()}
    print(f"{len(runs)} episodes on {len(SCREENS)} desktops in {time.perf_counter() - t0:.1f} s")
    cases = []
    for name, config_file, variant, screen, overrides, sglang in SCENARIOS:
        cases += [{"name": f"{name}/{i}", "model_dir": str(models[variant]), "body": body, **sglang}
                  for i, body in enumerate(runs[name][1].bodies)]
    # what the actors sent before: the same prompts with the pads already expanded
    for name in ("run-default", "uitars-1920"):
        model_dir, server, traj, _ = runs[name]
        cases.append({"name": f"{name}/expanded", "model_dir": str(model_dir),
                      "body": {**server.bodies[-1], "input_ids": traj.steps[-1].prompt_ids.tolist()}})
    # plain text that SGLang's Qwen-VL placeholder regex also takes for an image: its legacy "<image>" sentinel
    encoder = PromptEncoder(tiny_model)
    prompt = build_messages("Insert an <image> tag.", [], history_images=2, style="compact")
    cases.append({"name": "image-sentinel", "model_dir": str(tiny_model),
                  "body": {**runs["run-default"][1].bodies[0],
                           "input_ids": encoder.collapse_image_pads(encoder.encode(prompt.messages, [(1280, 720)]))}})
    t0 = time.perf_counter()
    results = await asyncio.to_thread(run_sglang, sglang_python, cases, root)
    print(f"SGLang preprocessed {len(cases)} requests in {time.perf_counter() - t0:.1f} s")
    return runs, results


@pytest.mark.parametrize("scenario", [s[0] for s in SCENARIOS])
def test_sglang_runs_the_ids_we_train_on(episodes, scenario):
    runs, results = episodes
    model_dir, server, traj, actors = runs[scenario]
    encoder = PromptEncoder(model_dir)
    w, h = encoder.resized_size(*actors.screen_size)
    assert len({len(s.image_indices) for s in traj.steps}) > 1 or actors.history_images == 1
    magic = {"png": b"\x89PNG", "jpeg": b"\xff\xd8\xff"}[actors.screenshot_format]
    assert all(shot.startswith(magic) and Image.open(io.BytesIO(shot)).size == actors.screen_size
               for shot in traj.screenshots), "screenshots are not the desktop's, in the configured format"
    for i, (body, step) in enumerate(zip(server.bodies, traj.steps)):
        got = results[f"{scenario}/{i}"]
        assert got["error"] is None, f"step {i}: SGLang refused the request: {got['error']}\n{got['log']}"
        # the count the server answered (and the actors checked) is SGLang's prompt length
        assert server.prompt_tokens[i] == len(got["input_ids"]) == len(step.prompt_ids), (
            f"step {i}: answered prompt_tokens {server.prompt_tokens[i]}, SGLang {len(got['input_ids'])}, "
            f"ours {len(step.prompt_ids)}")
        assert got["image_grid_thw"] == [[1, h // 14, w // 14]] * len(step.image_indices), (
            f"step {i}: SGLang's image grids {got['image_grid_thw']} differ from our smart_resize ({w}x{h})")
        assert got["input_ids"] == step.prompt_ids.tolist(), f"step {i}: " + first_difference(
            encoder, step.prompt_ids.tolist(), got["input_ids"])
        assert not [line for line in got["log"] if "retokenize" in line], got["log"]  # kept verbatim, no warning
        # the wire form: one pad per image, the screenshots in prompt order
        assert body["input_ids"] == encoder.collapse_image_pads(step.prompt_ids)
        assert len(body["image_data"]) == len(step.image_indices) == body["input_ids"].count(encoder.image_pad_id)
    if len(traj.steps) > 1:  # later prompts carry the earlier replies, box tokens re-added
        later = encoder.decode(traj.steps[-1].prompt_ids, skip_special_tokens=False)
        assert traj.steps[0].text.split("\n")[0] in later and "<|box_start|>" in later


def test_expanded_pads_are_refused(episodes):
    """Why the actors collapse the pads: SGLang's processor takes one ``<|image_pad|>`` per image. With
    transformers 5.24 (this environment) it raises; with 5.19 (SGLang's pin) the request never completes."""
    _, results = episodes
    for name in ("run-default/expanded", "uitars-1920/expanded"):
        got = results[name]
        assert got["input_ids"] is None and got["error"], got
        assert "<|image_pad|>" in got["error"] or "Timeout" in got["error"] or "StopIteration" in got["error"]


def test_the_image_sentinel_in_text_is_refused_loudly(episodes):
    """A known limit, pinned: SGLang's Qwen-VL processor also counts the plain text ``<image>`` (its legacy
    placeholder) as an image, so a prompt whose instruction or earlier reply contains it has one placeholder too
    many and is refused (the episode ends ABORTED, nothing is trained on): never silently different ids."""
    _, results = episodes
    got = results["image-sentinel"]
    assert got["input_ids"] is None and "placeholder" in (got["error"] or ""), got


def test_collapse_is_the_inverse_of_expand(tiny_model):
    """One pad per image in, the encoder's expanded ids back out (no SGLang needed)."""
    encoder = PromptEncoder(tiny_model)
    prompt = build_messages(INSTRUCTION, FREE_REPLIES[:3], history_images=3, style="uitars")
    sizes = [(1920, 1080), (1280, 720), (1366, 768)]
    ids = encoder.encode(prompt.messages, sizes)
    collapsed = encoder.collapse_image_pads(ids)
    assert collapsed == encoder.tokenize(encoder.render(prompt.messages))
    assert collapsed.count(encoder.image_pad_id) == 3 and encoder.expand_image_pads(collapsed, sizes) == ids
    assert encoder.collapse_image_pads([]) == [] and encoder.collapse_image_pads(collapsed) == collapsed


@pytest.mark.asyncio(loop_scope="module")
async def test_a_wrong_prompt_count_aborts_the_episode(desktops, tiny_model):
    """A server whose ``meta_info.prompt_tokens`` differs from the ids the learner would train on (here one token
    more than SGLang's count; everything else as in the "defaults" scenario) ends the episode ABORTED at its first
    step: no step recorded, nothing trained on, the error naming both counts."""
    actors = actor_settings(None, (1280, 720), [])
    server, traj = await _run_episode(desktops[(1280, 720)], Path(tiny_model), actors, prompt_token_error=1)
    assert traj.outcome == Outcome.ABORTED.value and traj.steps == [] and len(server.bodies) == 1, (
        traj.outcome, traj.error, len(traj.steps))
    ours = len(PromptEncoder(tiny_model).expand_image_pads(
        server.bodies[0]["input_ids"], [image_size(u) for u in server.bodies[0]["image_data"]]))
    assert server.prompt_tokens == [ours + 1]
    assert traj.error.startswith("GenerationAborted:") and f"prompt of {ours + 1} tokens" in traj.error \
        and f"would train on {ours}:" in traj.error, traj.error
