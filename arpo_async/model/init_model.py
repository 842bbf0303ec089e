"""Create a tiny random policy of the Qwen2.5-VL architecture, offline.

Role: the embedded default policy for CPU runs and tests (no model hub is reachable). It writes a complete
Hugging Face checkpoint folder that transformers' Auto classes load and that `arpo-serve` and the trainer use
exactly like a real UI-TARS-1.5 / Qwen2.5-VL checkpoint:

- ``config.json`` + ``model.safetensors``: ``Qwen2_5_VLForConditionalGeneration`` with random weights
  (3 text layers, hidden 64 by default, ``hidden_size`` to change it; 2 vision blocks, hidden 64; about 0.5 M
  parameters at width 64);
- ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE tokenizer trained with ``tokenizers`` on a
  generated corpus of UI-TARS replies, instruction words and digits, with Qwen's special tokens and
  Qwen2-VL's chat template;
- ``preprocessor_config.json``: ``Qwen2VLImageProcessor`` (patch 14, merge 2, temporal patch 2) with a small
  ``max_pixels`` (28*28*16 by default) so a 1280x720 screenshot becomes 15 image tokens (140x84 pixels: still
  enough to tell a 2x2 or 2x4 grid's buttons apart, and a short prompt; ``max_pixels`` to change it);
- ``generation_config.json`` with both end tokens (<|im_end|>, <|endoftext|>).

Invariant: the same seed gives the same tokenizer and the same weights.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

from arpo_async.model.instructions import corpus_lines

# Qwen2 / Qwen2-VL special tokens, in Qwen's order (tokenizer_config.json of Qwen2-VL-7B-Instruct).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL-7B-Instruct's chat template (tokenizer_config.json / chat_template.json of Qwen/Qwen2-VL-7B-Instruct).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenizer split pattern (tokenizer.json of Qwen/Qwen2-VL-7B-Instruct): digits one by one.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TINY_MAX_PIXELS = 28 * 28 * 16
"""max_pixels of the tiny model's image processor: a 1280x720 screenshot -> 140x84 -> 15 image tokens (28*28*80,
the earlier default, gives 308x168 and 66 tokens)."""
TINY_MIN_PIXELS = 56 * 56
TINY_VOCAB_SIZE = 1280
"""Upper bound of the BPE vocabulary (the generated corpus yields about 1,000 tokens)."""
# OpenAI CLIP normalisation, as in Qwen2-VL's preprocessor_config.json.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_WORDS = (
    "open the file menu and click save button in window dialog settings close tab search type text enter "
    "name folder desktop terminal browser chrome address bar new document select all copy paste delete "
    "scroll down up left right wait finished done task complete drag icon double right click hotkey ctrl "
    "shift alt start box end content key direction thought action screen app editor cell sheet slide write "
    "i need to first then next now see should will is a an of for on with this that it my calculator "
    "total ok cancel apply yes no file edit view help tools format insert run play stop volume mail send"
).split()
_ACTIONS = (
    "click(start_box='<|box_start|>({x},{y})<|box_end|>')",
    "click(start_box='({x},{y})')",
    "left_double(start_box='({x},{y})')",
    "right_single(start_box='({x},{y})')",
    "drag(start_box='({x},{y})', end_box='({x2},{y2})')",
    "hotkey(key='ctrl {w}')",
    "type(content='{w} {w2}')",
    "scroll(start_box='({x},{y})', direction='down')",
    "scroll(start_box='({x},{y})', direction='up')",
    "wait()",
    "finished(content='{w}')",
    "call_user()",
)


def _corpus(rng: random.Random, n_lines: int = 3000) -> list[str]:
    """Generated training text for the tiny tokenizer: UI-TARS replies, instructions, digits, target names."""
    lines = []
    for _ in range(n_lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 9)))
        action = rng.choice(_ACTIONS).format(
            x=rng.randint(0, 1920), y=rng.randint(0, 1080), x2=rng.randint(0, 1920), y2=rng.randint(0, 1080),
            w=rng.choice(_WORDS), w2=rng.choice(_WORDS),
        )
        lines.append(f"Thought: {words}\nAction: {action}")
        lines.append(f"Please {words}. " + " ".join(str(rng.randint(0, 9999)) for _ in range(3)))
    lines.append("You are a helpful assistant. You are a GUI agent. ## Output Format ## Action Space ## User Instruction")
    # Instructions naming one target, and their thoughts, so that task labels such as "Green" are whole tokens,
    # as in a real tokenizer.
    return lines + corpus_lines()


def _train_tokenizer(seed: int):
    """Train the byte-level BPE tokenizer; returns a transformers PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(QWEN_SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    # Special tokens go after the learned vocabulary, as in Qwen's tokenizer.
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


DEFAULT_INIT_STD = 0.1
"""Standard deviation of the random weights (``initializer_range``; transformers' Qwen2.5-VL default is 0.02). At
0.02 the instruction moved the coordinate logits by 3.4e-4 against a 0.13 spread and RL stayed at chance; 0.1 lets
the instruction matter from the first step (issue 12; `git log -p bench/README.md`)."""
DEFAULT_HIDDEN_SIZE = 64
"""Width of the tiny policy's text model (and of the vision merger's output)."""


def text_shape(hidden_size: int) -> dict:
    """Attention heads, MLP width and M-RoPE sections for a text model ``hidden_size`` wide.

    Heads are 16 wide at 64 (the original tiny shape) and 32 wide from 128 up; key/value heads are half the heads
    (grouped-query attention, as in Qwen2.5-VL); the MLP is 4x wide; ``mrope_section`` splits the rotary half of a
    head in Qwen2.5-VL's 1:1.5:1.5 ratio (temporal, height, width; [16, 24, 24] for its 128-wide heads).
    Raises:
        ValueError: ``hidden_size`` is not a positive multiple of 64.
    """
    if hidden_size < 64 or hidden_size % 64:
        raise ValueError(f"hidden_size must be a positive multiple of 64, got {hidden_size}")
    heads = max(4, hidden_size // 32)
    half = hidden_size // heads // 2
    return {"num_attention_heads": heads, "num_key_value_heads": heads // 2, "intermediate_size": 4 * hidden_size,
            "mrope_section": [half // 4, 3 * half // 8, 3 * half // 8]}


def _model_config(tokenizer, init_std: float = DEFAULT_INIT_STD, hidden_size: int = DEFAULT_HIDDEN_SIZE):
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    vocab_size = len(tokenizer)
    shape = text_shape(hidden_size)
    special = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=3,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": shape["mrope_section"]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
        initializer_range=init_std,
        **special,
    )
    vision_config = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=hidden_size,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config, tie_word_embeddings=True,
        initializer_range=init_std, **special
    )


def _preprocessor_config(max_pixels: int = TINY_MAX_PIXELS) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "resample": 3,
        "min_pixels": TINY_MIN_PIXELS,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def create_tiny_model(out_dir: Path, *, seed: int = 0, overwrite: bool = False,
                      init_std: float = DEFAULT_INIT_STD, hidden_size: int = DEFAULT_HIDDEN_SIZE,
                      max_pixels: int = TINY_MAX_PIXELS) -> Path:
    """Write a tiny random Qwen2.5-VL checkpoint (weights, tokenizer, chat template, image processor).

    Args:
        out_dir: folder to create; it must not exist (or be empty) unless ``overwrite``.
        seed: seeds the tokenizer corpus and the weight initialisation.
        overwrite: replace an existing folder.
        init_std: standard deviation of the random text-model weights (``initializer_range``, default 0.1).
            With transformers' 0.02 the tiny model's attention starts almost uniform, the instruction barely
            moves its replies, and RL on grid4 stayed at chance (`DEFAULT_INIT_STD`).
        hidden_size: width of the text model, a multiple of 64 (`text_shape` gives the heads and MLP). 64 is the
            default; 256 (about 3 M parameters) runs ~2x slower per token and, by a supervised-fitting probe
            (`git log -p bench/README.md`), fits the four grid4 replies in about as many supervised steps (140 vs 120): width is not what limits the
            tiny policy's learning there.
        max_pixels: the image processor's largest image area in pixels (a multiple of 28*28 is natural; default
            28*28*16: 15 image tokens for a 1280x720 screenshot).
    Returns:
        ``out_dir`` as a Path.
    Raises:
        FileExistsError: ``out_dir`` exists, is not empty and ``overwrite`` is false.
        ValueError: ``init_std`` <= 0, ``hidden_size`` not a positive multiple of 64, or ``max_pixels`` below
            the image processor's min_pixels (56*56).
    """
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    if max_pixels < TINY_MIN_PIXELS:
        raise ValueError(f"max_pixels must be >= {TINY_MIN_PIXELS}, got {max_pixels}")
    text_shape(hidden_size)  # raises before anything is written
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True to replace it)")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(seed)
    config = _model_config(tokenizer, init_std, hidden_size)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        do_sample=True,
        temperature=1.0,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Older transformers read the template from tokenizer_config.json; newer ones also from chat_template.jinja.
    tk_cfg_path = out_dir / "tokenizer_config.json"
    tk_cfg = json.loads(tk_cfg_path.read_text())
    tk_cfg["chat_template"] = QWEN2_VL_CHAT_TEMPLATE
    tk_cfg_path.write_text(json.dumps(tk_cfg, indent=2))
    (out_dir / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(max_pixels), indent=2))
    return out_dir


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags of ``arpo init-model`` (``--out --seed --force --init-std --max-pixels --hidden-size``) to
    ``parser`` and return it. One definition for both commands that create the tiny model: ``arpo init-model``
    (arpo_cli.cli, a subparser) and ``python -m arpo_async.model.init_model`` (`main` below)."""
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokenizer corpus and the weights")
    parser.add_argument("--force", action="store_true", help="overwrite an existing folder")
    parser.add_argument("--init-std", type=float, default=DEFAULT_INIT_STD,
                        help="standard deviation of the random weights (initializer_range; "
                             f"default {DEFAULT_INIT_STD})")
    parser.add_argument("--max-pixels", type=int, default=TINY_MAX_PIXELS,
                        help=f"largest image area the image processor keeps, in pixels (default {TINY_MAX_PIXELS}: "
                             "15 image tokens for a 1280x720 screenshot)")
    parser.add_argument("--hidden-size", type=int, default=DEFAULT_HIDDEN_SIZE,
                        help=f"width of the text model, a multiple of 64 (default {DEFAULT_HIDDEN_SIZE})")
    return parser


def run_from_args(args: argparse.Namespace, prog: str = "arpo init-model") -> int:
    """Create the model the parsed flags of `add_arguments` describe and print its folder. Returns the exit code:
    0 done, 2 refused (the folder exists without ``--force``, or a bad ``--hidden-size``; the reason goes to
    stderr prefixed with ``prog``)."""
    try:
        path = create_tiny_model(args.out, seed=args.seed, overwrite=args.force, init_std=args.init_std,
                                 hidden_size=args.hidden_size, max_pixels=args.max_pixels)
    except FileExistsError:  # the library's message names its argument; this one the flag
        print(f"{prog}: {args.out} exists and is not empty; add --force to replace it", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m arpo_async.model.init_model ARGS`` is ``arpo init-model ARGS``: the same flags (`add_arguments`)
    and the same handling (`run_from_args`)."""
    parser = add_arguments(argparse.ArgumentParser(prog="python -m arpo_async.model.init_model",
                                                   description="create a tiny random Qwen2.5-VL policy offline"))
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
