"""Should an episode's prompts travel as a shared prefix plus a per-step suffix? Bytes and CPU, both ways.

Consecutive prompts of one episode repeat most of their ids (system turn, task, earlier replies and, with ARPO's
layout, every earlier screenshot). What runs: the prompts of one 15-step episode, built by the real UI-TARS
prompt (``arpo_async.prompt.build_messages``) and the real ``PromptEncoder`` (chat template + tokenizer of the
tiny model, with Qwen2.5-VL's image size rule at ``max_pixels`` 2,116,800: 1,196 image tokens per 1280x720
screenshot, as a 7B UI-TARS sees it), for two layouts: the last 2 screenshots (bench_actor_loop's and
bench_transport's) and all of them (ARPO's 15). Two encodings of the 15 prompts:

- whole (today's wire): each step's prompt ids as its own int32 array; the learner keeps a view of the bytes;
- prefix: step i sends ``(k_i, prompt_i[k_i:])``, ``k_i`` the length of the prefix it shares with prompt i-1;
  the learner rebuilds ``prompt_i = concat(prompt_{i-1}[:k_i], suffix_i)``.

Printed per layout: prompt ids and their bytes per trajectory each way, the share of the whole trajectory's
bytes saved (with bench_transport's 15 screenshots, 2.70 MB), and CPU per trajectory (process time, medians of
rounds) to pack on the actor and unpack on the learner, each way.

    python -m bench.bench_prompt_prefix            # 7 rounds of 200 episodes per encoding
    python -m bench.bench_prompt_prefix --quick    # 3 rounds of 20

Last line: ``h2_saved_frac=... h15_saved_frac=... h2_pack_us=... h2_prefix_pack_us=...`` and so on (``saved_frac``:
bytes saved over the whole trajectory, screenshots included).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._common import median, result_line

STEPS = 15
SCREEN = (1280, 720)
SCREENSHOT_BYTES = 2.70e6
"""bench_transport's 15 screenshots (180 KB mean PNG each)."""
QWEN_MAX_PIXELS = 2_116_800
REPLY = ("Thought: The Save button is at the bottom right of the dialog; click it.\n"
         "Action: click(start_box='(1180,650)')")


def episode_prompts(model_dir: Path, history_images: int) -> list[np.ndarray]:
    """The 15 prompts (int32 arrays, image pads expanded) of one episode with ``history_images`` screenshots shown."""
    from arpo_async.prompt import build_messages
    from arpo_async.model.inputs import PromptEncoder

    encoder = PromptEncoder(model_dir)
    prompts = []
    for step in range(STEPS):
        prompt = build_messages("Rename the file report.txt to final.txt and save it.", [REPLY] * step,
                                history_images=history_images)
        ids = encoder.encode(prompt.messages, [SCREEN] * len(prompt.image_indices))
        prompts.append(np.asarray(ids, np.int32))
    return prompts


def pack_whole(prompts: list[np.ndarray]) -> list[bytes]:
    """Today's wire: each prompt's int32 bytes (what the actor's codec writes)."""
    return [p.tobytes() for p in prompts]


def unpack_whole(packed: list[bytes]) -> list[np.ndarray]:
    """Inverse of :func:`pack_whole`: a read-only view of each prompt's bytes (what the learner's codec keeps)."""
    return [np.frombuffer(b, np.int32) for b in packed]


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if len(differ) else m


def pack_prefix(prompts: list[np.ndarray]) -> list[tuple[int, bytes]]:
    """Per step ``(k, int32 bytes of prompt[k:])``, ``k`` the prefix shared with the step before (0 for the first)."""
    out, prev = [], np.zeros(0, np.int32)
    for p in prompts:
        k = shared_prefix(prev, p)
        out.append((k, p[k:].tobytes()))
        prev = p
    return out


def unpack_prefix(packed: list[tuple[int, bytes]]) -> list[np.ndarray]:
    """Inverse of :func:`pack_prefix`: each prompt rebuilt as ``concat(previous[:k], suffix)`` (a new array)."""
    out, prev = [], np.zeros(0, np.int32)
    for k, suffix in packed:
        prev = np.concatenate([prev[:k], np.frombuffer(suffix, np.int32)])
        out.append(prev)
    return out


def cpu_us(fn, arg, n: int, rounds: int) -> float:
    """Median over rounds of the process CPU microseconds of one ``fn(arg)``."""
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(n):
            fn(arg)
        times.append((time.process_time() - t0) / n * 1e6)
    return median(times)


def measure(prompts: list[np.ndarray], n: int, rounds: int) -> dict[str, float]:
    """Ids, bytes (whole / prefix), bytes saved over the whole trajectory, and pack / unpack CPU both ways."""
    whole, prefix = pack_whole(prompts), pack_prefix(prompts)
    assert all(np.array_equal(a, b) for a, b in zip(unpack_prefix(prefix), prompts))  # the round trip is exact
    whole_bytes = sum(map(len, whole))
    prefix_bytes = sum(len(s) + 4 for _, s in prefix)  # + the prefix length (int32) per step
    return {"ids": sum(map(len, prompts)), "suffix_ids": sum(len(s) // 4 for _, s in prefix),
            "bytes": whole_bytes, "prefix_bytes": prefix_bytes,
            "saved_frac": (whole_bytes - prefix_bytes) / (whole_bytes + SCREENSHOT_BYTES),
            "pack_us": cpu_us(pack_whole, prompts, n, rounds),
            "prefix_pack_us": cpu_us(pack_prefix, prompts, n, rounds),
            "unpack_us": cpu_us(unpack_whole, whole, n, rounds),
            "prefix_unpack_us": cpu_us(unpack_prefix, prefix, n, rounds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 20 episodes per encoding")
    args = parser.parse_args(argv)
    rounds, n = (3, 20) if args.quick else (7, 200)
    from arpo_async.model.init_model import create_tiny_model

    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="arpo-prefix-") as tmp:
        model_dir = create_tiny_model(Path(tmp) / "tiny", max_pixels=QWEN_MAX_PIXELS)
        print(f"{'layout':<10} {'ids':>7} {'suffix ids':>10} {'KB whole':>9} {'KB prefix':>9} {'saved of traj':>13} "
              f"{'pack us':>8} {'prefix pack':>11} {'unpack us':>9} {'prefix unpack':>13}")
        for history in (2, STEPS):
            fig = measure(episode_prompts(model_dir, history), n, rounds)
            print(f"history {history:<2} {fig['ids']:>7} {fig['suffix_ids']:>10} {fig['bytes'] / 1e3:>9.0f} "
                  f"{fig['prefix_bytes'] / 1e3:>9.0f} {fig['saved_frac']:>13.3f} {fig['pack_us']:>8.0f} "
                  f"{fig['prefix_pack_us']:>11.0f} {fig['unpack_us']:>9.0f} {fig['prefix_unpack_us']:>13.0f}")
            figures.update({f"h{history}_{key}": value for key, value in fig.items()})
    print(result_line({key: figures[key] for key in sorted(figures) if not key.endswith("ids")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
