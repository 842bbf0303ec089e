"""Policy client's reading of SGLang /generate answers: pure parsing, no server (the HTTP paths are tested
against the real arpo-serve in tests/integration/test_policy_client.py)."""

import pytest

from arpo_async.inference_client import PolicyRequestError, _parse_generation, error_message


def _ok(n: int = 3, **meta) -> dict:
    base = {"weight_version": "4", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 5,
            "output_token_logprobs": [[-0.5 * (i + 1), 100 + i, None] for i in range(n)]}
    base.update(meta)
    return {"text": "abc", "output_ids": [100 + i for i in range(n)], "meta_info": base}


def parse(body):
    return _parse_generation(body, latency_s=0.1, attempts=1, url="http://sglang:30000")


def test_a_well_formed_answer():
    g = parse(_ok())
    assert (g.output_ids, g.logprobs, g.weight_version, g.finish_reason) == ([100, 101, 102], [-0.5, -1.0, -1.5],
                                                                          4, "length")
    assert g.token_versions == [4, 4, 4]


@pytest.mark.parametrize("body, message", [
    ({"text": "abc"}, "missing 'text' or 'meta_info'"),
    ({"text": "abc", "meta_info": {"weight_version": "1"}}, "output_token_logprobs"),
    (_ok() | {"output_ids": [1, 2]}, "disagree"),
    (_ok(weight_version="v-abc"), "not an integer policy version"),
    (_ok(weight_version=float("inf")), "not an integer policy version"),
    (_ok(weight_version=1.5), "not an integer policy version"),
    (_ok(weight_version="9" * 31), r"not an integer in \[0, 2\*\*31\)"),
    (_ok(finish_reason=None), "finish_reason"),
    (_ok(weight_versions=[{"version": "1", "start": 0, "end": 2}]), "cover 2 tokens"),
    ([1, 2], "JSON object"),
])
def test_malformed_answers_are_request_errors(body, message):
    with pytest.raises(PolicyRequestError, match=message):
        parse(body)


def test_weight_version_spans_give_per_token_versions_and_default_is_zero():
    spans = [{"version": "5", "start": 2, "end": 3}, {"version": "4", "start": 0, "end": 2}]
    g = parse(_ok(weight_version="5", weight_versions=spans))
    assert (g.weight_version, g.token_versions) == (5, [4, 4, 5])
    g = parse(_ok(weight_version="default"))
    assert (g.weight_version, g.token_versions) == (0, [0, 0, 0])


def test_an_error_body_nested_too_deeply_is_quoted_not_raised():
    assert error_message("[" * 100_000) == "[" * 500
