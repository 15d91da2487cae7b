"""System prompts read from a checkpoint's system_prompt.py (with ast, never executed) and chosen as the
official code does; the generation config (official generation_config.json keys)."""

from __future__ import annotations

import json

import pytest

from components.engine.generation_config import GenerationConfig, tiny_generation_config
from components.engine.system_prompts import (
    TINY_SYSTEM_PROMPTS,
    SystemPromptFileError,
    get_system_prompt,
    load_system_prompts,
    resolve_system_prompt,
    write_system_prompt_file,
)

PROMPTS = {"en_vanilla": "\nV text\n", "en_recaption": "\nR text\n", "en_think_recaption": "\nTR text\n",
           "en_unified": "U text with <think>\n"}

# The official system_prompt.py get_system_prompt(sys_type, bot_task, system_prompt) (fork 4000b7f), as a
# table: which prompt each (sys_type, bot_task) gives; "custom" = the custom text, None = no system prompt.
OFFICIAL_CHOICE = {
    "None": dict.fromkeys(("think", "recaption", "image", "think_recaption", "auto")),
    "en_unified": dict.fromkeys(("think", "recaption", "image", "think_recaption", "auto"), "en_unified"),
    "en_vanilla": dict.fromkeys(("think", "recaption", "image", "think_recaption", "auto"), "en_vanilla"),
    "dynamic": {"think": "en_think_recaption", "recaption": "en_recaption", "image": "en_vanilla(strip \\n)",
                "think_recaption": "custom", "auto": "custom"},
    "custom": dict.fromkeys(("think", "recaption", "image", "think_recaption", "auto"), "custom"),
}


@pytest.mark.parametrize("sys_type", list(OFFICIAL_CHOICE))
@pytest.mark.parametrize("bot_task", ["think", "recaption", "image", "think_recaption", "auto"])
def test_selection_is_the_official_one(sys_type, bot_task):
    expected = OFFICIAL_CHOICE[sys_type][bot_task]
    got = get_system_prompt(sys_type, bot_task, PROMPTS, "  my custom  ")
    want = {None: None, "custom": "  my custom  ", "en_vanilla(strip \\n)": "V text"}.get(expected)
    if expected not in (None, "custom", "en_vanilla(strip \\n)"):
        want = PROMPTS[expected]
    assert got == want
    # generate_image then strips (None -> "")
    assert resolve_system_prompt(sys_type, bot_task, PROMPTS, "  my custom  ") == (want or "").strip()


def test_ardit_system_prompt_values():
    """--system-prompt: a sys_type name, "none", or the custom text itself."""
    assert resolve_system_prompt("none", "image", PROMPTS) == ""
    assert resolve_system_prompt(None, "image", PROMPTS) == ""
    assert resolve_system_prompt("en_unified", "image", PROMPTS) == "U text with <think>"
    assert resolve_system_prompt("  Draw carefully.\n", "image", PROMPTS) == "Draw carefully."
    assert resolve_system_prompt("dynamic", "think_recaption", PROMPTS) == ""  # official: custom text, none given
    with pytest.raises(ValueError, match="unsupported system prompt type"):
        get_system_prompt("en_french", "image", PROMPTS)


def test_load_from_a_file_with_the_official_structure(tmp_path):
    write_system_prompt_file(tmp_path, PROMPTS)
    assert load_system_prompts(tmp_path) == PROMPTS
    write_system_prompt_file(tmp_path / "tiny")
    assert load_system_prompts(tmp_path / "tiny") == TINY_SYSTEM_PROMPTS


def test_official_layout_variants_are_read(tmp_path):
    """Implicit string concatenation, parenthesised strings, + of strings, docstrings and functions around."""
    (tmp_path / "system_prompt.py").write_text(
        '"""doc"""\n'
        'import os\n'
        't2i_system_prompt_en_vanilla = """\nVanilla.\n"""\n'
        't2i_system_prompt_en_recaption = "Re" "caption <recaption>."\n'
        't2i_system_prompt_en_think_recaption = ("Think" + " <think>")\n'
        't2i_system_prompts = {\n    "en_vanilla": [t2i_system_prompt_en_vanilla],\n'
        '    "en_recaption": [t2i_system_prompt_en_recaption],\n'
        '    "en_think_recaption": [t2i_system_prompt_en_think_recaption]\n}\n'
        'unified_system_prompt_en = (\n    "A "\n    "unified.\\n"\n)\n'
        'OTHER = os.getcwd()\n'
        'def get_system_prompt(sys_type, bot_task, system_prompt=None):\n    return None\n'
        '__all__ = ["get_system_prompt"]\n')
    assert load_system_prompts(tmp_path) == {"en_vanilla": "\nVanilla.\n", "en_recaption": "Recaption <recaption>.",
                                             "en_think_recaption": "Think <think>", "en_unified": "A unified.\n"}


def test_the_file_is_never_executed(tmp_path):
    marker = tmp_path / "executed"
    write_system_prompt_file(tmp_path, PROMPTS)
    path = tmp_path / "system_prompt.py"
    path.write_text(f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit(3)\n" + path.read_text())
    assert load_system_prompts(tmp_path) == PROMPTS
    assert not marker.exists()


def test_missing_or_malformed_file_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemPromptFileError, match=r"system_prompt\.py not found") as e:
        load_system_prompts(tmp_path)
    assert "\n" not in str(e.value)
    (tmp_path / "system_prompt.py").write_text("unified_system_prompt_en = 'x'\n")
    with pytest.raises(SystemPromptFileError, match="t2i_system_prompts"):
        load_system_prompts(tmp_path)
    (tmp_path / "system_prompt.py").write_text("def broken(:\n")
    with pytest.raises(SystemPromptFileError, match="not valid Python"):
        load_system_prompts(tmp_path)


def test_generated_file_runs_under_the_official_import_too(tmp_path):
    """The fixture file also works where the official code imports it (trust_remote_code)."""
    import importlib.util

    path = write_system_prompt_file(tmp_path, PROMPTS)
    spec = importlib.util.spec_from_file_location("fixture_system_prompt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for sys_type in OFFICIAL_CHOICE:
        for bot_task in ("think", "recaption", "image", "think_recaption"):
            assert module.get_system_prompt(sys_type, bot_task, "c") == get_system_prompt(sys_type, bot_task,
                                                                                          PROMPTS, "c")


# --------------------------------------------------------------------------- generation config
def test_generation_config_from_file(tmp_path):
    data = {"bot_task": "think_recaption", "diff_guidance_scale": 2.5, "diff_infer_steps": 8, "do_sample": True,
            "drop_think": False, "eos_token_id": [127957], "flow_shift": 3.0, "max_length": 22800,
            "moe_impl": "eager", "sequence_template": "instruct", "temperature": 0.6, "top_k": 1024, "top_p": 0.95,
            "use_system_prompt": "en_unified", "max_new_tokens": 2048}
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(data))
    gc = GenerationConfig.from_file(path)
    assert (gc.diff_infer_steps, gc.diff_guidance_scale, gc.bot_task, gc.use_system_prompt) == (8, 2.5,
                                                                                                 "think_recaption",
                                                                                                 "en_unified")
    assert gc.extra == {"eos_token_id": [127957], "moe_impl": "eager"}
    assert gc.to_dict() == data and not gc.greedy


def test_generation_config_defaults_and_overrides():
    gc = GenerationConfig.from_dict({})
    # the released base generation_config.json values and the official code's own fallbacks; sampling
    # keys a file lacks fall back to transformers' GenerationConfig defaults, as the official path
    assert (gc.diff_infer_steps, gc.diff_guidance_scale, gc.flow_shift) == (50, 5.0, 3.0)
    assert (gc.temperature, gc.top_k, gc.top_p, gc.max_new_tokens, gc.max_length) == (1.0, 50, 1.0, 2048, 12800)
    assert (gc.sequence_template, gc.use_system_prompt, gc.bot_task, gc.drop_think) == ("pretrain", "None", "image",
                                                                                         False)
    assert GenerationConfig.from_dict({"use_system_prompt": None}).use_system_prompt == "None"
    assert gc.with_overrides(diff_infer_steps=None, temperature=0).greedy
    assert gc.with_overrides(diff_infer_steps=None).diff_infer_steps == 50


def test_tiny_generation_config_is_the_contract():
    gc = tiny_generation_config()
    assert (gc.diff_infer_steps, gc.diff_guidance_scale, gc.flow_shift, gc.bot_task, gc.use_system_prompt) == \
        (8, 5.0, 3.0, "think_recaption", "en_unified")
    assert (gc.temperature, gc.top_k, gc.top_p, gc.max_new_tokens, gc.sequence_template) == \
        (0.6, 1024, 0.95, 32, "instruct")


@pytest.mark.parametrize("bad,match", [({"bot_task": "video"}, "bot_task"), ({"top_p": 0}, "top_p"),
                                       ({"diff_infer_steps": 0}, "diff_infer_steps"),
                                       ({"sequence_template": "chat"}, "sequence_template")])
def test_generation_config_rejects_bad_values(tmp_path, bad, match):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match) as e:
        GenerationConfig.from_file(path)
    assert str(path) in str(e.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        GenerationConfig.from_file(path)


def test_generation_config_file_round_trip(tmp_path):
    from components.engine.generation_config import write_generation_config_file

    path = write_generation_config_file(tmp_path)
    assert path.name == "generation_config.json"
    assert GenerationConfig.from_file(path) == tiny_generation_config()


def test_builder_from_config_reads_distil_flags_and_template():
    from types import SimpleNamespace

    from components.engine.sequence import SequenceBuilder
    from components.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    distil = SimpleNamespace(image_base_size=256, cfg_distilled=True, use_meanflow=True)
    b = SequenceBuilder.from_config(tok, distil, tiny_generation_config().with_overrides(max_length=300))
    assert (b.guidance_token, b.timestep_r_token, b.sequence_template, b.max_length) == (True, True, "instruct", 300)
    seq = b.dit_sequence("a cat", [], None, "", 16)
    gen = seq.gen_image
    assert seq.cfg_distilled and (gen.guidance_index, gen.timestep_r_index) == (gen.timestep_index + 1,
                                                                                gen.timestep_index + 2)
    base = SequenceBuilder.from_config(tok, SimpleNamespace(image_base_size=256), GenerationConfig())
    assert (base.guidance_token, base.sequence_template) == (False, "pretrain")
