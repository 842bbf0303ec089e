"""Model I/O: smart_resize reference values, prompt encoding with image-pad expansion, the tiny checkpoint
loading through transformers' Auto classes, and token_logprobs against transformers' own forward."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from arpo_async.model.init_model import QWEN_SPECIAL_TOKENS, TINY_MAX_PIXELS, create_tiny_model, text_shape
from arpo_async.model.inputs import (
    ModelInputError,
    PromptEncoder,
    load_policy,
    pixel_inputs,
    smart_resize,
)
from tests.reference_logprobs import token_logprobs

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "policy", seed=0)


def _png(size: tuple[int, int], color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


# ------------------------------------------------------------------ smart_resize


def test_smart_resize_arpo_reference_screen():
    # ARPO's setting (arXiv 2505.16282): 1920x1080 with max_pixels 2,116,800 (= 2700 x 28 x 28, UI-TARS's
    # codes/ui_tars/action_parser.py smart_resize) -> 1932x1092 = 2,691 image tokens.
    h, w = smart_resize(1080, 1920, max_pixels=2_116_800)
    assert (h, w) == (1092, 1932)
    assert (h // 28) * (w // 28) == 2691


def test_smart_resize_hand_computed_branches():
    # Rounding branch (within bounds): round(720/28)=26 -> 728, round(1280/28)=46 -> 1288.
    assert smart_resize(720, 1280) == (728, 1288)
    # Downscale branch: beta = sqrt(1280*720 / 62720) = 3.833; floor(720/3.833/28)=6 -> 168, floor(1280/...)=11 -> 308.
    assert smart_resize(720, 1280, max_pixels=TINY_MAX_PIXELS) == (84, 140)
    assert smart_resize(720, 1280, max_pixels=28 * 28 * 80) == (168, 308)
    # Upscale branch: 10x10 -> beta = sqrt(3136/100) = 5.6; ceil(56/28)*28 = 56.
    assert smart_resize(10, 10) == (56, 56)


def test_smart_resize_matches_transformers_reference():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for h, w in [(1080, 1920), (720, 1280), (768, 1366), (1, 150), (3000, 200), (28, 28), (999, 1001)]:
        for max_pixels in (TINY_MAX_PIXELS, 28 * 28 * 1280, 2_116_800):
            assert smart_resize(h, w, max_pixels=max_pixels) == reference(h, w, max_pixels=max_pixels), (h, w)


def test_smart_resize_rejects_extreme_aspect_ratio():
    with pytest.raises(ModelInputError, match="aspect ratio"):
        smart_resize(10, 2500)
    with pytest.raises(ModelInputError):
        smart_resize(0, 100)


# ------------------------------------------------------------------ tiny checkpoint


def test_tiny_model_loads_with_auto_classes(model_dir):
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "qwen2_5_vl"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for token in QWEN_SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token) is not None
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.text_config.image_token_id == config.image_token_id
    processor = AutoImageProcessor.from_pretrained(model_dir)
    assert processor.merge_size == 2 and processor.patch_size == 14
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 <= n_params <= 2_000_000, n_params


def test_create_refuses_to_overwrite(model_dir):
    with pytest.raises(FileExistsError):
        create_tiny_model(model_dir)


def test_same_seed_same_checkpoint(tmp_path, model_dir):
    again = create_tiny_model(tmp_path / "again", seed=0)
    assert (again / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    from safetensors.torch import load_file

    a, b = load_file(str(again / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_std_sets_the_spread_of_the_random_weights(tmp_path, model_dir):
    from safetensors.torch import load_file

    narrow = load_file(str(create_tiny_model(tmp_path / "narrow", init_std=0.02) / "model.safetensors"))
    default = load_file(str(model_dir / "model.safetensors"))
    key = next(k for k in narrow if k.endswith("layers.0.self_attn.q_proj.weight") and "visual" not in k)
    assert abs(float(narrow[key].std()) - 0.02) < 0.002
    assert abs(float(default[key].std()) - 0.1) < 0.01  # DEFAULT_INIT_STD
    with pytest.raises(ValueError, match="init_std"):
        create_tiny_model(tmp_path / "bad", init_std=0.0)


def test_text_shape_keeps_the_original_tiny_shape_and_scales_heads():
    assert text_shape(64) == {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
                              "mrope_section": [2, 3, 3]}  # the shape every earlier tiny checkpoint has
    assert text_shape(256) == {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1024,
                               "mrope_section": [4, 6, 6]}  # 32-wide heads: 16 rotary pairs, 4 + 6 + 6
    for bad in (0, 32, 100):
        with pytest.raises(ValueError, match="multiple of 64"):
            text_shape(bad)


def test_hidden_size_gives_a_wider_policy_that_scores_tokens(tmp_path):
    wide = create_tiny_model(tmp_path / "w128", hidden_size=128)
    model, processor = load_policy(wide)
    text = model.config.text_config
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (128, 4, 2)
    enc = PromptEncoder(wide)
    ids = enc.encode([{"role": "user", "content": [{"type": "text", "text": "click"}, {"type": "image"}]}],
                     [(280, 280)])
    logprobs = token_logprobs(model, processor, ids, [_png((280, 280))], enc.tokenize("Thought: ok"))
    assert logprobs.shape == (len(enc.tokenize("Thought: ok")),) and bool((logprobs < 0).all())
    with pytest.raises(ValueError, match="multiple of 64"):
        create_tiny_model(tmp_path / "bad", hidden_size=96)
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_init_model_module_and_arpo_cli_share_one_parser(tmp_path):
    # `python -m arpo_async.model.init_model` is `arpo init-model`: same flags, same usage errors
    for module in ("arpo_async.model.init_model", "arpo_cli.cli init-model"):
        proc = subprocess.run([sys.executable, "-m", *module.split(), "--out", str(tmp_path / "m"),
                               "--hidden-size", "96"], capture_output=True, text=True)
        assert proc.returncode == 2 and "multiple of 64, got 96" in proc.stderr, (module, proc.stderr)
        assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------ PromptEncoder


MESSAGES = [
    {"role": "system", "content": "You are a GUI agent."},
    {"role": "user", "content": [{"type": "text", "text": "open the file menu"}, {"type": "image"}]},
    {"role": "assistant", "content": "Thought: click file\nAction: click(start_box='(10,20)')"},
    {"role": "user", "content": [{"type": "image"}]},
]


def test_encode_matches_hf_chat_template_with_expanded_pads(model_dir):
    from transformers import AutoTokenizer

    encoder = PromptEncoder(model_dir)
    sizes = [(1280, 720), (800, 600)]
    ids = encoder.encode(MESSAGES, sizes)
    hf = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(MESSAGES, add_generation_prompt=True)
    hf_ids = hf["input_ids"] if hasattr(hf, "keys") else hf
    expected: list[int] = []
    counts = iter([15, encoder.image_token_count(800, 600)])
    for t in hf_ids:
        expected.extend([t] * next(counts) if t == encoder.image_pad_id else [t])
    assert ids == expected
    assert ids.count(encoder.image_pad_id) == 15 + encoder.image_token_count(800, 600)
    assert encoder.decode(ids, skip_special_tokens=False).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_image_token_count_agrees_with_image_processor(model_dir):
    encoder = PromptEncoder(model_dir)
    _, image_processor = load_policy(model_dir)
    for size in [(1280, 720), (1920, 1080), (640, 480), (333, 777)]:
        grid = pixel_inputs(image_processor, [_png(size)])["image_grid_thw"][0]
        assert int(grid.prod()) // 4 == encoder.image_token_count(*size)
        w, h = encoder.resized_size(*size)
        assert (int(grid[1]) * 14, int(grid[2]) * 14) == (h, w)
    assert encoder.image_token_count(1280, 720) == 15  # 6 x 10 patches / 4


def test_encode_rejects_placeholder_count_mismatch(model_dir):
    encoder = PromptEncoder(model_dir)
    with pytest.raises(ModelInputError, match="2 image placeholders but 1 images"):
        encoder.encode(MESSAGES, [(1280, 720)])


def test_encoder_path_does_not_import_torch(model_dir):
    code = (
        "import sys\n"
        "from arpo_async.model.inputs import PromptEncoder\n"
        f"e = PromptEncoder({str(model_dir)!r})\n"
        "e.encode([{'role': 'user', 'content': [{'type': 'image'}]}], [(1280, 720)])\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)


# ------------------------------------------------------------------ token_logprobs


def test_token_logprobs_match_transformers_forward_and_are_differentiable(model_dir):
    model, image_processor = load_policy(model_dir)
    encoder = PromptEncoder(model_dir)
    images = [_png((1280, 720)), _png((800, 600), (0, 90, 200))]
    prompt = encoder.encode(MESSAGES, [(1280, 720), (800, 600)])
    completion = encoder.tokenize("Thought: wait\nAction: wait()<|im_end|>")

    lp = token_logprobs(model, image_processor, prompt, images, completion)
    assert lp.shape == (len(completion),) and lp.dtype == torch.float32
    assert torch.all(lp < 0)

    # Reference: transformers' own position handling (mm_token_type_ids path), no explicit positions.
    pixels = pixel_inputs(image_processor, images)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                       **pixels).logits[0]
    reference = torch.log_softmax(logits[len(prompt) - 1: -1], -1).gather(-1, torch.tensor(completion)[:, None])
    assert torch.allclose(lp.detach(), reference.squeeze(-1), atol=1e-5)

    lp.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_token_logprobs_rejects_missing_images(model_dir):
    model, image_processor = load_policy(model_dir)
    encoder = PromptEncoder(model_dir)
    prompt = encoder.encode(MESSAGES, [(1280, 720), (800, 600)])
    with pytest.raises(ModelInputError, match="image pad tokens"):
        token_logprobs(model, image_processor, prompt, [_png((1280, 720))], [1, 2])
