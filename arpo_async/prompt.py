"""The UI-TARS-1.5 computer-use prompt, laid out as ARPO and UI-TARS do, as Hugging Face chat messages.

Role: turn (instruction, past replies) into the chat the policy sees; the caller renders it with the tokenizer's
chat template and sends the screenshots this module names, in order, as ``image_data``. The actors build every
step's prompt with it (actors.episode); the learner rebuilds the prompts of demonstrations with it
(arpo_async.demos), so both sides see one layout.

Layout (dvlab-research/ARPO ``verl/trainer/gui_agent.py``, ``EnvWorker.reset``/``step``)::

    system     "Your are a helpful assistant."            (ARPO's string, typo included: it is what the
                                                           ARPO checkpoint was trained with)
    user       action-space prompt with the instruction
    user       <image: screenshot 0>
    assistant  reply 0                                    (box tokens re-added, UI-TARS ``add_box_token``)
    user       <image: screenshot 1>
    assistant  reply 1
    ...
    user       <image: current screenshot>

Prompt styles (``build_messages(style=...)``): ``"uitars"`` is the layout above, for real UI-TARS / Qwen2.5-VL
checkpoints, which were trained with it. ``"compact"`` is for small policies trained from scratch (the embedded
tiny policy): the system turn is ``COMPACT_SYSTEM``, then the screenshots and replies as above, and the bare
instruction last, in the current screenshot's user turn, right before the reply; the action space is not described
(the constrained-decoding grammar enforces it). With 15 image tokens the first step's prompt is 52 tokens instead
of about 600 (UI-TARS prompt, same screenshot), so the instruction is a large share of what the policy attends to
(issue 12: with the 653-token prompt only 0.1% of a GRPO update was specific to the instruction, and grid4 stayed
at chance). Placing the instruction after the screenshot rather than before it took the tiny policy on the grid4
family from 0.49 to 0.73 success in 100 optimizer steps (probe_learning.py; in the history of bench/README.md).

Image window: ARPO keeps every screenshot (15-step episodes, <= 15 images). OSWorld's UI-TARS-1.5 agent
(``mm_agents/uitars15_v1.py``, ``history_n=5``) keeps only the last k screenshots *counting the current one*;
older steps keep their assistant reply but lose their user image turn, so their replies follow each other
directly. ``build_messages`` does the same with ``history_images=k``; ``k >= steps + 1`` is ARPO's layout.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Sequence

ARPO_SYSTEM = "Your are a helpful assistant."
"""ARPO's system turn, verbatim (the typo is ARPO's; changing it shifts the prompt away from training)."""

ARPO_HISTORY_IMAGES = 15
"""ARPO keeps every screenshot of its 15-step episodes."""
OSWORLD_HISTORY_IMAGES = 5
"""OSWorld's UI-TARS-1.5 agent keeps the last 5 screenshots."""
PROMPT_STYLES = ("uitars", "compact")
"""``build_messages`` styles: UI-TARS's own prompt, or the compact one for small policies (module docstring)."""
COMPACT_SYSTEM = "GUI agent."
"""System turn of the compact style (short: the Qwen chat template would otherwise add its 5-word default)."""

# The UI-TARS computer-use action space as ARPO prompts it (box-token coordinates, absolute pixels of the
# resized screenshot). ``{call_user}`` adds UI-TARS's optional call_user() line.
_PROMPT = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
```
Thought: ...
Action: ...
```

## Action Space

click(start_box='<|box_start|>(x1,y1)<|box_end|>')
left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')
right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')
drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')
hotkey(key='')
type(content='xxx') # Use escape characters \\', \\\", and \\n in content part to ensure we can parse the content in normal python string format. If you want to submit your input, use \\n at the end of content. 
scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left')
wait() #Sleep for 5s and take a screenshot to check for any changes.
finished(content='xxx') # Use escape characters \\', \\", and \\n in content part to ensure we can parse the content in normal python string format.
{call_user}
## Note
- Use {language} in `Thought` and `Action` part.
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part.

## User Instruction
{instruction}
"""
_CALL_USER = ("call_user() # Submit the task and call the user when the task is unsolvable, "
              "or when you need the user's help.\n")


class Prompt(NamedTuple):
    """Chat messages plus the screenshots they show.

    Attributes:
        messages: HF chat-format messages (``{"role", "content": [{"type": "text", "text"} | {"type": "image"}]}``).
        image_indices: indices into the episode's screenshot list (0 = the first screenshot, ``len(replies)`` =
            the current one), one per ``{"type": "image"}`` entry, in message order. Send exactly these
            screenshots, in this order, as ``image_data``.
    """

    messages: list[dict]
    image_indices: list[int]


def action_space_prompt(instruction: str, *, language: str = "English", call_user: bool = False) -> str:
    """The user-turn text: UI-TARS's action space as ARPO writes it, ending with the task instruction.

    Args:
        instruction: the task, in natural language.
        language: the language the model should think in (``Use {language} in Thought and Action part``).
        call_user: add UI-TARS's ``call_user()`` line (parsed as FAIL); ARPO's prompt leaves it out.
    """
    return _PROMPT.format(instruction=instruction, language=language,
                          call_user=_CALL_USER if call_user else "")


def build_messages(instruction: str, replies: Sequence[str], *, history_images: int = ARPO_HISTORY_IMAGES,
                   language: str = "English", call_user: bool = False, system: str | None = None,
                   style: str = "uitars") -> Prompt:
    """Build the chat for the next step of an episode.

    Args:
        instruction: the task instruction.
        replies: the policy's previous replies, oldest first; reply i was produced after seeing screenshot i.
            The episode has ``len(replies) + 1`` screenshots so far (the last is the current one).
        history_images: k >= 1, how many screenshots to show, counting the current one: screenshots
            ``len(replies)+1-k .. len(replies)``. Older steps keep their reply text only (OSWorld's UI-TARS
            agent); ``ARPO_HISTORY_IMAGES`` (15) shows all of a 15-step episode, as ARPO does.
        language, call_user: see ``action_space_prompt`` (``"uitars"`` style only).
        system: the system turn text; None = the style's own (``ARPO_SYSTEM`` or ``COMPACT_SYSTEM``).
        style: ``"uitars"`` (the UI-TARS action-space prompt) or ``"compact"`` (the bare instruction); see the
            module docstring.
    Returns:
        Prompt(messages, image_indices); messages end with the current screenshot's user turn, ready for
        ``apply_chat_template(..., add_generation_prompt=True)``.
    Raises:
        ValueError: history_images < 1, or an unknown style.
    """
    if history_images < 1:
        raise ValueError(f"history_images must be >= 1 (the current screenshot), got {history_images}")
    if style not in PROMPT_STYLES:
        raise ValueError(f"style must be one of {PROMPT_STYLES}, got {style!r}")
    if style == "compact":
        system, task_text = COMPACT_SYSTEM if system is None else system, instruction
    else:
        system = ARPO_SYSTEM if system is None else system
        task_text = action_space_prompt(instruction, language=language, call_user=call_user)
    n_shots = len(replies) + 1
    first_shown = max(0, n_shots - history_images)
    messages: list[dict] = [{"role": "system", "content": [{"type": "text", "text": system}]}]
    if style == "uitars":
        messages.append({"role": "user", "content": [{"type": "text", "text": task_text}]})
    shown: list[int] = []
    for i in range(n_shots):
        if i >= first_shown:
            messages.append({"role": "user", "content": [{"type": "image"}]})
            shown.append(i)
        if i < len(replies):
            messages.append({"role": "assistant", "content": [{"type": "text", "text": add_box_tokens(replies[i])}]})
    if style == "compact":  # the instruction right before the reply, after the current screenshot
        messages[-1]["content"].append({"type": "text", "text": task_text})
    return Prompt(messages, shown)


_BOXED = re.compile(r"(start_box|end_box)='\((\d+),\s*(\d+)\)'")


def add_box_tokens(reply: str) -> str:
    """Wrap bare ``start_box='(x,y)'`` / ``end_box='(x,y)'`` points in ``<|box_start|>``/``<|box_end|>``.

    UI-TARS and ARPO do this to each past reply before putting it back in the prompt, because the box tokens
    are special tokens that decoding usually drops (source: UI-TARS ``action_parser.add_box_token``).
    Replies that already carry box tokens are unchanged.
    """
    return _BOXED.sub(lambda m: f"{m.group(1)}='<|box_start|>({m.group(2)},{m.group(3)})<|box_end|>'", reply)
