"""UI-TARS action language: parser (hand-computed mappings), constrained-decoding regex, xdotool/pyautogui
translation, prompt layout."""

from __future__ import annotations

import random
import re

import pytest

from actors.uitars import (
    Action,
    ActionParseError,
    action_regex,
    add_box_tokens,
    build_messages,
    parse_reply,
    smart_resize,
    to_commands,
    to_pyautogui,
)
from actors.uitars.grammar import DEFAULT_ACTIONS, int_range_regex
from arpo_async.prompt import ARPO_SYSTEM, COMPACT_SYSTEM, action_space_prompt
from actors.uitars.xdotool import UnsupportedActionError

# ARPO's setting: a 1920x1080 screen, smart-resized to 1932x1092 (arXiv 2505.16282; max_pixels 2,116,800).
SCREEN = (1920, 1080)
RESIZED = (1932, 1092)


def parse(text: str, mode: str = "absolute"):
    return parse_reply(text, resized_size=RESIZED, screen_size=SCREEN, coordinate_mode=mode)


def approx(xy: tuple[float, float]) -> tuple:
    return pytest.approx(xy, abs=1e-9)


# ------------------------------------------------------------------------------------------------ smart_resize

@pytest.mark.parametrize("size, kwargs, expected", [
    ((1920, 1080), {}, (1932, 1092)),                              # ARPO: 69x39 patches of 28
    ((1920, 1080), {"max_pixels": 16384 * 28 * 28}, (1932, 1092)),  # UI-TARS parser's max_pixels: same
    ((1280, 720), {"max_pixels": 28 * 28 * 80}, (308, 168)),        # tiny model: sqrt(921600/62720)=3.833
    ((1280, 720), {}, (1288, 728)),
    ((10, 10), {}, (56, 56)),                                       # below min_pixels: scaled up
])
def test_smart_resize(size, kwargs, expected):
    assert smart_resize(width=size[0], height=size[1], **kwargs) == expected


def test_smart_resize_rejects_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        smart_resize(width=0, height=10)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(width=10_000, height=10)


# ------------------------------------------------------------------------------------------------ parser

def test_click_box_tokens_maps_centre_of_resized_to_centre_of_screen():
    # 966 * 1920 / 1932 = 960; 546 * 1080 / 1092 = 540
    p = parse("Thought: Click the OK button.\nAction: click(start_box='<|box_start|>(966,546)<|box_end|>')")
    assert p.thought == "Click the OK button."
    assert p.action == Action("click", point=(960.0, 540.0))
    assert len(p.actions) == 1


@pytest.mark.parametrize("value, expected", [
    ("(483,273)", (480.0, 270.0)),                                  # 483*1920/1932, 273*1080/1092
    ("( 483 , 273 )", (480.0, 270.0)),
    ("[483, 273]", (480.0, 270.0)),
    ("[0, 0, 966, 546]", (480.0, 270.0)),                            # box -> centre (483, 273)
    ("(0,0,966,546)", (480.0, 270.0)),
    ("<point>483 273</point>", (480.0, 270.0)),
    ("<bbox>0 0 966 546</bbox>", (480.0, 270.0)),
    ("<|box_start|>(1449,819)<|box_end|>", (1440.0, 810.0)),
    ("(483.0,273.0)", (480.0, 270.0)),
])
def test_point_formats(value, expected):
    assert parse(f"Thought: t\nAction: click(start_box='{value}')").action.point == approx(expected)


def test_point_keyword_variants():
    assert parse("Action: click(point='<point>483 273</point>')").action.point == approx((480.0, 270.0))
    a = parse("Action: drag(start_point='<point>483 273</point>', end_point='<point>1449 819</point>')").action
    assert (a.kind, a.point, a.end_point) == ("drag", approx((480.0, 270.0)), approx((1440.0, 810.0)))


def test_relative1000_mode():
    # Qwen2-VL-era: x / 1000 * 1920, y / 1000 * 1080
    a = parse("Action: click(start_box='(250,500)')", mode="relative1000").action
    assert a.point == approx((480.0, 540.0))


def test_points_are_clamped_to_the_screen():
    assert parse("Action: click(start_box='(9999,9999)')").action.point == (1919.0, 1079.0)
    assert parse("Action: click(start_box='(-5,10)')").action.point[0] == 0.0


def test_non_square_resize_uses_each_axis():
    # 1280x720 screen seen at 308x168 (tiny model): x*1280/308, y*720/168
    a = parse_reply("Action: click(start_box='(77,42)')", resized_size=(308, 168), screen_size=(1280, 720)).action
    assert a.point == approx((320.0, 180.0))


def test_every_action_kind():
    cases = {
        "click(start_box='(966,546)')": Action("click", point=(960.0, 540.0)),
        "left_single(start_box='(966,546)')": Action("click", point=(960.0, 540.0)),
        "left_double(start_box='(966,546)')": Action("left_double", point=(960.0, 540.0)),
        "right_single(start_box='(966,546)')": Action("right_single", point=(960.0, 540.0)),
        "hover(start_box='(966,546)')": Action("hover", point=(960.0, 540.0)),
        "drag(start_box='(0,0)', end_box='(966,546)')": Action("drag", point=(0.0, 0.0), end_point=(960.0, 540.0)),
        "select(start_box='(0,0)', end_box='(966,546)')": Action("drag", point=(0.0, 0.0), end_point=(960.0, 540.0)),
        "hotkey(key='ctrl c')": Action("hotkey", key="ctrl c"),
        "hotkey(key='Ctrl+Shift+T')": Action("hotkey", key="ctrl shift t"),
        "hotkey(key='arrowdown')": Action("hotkey", key="down"),
        "hotkey(key='Return')": Action("hotkey", key="enter"),
        "hotkey(key='ctrl +')": Action("hotkey", key="ctrl +"),
        "press(key='f5')": Action("hotkey", key="f5"),
        "keydown(key='shift')": Action("key_down", key="shift"),
        "keyup(key='shift')": Action("key_up", key="shift"),
        "type(content='hello world')": Action("type", text="hello world"),
        "scroll(start_box='(966,546)', direction='down')": Action("scroll", point=(960.0, 540.0), direction="down"),
        "scroll(direction='Left')": Action("scroll", direction="left"),
        "wait()": Action("wait"),
        "finished(content='The answer is 42')": Action("finished", text="The answer is 42"),
        "finished()": Action("finished", text=""),
        "call_user()": Action("fail"),
    }
    for call, expected in cases.items():
        assert parse(f"Thought: t\nAction: {call}").action == expected, call


def test_type_escapes_and_submit():
    a = parse("Thought: t\nAction: type(content='it\\'s \\\"ok\\\"\\n')").action
    assert a.text == "it's \"ok\"\n" and a.submits
    # a real newline at the end works too, and an unescaped inner quote is kept (UI-TARS tolerates it)
    assert parse("Action: type(content='abc\n')").action.submits
    assert parse("Action: type(content='don't')").action.text == "don't"
    assert not parse("Action: type(content='abc')").action.submits


def test_end_tokens_and_summary_variant():
    p = parse("Action_Summary: open it\nAction: wait()<|im_end|>")
    assert (p.thought, p.action.kind) == ("open it", "wait")
    assert parse("Thought: a\n\nb\nAction: wait()").thought == "a\n\nb"


def test_several_actions_and_the_control_action_rule():
    p = parse("Thought: t\nAction: click(start_box='(966,546)')\n\ntype(content='x')")
    assert [a.kind for a in p.actions] == ["click", "type"]
    # ARPO: finished / wait / call_user replace the whole list
    p = parse("Thought: t\nAction: click(start_box='(966,546)')\n\nfinished(content='done')")
    assert [a.kind for a in p.actions] == ["finished"]


@pytest.mark.parametrize("reply, message", [
    ("Thought: I will click", "no 'Action:'"),
    ("Thought: t\nAction: ", "empty 'Action:'"),
    ("Thought: t\nAction: launch(app='x')", "unknown action 'launch'"),
    ("Thought: t\nAction: click()", "needs a start point"),
    ("Thought: t\nAction: click(start_box='')", "needs a start point"),
    ("Thought: t\nAction: click(start_box='(12)')", "is not a point"),
    ("Thought: t\nAction: click(start_box='(a,b)')", "is not a point"),
    ("Thought: t\nAction: drag(start_box='(1,2)')", "needs an end point"),
    ("Thought: t\nAction: click(start_box='(1,2)', button='left')", "takes no argument 'button'"),
    ("Thought: t\nAction: click(start_box='(1,2)', point='(3,4)')", "'start' twice"),
    ("Thought: t\nAction: scroll(start_box='(1,2)', direction='down or up')", "scroll direction"),
    ("Thought: t\nAction: hotkey(key='ctrl banana')", "unknown key 'banana'"),
    ("Thought: t\nAction: hotkey(key='')", "non-empty key"),
    ("Thought: t\nAction: type()", "needs content"),
    ("Thought: t\nAction: click(start_box='(1,2)'", "not a call"),
    ("Thought: t\nAction: click(start_box=(1,2))", "cannot read the arguments"),
])
def test_malformed_replies_raise_with_a_useful_message(reply, message):
    with pytest.raises(ActionParseError, match=re.escape(message)):
        parse(reply)


def test_bad_sizes_or_mode_are_caller_errors_not_parse_errors():
    with pytest.raises(ValueError, match="coordinate_mode"):
        parse_reply("Action: wait()", resized_size=RESIZED, screen_size=SCREEN, coordinate_mode="pixels")
    with pytest.raises(ValueError, match="positive"):
        parse_reply("Action: wait()", resized_size=(0, 10), screen_size=SCREEN)


def test_add_box_tokens():
    assert add_box_tokens("Action: drag(start_box='(1,2)', end_box='(3, 4)')") == (
        "Action: drag(start_box='<|box_start|>(1,2)<|box_end|>', end_box='<|box_start|>(3,4)<|box_end|>')")
    boxed = "Action: click(start_box='<|box_start|>(1,2)<|box_end|>')"
    assert add_box_tokens(boxed) == boxed


# ------------------------------------------------------------------------------------------------ regex

def _sample(pattern: str, rng: random.Random) -> str:
    """A random string of the language of ``pattern`` (literals, classes, bounded repeats, groups, branches),
    drawn from the regex's own parse tree (Python's re parser), so it covers what the regex allows."""
    from re import _constants as c
    from re import _parser

    def gen(sub, out):
        for op, av in sub:
            if op is c.LITERAL:
                out.append(chr(av))
            elif op is c.IN:
                chars = []
                for kind, val in av:
                    if kind is c.LITERAL:
                        chars.append(chr(val))
                    elif kind is c.RANGE:
                        chars += [chr(x) for x in range(val[0], val[1] + 1)]
                    else:
                        raise NotImplementedError(kind)
                out.append(rng.choice(chars))
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT):
                lo, hi, item = av
                hi = lo + 30 if hi is c.MAXREPEAT else hi
                n = rng.choice([lo, hi, rng.randint(lo, hi)])  # extremes are where bugs live
                for _ in range(n):
                    gen(item, out)
            elif op is c.SUBPATTERN:
                gen(av[-1], out)
            elif op is c.BRANCH:
                gen(rng.choice(av[1]), out)
            else:
                raise NotImplementedError(op)

    out: list[str] = []
    gen(_parser.parse(pattern), out)
    return "".join(out)


@pytest.mark.parametrize("kwargs", [
    {},
    {"max_thought_chars": 3, "max_coord_digits": 1, "max_text_chars": 1},
    {"actions": DEFAULT_ACTIONS + ("call_user",)},
    {"max_x": 1931, "max_y": 1091},
    {"max_x": 999, "max_y": 999, "fixed_width": True},
])
def test_every_string_matching_the_regex_parses(kwargs):
    regex = action_regex(**kwargs)
    compiled = re.compile(regex)
    rng = random.Random(1234)
    kinds = set()
    for _ in range(600):
        s = _sample(regex, rng)
        assert compiled.fullmatch(s), s
        for mode in ("absolute", "relative1000"):
            parsed = parse_reply(s, resized_size=RESIZED, screen_size=SCREEN, coordinate_mode=mode)
            for a in parsed.actions:
                kinds.add(a.kind)
                if a.kind not in ("wait", "finished", "fail"):
                    assert to_commands(a)  # executable too
    expected = {"click", "left_double", "right_single", "drag", "hotkey", "type", "scroll", "wait", "finished"}
    if "actions" in kwargs:
        expected.add("fail")
    assert kinds == expected  # the sampler reached every alternative


@pytest.mark.parametrize("n", [0, 7, 9, 10, 19, 20, 99, 100, 109, 110, 167, 307, 999, 1000, 1091, 1931, 9999])
def test_int_range_regex_matches_exactly_zero_to_n(n):
    r = re.compile(int_range_regex(n))
    assert [i for i in range(n + 1200) if r.fullmatch(str(i))] == list(range(n + 1))
    assert not any(r.fullmatch(s) for s in ("00", "01", "-1", "", "1.0"))
    with pytest.raises(ValueError):
        int_range_regex(-1)


@pytest.mark.parametrize("n", [0, 7, 9, 10, 99, 100, 139, 307, 999, 1091])
def test_fixed_width_int_range_regex_matches_exactly_the_zero_padded_integers(n):
    width = len(str(n))
    r = re.compile(int_range_regex(n, fixed_width=True))
    candidates = [f"{i:0{k}d}" for k in range(1, width + 2) for i in range(min(10**k, 20000))]
    assert sorted(c for c in candidates if r.fullmatch(c)) == [f"{i:0{width}d}" for i in range(n + 1)]


def test_fixed_width_coordinates_need_bounds_and_parse_with_leading_zeros():
    with pytest.raises(ValueError, match="fixed_width"):
        action_regex(fixed_width=True)
    regex = re.compile(action_regex(max_x=999, max_y=999, fixed_width=True, actions=("click",)))
    reply = "Thought: go\nAction: click(start_box='(045,007)')"
    assert regex.fullmatch(reply) and not regex.fullmatch(reply.replace("045", "45"))
    action = parse_reply(reply, resized_size=RESIZED, screen_size=(1000, 1000), coordinate_mode="relative1000").action
    assert action.point == (45, 7)


def test_regex_with_bounds_keeps_points_on_the_resized_image():
    regex = action_regex(max_x=307, max_y=167, actions=("click", "drag", "scroll"))
    rng = random.Random(3)
    for _ in range(300):
        s = _sample(regex, rng)
        for x, y in re.findall(r"\((\d+),(\d+)\)", s):
            assert int(x) <= 307 and int(y) <= 167, s
        a = parse_reply(s, resized_size=(308, 168), screen_size=(1280, 720)).action
        assert a.point[0] <= 1280 * 307 / 308 and a.point[1] <= 720 * 167 / 168
    assert not re.fullmatch(regex, "Thought: a\nAction: click(start_box='(308,0)')")
    with pytest.raises(ValueError, match="max_x"):
        action_regex(max_x=-1)


def test_regex_rejects_what_the_parser_rejects():
    compiled = re.compile(action_regex())
    for s in ["Thought: x\nAction: click(start_box='(1,)')", "Action: wait()", "Thought: x\nAction: launch()",
              "Thought: \nAction: wait()", "Thought: x\nAction: hotkey(key='ctrl banana')"]:
        assert not compiled.fullmatch(s), s


def test_regex_bounds_and_action_selection():
    r = action_regex(actions=("click", "wait"), max_coord_digits=2)
    assert re.fullmatch(r, "Thought: a\nAction: click(start_box='(12,34)')")
    assert not re.fullmatch(r, "Thought: a\nAction: click(start_box='(123,34)')")
    assert not re.fullmatch(r, "Thought: a\nAction: type(content='ab')")
    with pytest.raises(ValueError, match="unknown actions"):
        action_regex(actions=("click", "teleport"))
    with pytest.raises(ValueError, match=">= 1"):
        action_regex(max_thought_chars=0)


def test_xgrammar_accepts_the_regex_and_agrees_with_python_re():
    import xgrammar  # a core dependency: an import error fails the test
    from xgrammar.testing import _is_grammar_accept_string

    regex = action_regex()
    grammar = xgrammar.Grammar.from_regex(regex)
    rng = random.Random(7)
    for _ in range(40):
        assert _is_grammar_accept_string(grammar, _sample(regex, rng))
    assert not _is_grammar_accept_string(grammar, "Thought: x\nAction: click(start_box='(1,)')")


# ------------------------------------------------------------------------------------------------ xdotool

def test_xdotool_pointer_commands():
    p = (960.4, 539.6)
    assert to_commands(Action("click", point=p)) == [
        ["xdotool", "mousemove", "959", "540", "mousemove", "--sync", "960", "540", "click", "--delay", "0", "1"]]
    assert to_commands(Action("right_single", point=p))[0][-4:] == ["click", "--delay", "0", "3"]
    assert to_commands(Action("left_double", point=p))[0][-6:] == ["click", "--repeat", "2", "--delay", "40", "1"]
    assert to_commands(Action("hover", point=p)) == [["xdotool", "mousemove", "959", "540", "mousemove",
                                                      "--sync", "960", "540"]]
    # at x = 0 the nudge goes right, staying on screen
    assert to_commands(Action("click", point=(0.0, 5.0)))[0][2:4] == ["1", "5"]


def test_xdotool_drag_moves_in_steps_and_never_syncs_on_the_same_pixel():
    (argv,) = to_commands(Action("drag", point=(0.0, 0.0), end_point=(400.0, 200.0)))
    assert argv[:8] == ["xdotool", "mousemove", "1", "0", "mousemove", "--sync", "0", "0"]
    assert argv[8:10] == ["mousedown", "1"] and argv[-2:] == ["mouseup", "1"]
    moves = [(argv[i + 2], argv[i + 3]) for i in range(10, len(argv) - 2) if argv[i] == "mousemove"]
    assert moves == [("100", "50"), ("200", "100"), ("300", "150"), ("400", "200")]
    # a one-pixel drag: intermediate points round onto the start; a --sync move to the same pixel would hang
    (short,) = to_commands(Action("drag", point=(10.0, 10.0), end_point=(11.0, 10.0)))
    synced = [tuple(short[i + 2:i + 4]) for i in range(len(short)) if short[i:i + 2] == ["mousemove", "--sync"]]
    assert synced == [("10", "10"), ("11", "10")]


def test_xdotool_keyboard_and_scroll_commands():
    assert to_commands(Action("hotkey", key="ctrl shift t")) == [["xdotool", "key", "ctrl+shift+t"]]
    assert to_commands(Action("hotkey", key="down")) == [["xdotool", "key", "Down"]]
    assert to_commands(Action("hotkey", key="ctrl +")) == [["xdotool", "key", "ctrl+plus"]]
    assert to_commands(Action("key_down", key="shift")) == [["xdotool", "keydown", "shift"]]
    assert to_commands(Action("type", text="-rf x\n")) == [
        ["xdotool", "type", "--delay", "12", "--", "-rf x"], ["xdotool", "key", "Return"]]
    assert to_commands(Action("type", text="\n")) == [["xdotool", "key", "Return"]]
    assert to_commands(Action("type", text="a\nb")) == [["xdotool", "type", "--delay", "12", "--", "a\nb"]]
    assert to_commands(Action("scroll", point=(10.0, 20.0), direction="up"))[0][-6:] == [
        "click", "--repeat", "5", "--delay", "0", "4"]
    assert to_commands(Action("scroll", direction="right")) == [
        ["xdotool", "click", "--repeat", "5", "--delay", "0", "7"]]
    for kind in ("wait", "finished", "fail"):
        assert to_commands(Action(kind)) == []
    with pytest.raises(UnsupportedActionError, match="needs a point"):
        to_commands(Action("click"))
    with pytest.raises(UnsupportedActionError, match="unknown action kind"):
        to_commands(Action("teleport"))


def test_pyautogui_reference_mapping():
    assert to_pyautogui(Action("click", point=(960.0, 540.0))).endswith("pyautogui.click(960.0, 540.0, button='left')")
    assert "pyautogui.doubleClick(1.0, 2.0, button='left')" in to_pyautogui(Action("left_double", point=(1.0, 2.0)))
    assert "button='right'" in to_pyautogui(Action("right_single", point=(1.0, 2.0)))
    drag = to_pyautogui(Action("drag", point=(1.0, 2.0), end_point=(3.0, 4.0)))
    assert "pyautogui.moveTo(1.0, 2.0)" in drag and "pyautogui.dragTo(3.0, 4.0, duration=1.0)" in drag
    assert "pyautogui.hotkey('ctrl', 'c')" in to_pyautogui(Action("hotkey", key="ctrl c"))
    typed = to_pyautogui(Action("type", text="it's\n"))
    assert "pyautogui.write(\"it's\", interval=0.1)" in typed and typed.endswith("pyautogui.press('enter')")
    assert "pyautogui.scroll(-5, x=1.0, y=2.0)" in to_pyautogui(Action("scroll", point=(1.0, 2.0), direction="down"))
    assert "pyautogui.hscroll(5)" in to_pyautogui(Action("scroll", direction="right"))
    assert [to_pyautogui(Action(k)) for k in ("finished", "fail", "wait")] == ["DONE", "FAIL", "WAIT"]
    compile(to_pyautogui(Action("type", text="a'b\"c\\")), "<pyautogui>", "exec")  # valid Python


# ------------------------------------------------------------------------------------------------ prompt

def _layout(messages):
    out = []
    for m in messages:
        kinds = [c["type"] for c in m["content"]]
        out.append(f"{m['role']}:{'+'.join(kinds)}")
    return out


def test_prompt_first_step():
    prompt = build_messages("Open the calculator", [])
    assert prompt.image_indices == [0]
    assert _layout(prompt.messages) == ["system:text", "user:text", "user:image"]
    assert prompt.messages[0]["content"][0]["text"] == ARPO_SYSTEM
    text = prompt.messages[1]["content"][0]["text"]
    assert text.startswith("You are a GUI agent.") and text.endswith("## User Instruction\nOpen the calculator\n")
    assert "Use English in `Thought` and `Action` part." in text and "call_user()" not in text


def test_compact_prompt_puts_the_bare_instruction_after_the_current_screenshot():
    replies = ["Thought: a\nAction: wait()", "Thought: b\nAction: wait()"]
    compact = build_messages("Click the Star button.", replies, history_images=2, style="compact")
    uitars = build_messages("Click the Star button.", replies, history_images=2)
    assert _layout(compact.messages) == ["system:text", "assistant:text", "user:image", "assistant:text",
                                         "user:image+text"]
    assert compact.image_indices == uitars.image_indices == [1, 2]
    assert compact.messages[0]["content"][0]["text"] == COMPACT_SYSTEM
    assert compact.messages[-1]["content"][1] == {"type": "text", "text": "Click the Star button."}
    assert compact.messages[1:-1] == uitars.messages[2:-1]  # the replies and earlier screenshots alike
    first = build_messages("Click the Star button.", [], history_images=2, style="compact")
    assert _layout(first.messages) == ["system:text", "user:image+text"]
    with pytest.raises(ValueError, match="style"):
        build_messages("x", [], style="verbose")


def test_prompt_keeps_only_the_last_k_screenshots_and_every_reply():
    replies = [f"Thought: step {i}\nAction: click(start_box='({i},{i})')" for i in range(6)]
    prompt = build_messages("task", replies, history_images=3)
    assert prompt.image_indices == [4, 5, 6]  # 7 screenshots so far, the last 3 shown
    assert _layout(prompt.messages) == (
        ["system:text", "user:text"] + ["assistant:text"] * 4
        + ["user:image", "assistant:text", "user:image", "assistant:text", "user:image"])
    assistants = [m["content"][0]["text"] for m in prompt.messages if m["role"] == "assistant"]
    assert assistants[0] == "Thought: step 0\nAction: click(start_box='<|box_start|>(0,0)<|box_end|>')"
    assert len(assistants) == 6


def test_prompt_with_a_window_larger_than_the_episode_is_arpos_layout():
    replies = ["Thought: a\nAction: wait()", "Thought: b\nAction: wait()"]
    prompt = build_messages("task", replies)  # default: ARPO's 15
    assert prompt.image_indices == [0, 1, 2]
    assert _layout(prompt.messages)[2:] == ["user:image", "assistant:text", "user:image", "assistant:text",
                                            "user:image"]
    assert build_messages("task", replies, history_images=1).image_indices == [2]
    with pytest.raises(ValueError, match="history_images"):
        build_messages("task", replies, history_images=0)


def test_prompt_options():
    text = action_space_prompt("t", language="Chinese", call_user=True)
    assert "Use Chinese in `Thought`" in text
    assert "call_user() # Submit the task and call the user" in text
    # the escapes the model is told to use are rendered as single backslashes
    assert "use \\n at the end of content." in text and "\\\\n" not in text


def test_prompt_renders_with_the_tiny_models_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from arpo_async.model.init_model import create_tiny_model

    tok = AutoTokenizer.from_pretrained(create_tiny_model(tmp_path / "m"))
    prompt = build_messages("task", ["Thought: a\nAction: wait()"], history_images=1)
    rendered = tok.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
    assert rendered.count("<|vision_start|><|image_pad|><|vision_end|>") == len(prompt.image_indices) == 1
    assert rendered.startswith(f"<|im_start|>system\n{ARPO_SYSTEM}<|im_end|>")
    assert rendered.endswith("<|im_start|>assistant\n")
