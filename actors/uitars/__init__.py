"""The UI-TARS action language: the prompt the policy sees, the parser of its replies, the commands that
perform its actions in a desktop, and a regex that constrains decoding to parseable replies."""

from actors.uitars.actions import (
    Action,
    ActionParseError,
    Parsed,
    Size,
    add_box_tokens,
    parse_reply,
    smart_resize,
)
from actors.uitars.grammar import action_regex
from actors.uitars.prompt import Prompt, build_messages
from actors.uitars.pyautogui import to_pyautogui
from actors.uitars.xdotool import UnsupportedActionError, to_commands

__all__ = [
    "Action", "ActionParseError", "Parsed", "Prompt", "Size", "UnsupportedActionError", "action_regex",
    "add_box_tokens", "build_messages", "parse_reply", "smart_resize", "to_commands", "to_pyautogui",
]
