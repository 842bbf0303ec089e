"""The GPU timing model of bench/bench_gpu_model.py (bench/gpu_model.py) with hand-computed numbers from the
shipped bench/gpu_timing.toml, and its loader's refusals."""

import math
import random

import pytest

from bench.gpu_model import DEFAULT_PATH, load_model


def test_formulas_hand_computed_from_the_shipped_file():
    m = load_model(DEFAULT_PATH)
    # (1,000 text + 1.35 x 1,196 image tokens) x 3.614e-5 s
    assert m.inference.prefill_s(1000, 1196) == pytest.approx(2614.6 * 3.614e-5)
    # 5 ms weight read + 3,000 context tokens x 1.71e-8 s
    assert m.inference.decode_iteration_s(3000) == pytest.approx(0.0050513)
    # 100,000 tokens x 1.333 / (8 x 5,554 tokens/s) + 2 steps x 0.05 s
    assert m.training.batch_s(100_000, 2) == pytest.approx(133_300 / 44_432 + 0.1)
    # at a full KV cache (938,000 / 3,000 = 312.7 sequences) the weight read is shared
    assert m.inference.decode_token_s_saturated(3000) == pytest.approx(0.005 / (938_000 / 3000) + 3000 * 1.71e-8)
    # 0.2 x 15 + 0.8 x 15 / H(15)
    assert m.episode.mean_steps() == pytest.approx(3.0 + 0.8 * 15 / sum(1 / k for k in range(1, 16)))
    assert m.episode.mean_action_s() == pytest.approx(2.7 / math.log(10))


def test_episodes_are_heavy_tailed_within_the_budget():
    episode = load_model(DEFAULT_PATH).episode
    rng = random.Random(0)
    steps = [episode.steps(rng) for _ in range(20_000)]
    assert min(steps) == 1 and max(steps) == 15
    share_1 = steps.count(1) / len(steps)
    assert share_1 == pytest.approx(0.8 / sum(1 / k for k in range(1, 16)), abs=0.02)  # Zipf: P(1) = 1 / H(15)
    assert sum(steps) / len(steps) == pytest.approx(episode.mean_steps(), rel=0.03)
    actions = [episode.action_s(rng) for _ in range(5000)]
    assert 0.3 <= min(actions) and max(actions) <= 3.0
    assert sum(actions) / len(actions) == pytest.approx(episode.mean_action_s(), rel=0.03)


def test_overrides_and_scaling():
    m = load_model(DEFAULT_PATH, ["inference.servers=2", "training.weight_sync_s=0.5", "run.time_scale=5"])
    assert (m.inference.servers, m.training.weight_sync_s, m.time_scale) == (2, 0.5, 5.0)
    assert m.scaled("inference", "servers", 0.5).inference.servers == 1
    assert m.scaled("inference", "servers", 0.25).inference.servers == 1  # an integer stays >= 1
    assert m.scaled("training", "tokens_per_s_per_gpu", 2).training.tokens_per_s_per_gpu == 2 * 5554
    with pytest.raises(AttributeError):
        m.scaled("training", "no_such_key", 2)


@pytest.mark.parametrize("override, words", [
    ("inference.no_such_key=1", "unknown ['no_such_key']"),
    ("training.gpus=0", "training.gpus must be a positive number"),
    ("episode.budget_share=-0.1", "non-negative"),
    ("inference.servers='two'", "positive number"),
    ("servers=2", "section.key=value"),
])
def test_refusals_name_the_key(override, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_model(DEFAULT_PATH, [override])


def test_a_missing_key_is_named(tmp_path):
    text = DEFAULT_PATH.read_text().replace("weight_sync_s = 0.12\n", "")
    (tmp_path / "m.toml").write_text(text)
    with pytest.raises(ValueError, match=r"missing \['weight_sync_s'\]"):
        load_model(tmp_path / "m.toml")
