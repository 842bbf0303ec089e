"""arpo-serve's sampler and sampling-params validation (pure functions, no server)."""

from __future__ import annotations

import pytest
import torch

from arpo_serve.sampling import RequestError, SamplingParams, sample_token


def test_sampling_params_from_sglang_json():
    p = SamplingParams.from_json({"max_new_tokens": 64, "temperature": 0.5, "stop": "\n\n", "stop_token_ids": [3],
                                  "regex": "a+", "n": 1, "frequency_penalty": 0.0})
    assert p.max_new_tokens == 64 and p.temperature == 0.5 and p.stop == ("\n\n",) and p.stop_token_ids == (3,)
    assert p.grammar is not None and p.grammar.key == ("regex", "a+")
    assert SamplingParams.from_json(None) == SamplingParams()


@pytest.mark.parametrize("bad", [{"max_new_tokens": 1.5}, {"max_new_tokens": -1}, {"top_p": 0}, {"top_k": 0},
                                 {"temperature": -0.1}, {"regex": "a", "ebnf": "root ::= \"a\""}, [1]])
def test_sampling_params_rejects(bad):
    with pytest.raises(RequestError):
        SamplingParams.from_json(bad)


def test_greedy_top_k_1_and_tiny_top_p_pick_the_argmax():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        for _ in range(20):
            assert sample_token(logits, params, g)[0] == 1


def test_reported_tempered_logprob_and_empirical_frequencies():
    logits = torch.tensor([0.0, 1.0, 2.0])
    params = SamplingParams(temperature=2.0)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    for _ in range(4000):
        token, lp = sample_token(logits, params, g)
        counts[token] += 1
        assert lp == pytest.approx(float(torch.log_softmax(logits / 2.0, -1)[token]), abs=1e-6)
    expected = torch.softmax(logits / 2.0, -1)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.2: top_p 0.7 keeps {0, 1}; token 2 must never appear.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    g = torch.Generator().manual_seed(2)
    seen = {sample_token(logits, SamplingParams(top_p=0.7), g)[0] for _ in range(500)}
    assert seen == {0, 1}


def test_masked_tokens_are_never_sampled():
    logits = torch.tensor([5.0, float("-inf"), 0.0, float("-inf")])
    g = torch.Generator().manual_seed(3)
    assert {sample_token(logits, SamplingParams(), g)[0] for _ in range(300)} <= {0, 2}
