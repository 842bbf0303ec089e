"""SGLang 0.5.23's HTTP contract, checked with SGLang's own types, for tests (run it with the python of
tests/sglang_env.py: ``<sglang env>/bin/python tests/sglang_contract.py < exchanges.json``, or with ``--lines``
one JSON list a line, see :func:`main`).

The input is a JSON list of recorded exchanges, ``{"kind": "request" | "response", "method", "path", "body",
"status"?, "text"?, "vocab_size"?}``; the output (stdout, one line) a JSON list with the problems found for each
(see :func:`check_request` and :func:`check_response`). No model and no server run here.

Requests: each body is decoded as SGLang's HTTP layer decodes it (FastAPI/pydantic through the request type's
``msgspec_struct_pydantic_core_schema``, which ignores unknown keys and coerces types laxly); on top of that
:func:`decode` refuses (:class:`BodyMismatch`, naming the field) a key that is not a field of the type
(``msgspec.structs.fields``), a missing required field, and a value that ``msgspec.convert(..., strict=True)`` does
not accept for the field's type. (``msgspec.convert(body, Type)`` on the body itself cannot be used: io_struct's
``BaseReq`` is ``array_like=True``, so msgspec decodes these types from arrays only, "Expected `array`, got
`object`"; the strict check converts the tagged array form instead.) tests/sglang_receiver.py decodes the requests
it serves with the same :func:`decode`. Responses are checked against what entrypoints/http_server.py and
TokenizerManager build.

SGLang's rotary embedding imports ``vllm._custom_ops.rotary_embedding`` on a platform that is neither CUDA nor
SGLang's CPU engine (layers/rotary_embedding/base.py, line 138): :func:`install_vllm_placeholder` puts a
placeholder there that raises if called (nothing here runs a forward pass).
"""
from __future__ import annotations

import json
import sys
import types
import warnings

warnings.filterwarnings("ignore")


class _NotInstalled:
    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.what} is a placeholder in the test receiver (vllm is not installed)")


def install_vllm_placeholder() -> None:
    """``vllm._custom_ops.rotary_embedding``: imported (never called) by SGLang's RotaryEmbedding on a platform
    that is neither CUDA nor SGLang's CPU engine."""
    if "vllm" in sys.modules:
        return
    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = _NotInstalled("vllm._custom_ops.rotary_embedding")
    vllm._custom_ops = ops
    sys.modules.update({"vllm": vllm, "vllm._custom_ops": ops})


class BodyMismatch(ValueError):
    """A request body that SGLang's type does not take as it is (unknown, missing or mistyped field)."""


def decode(body_bytes: bytes, req_type):
    """``body_bytes`` (JSON) -> an instance of SGLang's ``req_type``, as SGLang's HTTP layer decodes it, after the
    stricter checks described in the module docstring. Raises BodyMismatch naming the field."""
    import msgspec
    import pydantic

    try:
        body = json.loads(body_bytes or b"{}")
    except ValueError as error:
        raise BodyMismatch(f"body is not JSON: {error}") from error
    if not isinstance(body, dict):
        raise BodyMismatch(f"body is a JSON {type(body).__name__}, not an object")
    fields = msgspec.structs.fields(req_type)
    known = {f.name for f in fields}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BodyMismatch(f"unknown field(s) {unknown} for SGLang's {req_type.__name__} (fields: {sorted(known)})")
    missing = [f.name for f in fields if f.required and f.name not in body]
    if missing:
        raise BodyMismatch(f"missing required field(s) {missing} of SGLang's {req_type.__name__}")
    try:
        obj = pydantic.TypeAdapter(req_type).validate_python(body)
    except pydantic.ValidationError as error:
        raise BodyMismatch(f"SGLang's {req_type.__name__} refuses the body: {error}") from error
    config = req_type.__struct_config__
    values = [body[f.name] if f.name in body else
              (f.default if f.default is not msgspec.NODEFAULT else f.default_factory()) for f in fields]
    if config.array_like:
        value = ([config.tag] if config.tag is not None else []) + values
    else:
        value = {**({config.tag_field: config.tag} if config.tag is not None else {}),
                 **{f.name: v for f, v in zip(fields, values)}}
    try:
        msgspec.convert(value, req_type, strict=True)
    except msgspec.ValidationError as error:
        raise BodyMismatch(f"SGLang's {req_type.__name__} (strict): {error}") from error
    return obj


# ------------------------------------------------------------------------------------------------ checks

ROUTE_TYPES = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
}
"""Route -> the io_struct type its body is decoded into (entrypoints/http_server.py, sglang 0.5.23)."""

ROUTE_METHODS = {
    "/generate": {"POST", "PUT"}, "/health": {"GET"}, "/get_server_info": {"GET"}, "/get_model_info": {"GET"},
    "/flush_cache": {"GET", "POST"}, "/weights_checker": {"GET", "POST"},
    **{path: {"POST"} for path in ROUTE_TYPES if path != "/weights_checker"},
}
"""The HTTP methods http_server.py registers for each route."""

GENERATE_META_KEYS = frozenset({
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
    "completion_tokens", "cached_tokens", "e2e_latency", "input_token_logprobs", "output_token_logprobs",
    "output_token_logprobs_length"})
"""meta_info keys SGLang's TokenizerManager always writes for a finished, non-streaming /generate with
return_logprob (managers/tokenizer_manager.py: the meta_info dict of _handle_batch_output, its
reasoning/completion/cached tokens update, e2e_latency when finished, convert_logprob_style's
input/output_token_logprobs and output_token_logprobs_length)."""

MODEL_INFO_KEYS = frozenset({
    "model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
    "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
    "has_image_understanding", "has_audio_understanding", "model_type", "architectures"})
"""Keys of http_server.py's /model_info (= /get_model_info) result."""

SERVER_INFO_KEYS = frozenset({
    "model_path", "served_model_name", "tokenizer_path", "host", "port", "incremental_streaming_output",
    "disaggregation_mode", "max_total_num_tokens", "version", "internal_states", "dtype", "device"})
"""Keys of /get_server_info that the api contract's GetServerInfoResponse declares and the Python server builds
(utils/common.build_server_info: ServerArgs.resolved_dict() + the scheduler's handshake info with
max_total_num_tokens; http_server.server_info adds internal_states and version; the contract's deployment_info
is built by the Rust server only and max_context_length by neither), plus the ServerArgs fields learner.train.publisher
reads (dtype, device: its served dtype and hasher)."""

FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")


def check_generate_request(body: dict, vocab_size: int) -> list[str]:
    """A /generate body as SGLang takes it: the HTTP contract gate (entrypoints/api_contract.py), the
    GenerateReqInput dataclass (FastAPI/pydantic decoding, no unknown key, normalize_batch_and_arguments), its
    sampling_params as TokenizerManager builds SamplingParams (``SamplingParams(**sampling_params)``, normalize,
    verify) and each image_data entry through utils.common.load_image."""
    import dataclasses

    import msgspec
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.utils.common import load_image

    problems = []
    error = generate_contract_error(body)
    if error is not None:
        problems.append(f"api contract (entrypoints/api_contract.py): {error}")
    known = {f.name for f in dataclasses.fields(GenerateReqInput)}
    if unknown := sorted(set(body) - known):
        problems.append(f"unknown field(s) {unknown} for GenerateReqInput")
    try:
        obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(body)
        obj.normalize_batch_and_arguments()
    except (pydantic.ValidationError, ValueError, TypeError) as error:
        problems.append(f"GenerateReqInput: {type(error).__name__}: {error}")
    params = body.get("sampling_params") or {}
    api_fields = {f.name for f in msgspec.structs.fields(SamplingParams)}
    if unknown := sorted(set(params) - api_fields):
        problems.append(f"unknown sampling_params key(s) {unknown} for SamplingParams")
    try:
        sampling = SamplingParams(**params)
        sampling.normalize(None)
        sampling.verify(vocab_size)
    except (TypeError, ValueError) as error:
        problems.append(f"SamplingParams: {type(error).__name__}: {error}")
    for k, image in enumerate(body.get("image_data") or []):
        try:
            loaded, _size = load_image(image, gpu_image_decode=False)
            loaded.size  # noqa: B018 - a PIL image
        except Exception as error:  # noqa: BLE001 - reported
            problems.append(f"image_data[{k}] does not load with SGLang's load_image: {error}")
    return problems


def check_request(method: str, path: str, body, vocab_size: int = 1 << 20) -> list[str]:
    """Problems of one request our code sends, as SGLang 0.5.23 would take it."""
    from sglang.srt.managers import io_struct

    problems = []
    if method not in ROUTE_METHODS.get(path, set()):
        problems.append(f"SGLang has no {method} {path} (its methods: {sorted(ROUTE_METHODS.get(path, []))})")
    if path == "/generate":
        return problems + check_generate_request(dict(body or {}), vocab_size)
    if path in ROUTE_TYPES and body is not None:
        try:
            decode(json.dumps(body).encode(), getattr(io_struct, ROUTE_TYPES[path]))
        except BodyMismatch as error:
            problems.append(str(error))
    return problems


def check_response(path: str, status: int, body, text: str) -> list[str]:
    """Problems of one response (arpo-serve's) against what SGLang's http_server.py and TokenizerManager build."""
    import hashlib

    import msgspec
    from sglang.api.v1 import api_types
    from sglang.srt.managers.io_struct import ChecksumInfo
    from sglang.srt.utils.weight_checker import overall_checksum

    problems = []

    def need(keys, have, what):
        if missing := sorted(set(keys) - set(have)):
            problems.append(f"{what} lacks {missing}")

    def contract(decoder, value):
        try:
            decoder.from_json_value(value)
        except api_types.JsonContractError as error:
            problems.append(f"{decoder.__name__} (api contract): {error}")

    if path == "/health":
        if status != 200 or text:
            problems.append(f"/health answered {status} {text[:100]!r}; SGLang answers 200 with an empty body")
    elif path == "/flush_cache":
        if (status, text) != (200, FLUSH_TEXT):
            problems.append(f"/flush_cache answered {status} {text[:100]!r}; SGLang: 200 {FLUSH_TEXT!r}")
    elif path == "/generate":
        contract(api_types.GenerateResponse, body)
        need({"text", "output_ids", "meta_info"}, body, "/generate response")
        need(GENERATE_META_KEYS, body.get("meta_info") or {}, "/generate meta_info")
    elif path in ("/pause_generation", "/continue_generation"):
        verb = "paused" if path == "/pause_generation" else "continued"
        expected = {"message": f"Generation {verb} successfully.", "status": "ok"}
        if (status, body) != (200, expected):
            problems.append(f"{path} answered {status} {body}; SGLang: 200 {expected}")
    elif path == "/weights_checker":
        if set(body) - {"success", "message", "ranks", "per_engine_checksum"}:
            problems.append(f"/weights_checker has keys SGLang does not send: {sorted(body)}")
        need({"success", "message"}, body, "/weights_checker")
        if body.get("success"):
            need({"ranks", "per_engine_checksum"}, body, "/weights_checker")
            infos = []
            for rank in body.get("ranks") or []:
                try:
                    infos.append(msgspec.convert(rank, ChecksumInfo, strict=True))
                except msgspec.ValidationError as error:
                    problems.append(f"a rank is not SGLang's ChecksumInfo: {error}")
                    continue
                if set(rank) != {f.name for f in msgspec.structs.fields(ChecksumInfo)}:
                    problems.append(f"a rank's keys {sorted(rank)} are not ChecksumInfo's")
                if infos[-1].per_gpu_checksum != overall_checksum(infos[-1].checksums):
                    problems.append("per_gpu_checksum is not utils/weight_checker.overall_checksum(checksums)")
            h = hashlib.sha256()
            for info in infos:
                h.update(info.per_gpu_checksum.encode())
            if infos and body.get("per_engine_checksum") != h.hexdigest():
                problems.append("per_engine_checksum is not tokenizer_control_mixin.check_weights' sha256")
        if status != (200 if body.get("success") else 400):
            problems.append(f"HTTP {status} with success={body.get('success')}")
    elif path in ROUTE_TYPES:  # the weight routes: {"success", "message"} (+ num_paused_requests), 200 or 400
        keys = {"success", "message"} | ({"num_paused_requests"} if path == "/update_weights_from_disk" else set())
        if set(body) != keys or not isinstance(body.get("success"), bool) \
                or not isinstance(body.get("message"), str):
            problems.append(f"{path} answered {body}; SGLang answers exactly the keys {sorted(keys)} (success: "
                            "bool, message: str)")
        if status != (200 if body.get("success") else 400):
            problems.append(f"{path}: HTTP {status} with success={body.get('success')}; SGLang: 200 or 400")
    elif path == "/get_server_info":
        contract(api_types.GetServerInfoResponse, body)
        need(SERVER_INFO_KEYS, body, "/get_server_info")
    elif path == "/get_model_info":
        contract(api_types.GetModelInfoResponse, body)
        need(MODEL_INFO_KEYS, body, "/get_model_info")
    else:
        problems.append(f"no check for {path}")
    return problems


def check(exchanges: list[dict]) -> list[dict]:
    """Each recorded exchange with the problems found in it (:func:`check_request` or :func:`check_response`)."""
    out = []
    for ex in exchanges:
        if ex["kind"] == "request":
            problems = check_request(ex["method"], ex["path"], ex.get("body"), ex.get("vocab_size", 1 << 20))
        else:
            problems = check_response(ex["path"], ex["status"], ex.get("body"), ex.get("text", ""))
        out.append({**{k: ex[k] for k in ("kind", "method", "path")}, "problems": problems})
    return out


RESULTS_PREFIX = "RESULTS "
"""With ``--lines``, each answer line starts with this (SGLang's imports may print lines of their own)."""


def main() -> None:
    """Check one JSON list of exchanges read from stdin and print the results as one line; with ``--lines``, check
    each line of stdin (one JSON list each) until it closes, answering each with one line ``RESULTS <json>``, so
    one process (SGLang's imports take most of a check's time) serves a test module's checks."""
    install_vllm_placeholder()
    if "--lines" not in sys.argv[1:]:
        print(json.dumps(check(json.load(sys.stdin))))
        return
    for line in sys.stdin:
        print(RESULTS_PREFIX + json.dumps(check(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
