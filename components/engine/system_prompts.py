"""System prompts: read from the checkpoint's `system_prompt.py`, chosen as the official code does.

The official texts ship with the checkpoint as `system_prompt.py` beside the modeling files
(`trust_remote_code`). ardit reads them with `ast` and never executes the file: module-level string
assignments, `t2i_system_prompts = {"en_vanilla": [name], ...}` and `unified_system_prompt_en`.
The tiny preset has short prompts of its own.

Selection follows the official `get_system_prompt(sys_type, bot_task, system_prompt)` and
`generate_image` (which `.strip()`s the result; no system prompt is the empty string):

    "None" -> none;  en_unified / en_vanilla / en_recaption / en_think_recaption -> that text
    dynamic -> by bot_task: think -> en_think_recaption, recaption -> en_recaption,
               image -> en_vanilla (newlines stripped), anything else -> the custom text
    custom -> the custom text

ardit's `--system-prompt` takes a name, `none`, or the custom text itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

SYSTEM_PROMPT_FILE = "system_prompt.py"
PROMPT_NAMES = ("en_vanilla", "en_recaption", "en_think_recaption", "en_unified")
SYS_TYPES = ("None", "dynamic", *PROMPT_NAMES, "custom")

# The tiny preset's own short prompts (the official ones are long and ship with the checkpoint).
# en_unified and en_think_recaption mention the tags, so their tags become special tokens as in
# the official prompts.
TINY_SYSTEM_PROMPTS = {
    "en_vanilla": "\nYou are a helpful assistant that creates images.\n",
    "en_recaption": "\nYou are a helpful assistant. Write a detailed description in <recaption> tags.\n",
    "en_think_recaption": "\nYou are a helpful assistant. Think in <think> tags, then write a detailed "
                          "description in <recaption> tags.\n",
    "en_unified": "You are a helpful assistant that creates and edits images. With <think>, think about the "
                  "request; with <recaption>, write a detailed description.\n",
}


class SystemPromptFileError(ValueError):
    """system_prompt.py is missing or unreadable; the message is one line naming the file."""


def load_system_prompts(model_dir: str | Path) -> dict[str, str]:
    """{name: text} for en_vanilla, en_recaption, en_think_recaption, en_unified from
    `model_dir/system_prompt.py`, read with `ast` (the file is never executed)."""
    path = Path(model_dir) / SYSTEM_PROMPT_FILE
    if not path.is_file():
        raise SystemPromptFileError(f"{path} not found: a HunyuanImage-3 checkpoint ships its system prompts in "
                                f"{SYSTEM_PROMPT_FILE} beside its modeling files; download the full checkpoint")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as e:
        raise SystemPromptFileError(f"{path}: not valid Python ({e.msg}, line {e.lineno})") from None
    env: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                env[node.targets[0].id] = _literal(node.value, env)
            except ValueError:
                continue  # not a plain literal: not one of the prompt definitions
    try:
        table = env["t2i_system_prompts"]
        prompts = {name: table[name][0] for name in ("en_vanilla", "en_recaption", "en_think_recaption")}
        prompts["en_unified"] = env["unified_system_prompt_en"]
    except (KeyError, IndexError, TypeError) as e:
        raise SystemPromptFileError(f"{path}: expected `t2i_system_prompts` (en_vanilla, en_recaption, "
                                    f"en_think_recaption) and `unified_system_prompt_en` as in the official "
                                    f"file; missing {e}") from None
    bad = [k for k, v in prompts.items() if not isinstance(v, str)]
    if bad:
        raise SystemPromptFileError(f"{path}: system prompts {bad} are not strings")
    return prompts  # type: ignore[return-value]


def _literal(node: ast.AST, env: dict[str, object]) -> object:
    """Value of a literal expression over strings, lists, tuples, dicts and earlier names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise ValueError(node.id)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, env) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("dict unpacking")
        return {_literal(k, env): _literal(v, env) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left, env), _literal(node.right, env)
        if isinstance(left, str) and isinstance(right, str):
            return left + right
    raise ValueError(type(node).__name__)


def sys_type_of(choice: str | None) -> tuple[str, str | None]:
    """ardit's `--system-prompt` value -> (official sys_type, custom text).

    A sys_type name passes through ("none" is accepted for "None"); anything else is custom text."""
    if choice is None:
        return "None", None
    if choice.lower() == "none":
        return "None", None
    if choice in SYS_TYPES:
        return choice, None
    return "custom", choice


def get_system_prompt(sys_type: str, bot_task: str, prompts: dict[str, str],
                      system_prompt: str | None = None) -> str | None:
    """The official selection (system_prompt.py `get_system_prompt`), over `prompts`."""
    if sys_type == "None":
        return None
    if sys_type in PROMPT_NAMES:
        return prompts[sys_type]
    if sys_type == "dynamic":
        if bot_task == "think":
            return prompts["en_think_recaption"]
        if bot_task == "recaption":
            return prompts["en_recaption"]
        if bot_task == "image":
            return prompts["en_vanilla"].strip("\n")
        return system_prompt  # any other bot_task (think_recaption, auto): the custom text
    if sys_type == "custom":
        return system_prompt
    raise ValueError(f"unsupported system prompt type {sys_type!r}; choose one of {SYS_TYPES} or give the text")


def resolve_system_prompt(use_system_prompt: str | None, bot_task: str, prompts: dict[str, str],
                          system_prompt: str | None = None) -> str:
    """The system prompt text a request runs with, as `generate_image`: selected, then `.strip()`ped;
    "" for none. `use_system_prompt` is a sys_type, "none", or a custom text (ardit's CLI value);
    `system_prompt` is the custom text for sys_type "custom"/"dynamic"."""
    sys_type, custom = sys_type_of(use_system_prompt)
    text = get_system_prompt(sys_type, bot_task, prompts, custom if custom is not None else system_prompt)
    return text.strip() if text is not None else ""


def write_system_prompt_file(directory: str | Path, prompts: dict[str, str] | None = None) -> Path:
    """Write a `system_prompt.py` with the official file's structure (as `ast` sees it) holding
    `prompts` (the tiny preset's by default): for test fixtures of an official-layout checkpoint."""
    prompts = prompts or TINY_SYSTEM_PROMPTS
    lines = ['"""System prompts (official layout, test texts)."""', ""]
    for name in ("en_vanilla", "en_recaption", "en_think_recaption"):
        lines.append(f"t2i_system_prompt_{name} = {prompts[name]!r}")
    lines += ["", "t2i_system_prompts = {"]
    lines += [f'    "{name}": [t2i_system_prompt_{name}],' for name in ("en_vanilla", "en_recaption",
                                                                       "en_think_recaption")]
    lines += ["}", "", f"unified_system_prompt_en = {prompts['en_unified']!r}", "", "",
              "def get_system_prompt(sys_type, bot_task, system_prompt=None):",
              "    if sys_type == 'None':",
              "        return None",
              "    if sys_type == 'en_unified':",
              "        return unified_system_prompt_en",
              "    if sys_type in t2i_system_prompts:",
              "        return t2i_system_prompts[sys_type][0]",
              "    if sys_type == 'dynamic':",
              "        by_task = {'think': 'en_think_recaption', 'recaption': 'en_recaption'}",
              "        if bot_task in by_task:",
              "            return t2i_system_prompts[by_task[bot_task]][0]",
              "        if bot_task == 'image':",
              "            return t2i_system_prompts['en_vanilla'][0].strip('\\n')",
              "        return system_prompt",
              "    if sys_type == 'custom':",
              "        return system_prompt",
              "    raise NotImplementedError(f'Unsupported system prompt type: {sys_type}')", ""]
    path = Path(directory) / SYSTEM_PROMPT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
