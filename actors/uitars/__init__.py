"""The UI-TARS action language: the prompt the policy sees (arpo_async.prompt, shared with the learner), the parser
of its replies, the commands that perform its actions in a desktop, and a regex that constrains decoding to
parseable replies."""

from actors.uitars.actions import (
    Action,
    ActionParseError,
    Parsed,
    Size,
    parse_reply,
    smart_resize,
)
from actors.uitars.grammar import action_regex
from arpo_async.prompt import Prompt, add_box_tokens, build_messages
from actors.uitars.pyautogui import to_pyautogui
from actors.uitars.xdotool import UnsupportedActionError, to_commands

__all__ = [
    "Action", "ActionParseError", "Parsed", "Prompt", "Size", "UnsupportedActionError", "action_regex",
    "add_box_tokens", "build_messages", "parse_reply", "smart_resize", "to_commands", "to_pyautogui",
]
