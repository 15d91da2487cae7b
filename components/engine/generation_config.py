"""Generation settings: the checkpoint's `generation_config.json`, field for field.

Fields carry the official key names. A key the file lacks takes the value of the released
HunyuanImage-3.0 generation_config.json (steps 50, guidance 5.0, flow shift 3.0, max_length 12800)
or the official code's own fallback (`sequence_template` "pretrain", `use_system_prompt` "None",
`max_new_tokens` 2048 as `generate_image`, `drop_think` False). The sampling keys fall back as the
official path does, to transformers' GenerationConfig defaults: temperature 1.0, top_k 50, top_p 1.0
(the released files set 0.6 / 1024 / 0.95 themselves, and those values are kept). Keys the engine does not use (eos_token_id, moe_impl, ...)
are kept in `extra`.

`temperature` 0 (or `do_sample` false) means greedy decoding.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BOT_TASKS = ("image", "auto", "recaption", "think", "think_recaption")
SEQUENCE_TEMPLATES = ("instruct", "pretrain")


@dataclass
class GenerationConfig:
    diff_infer_steps: int = 50
    diff_guidance_scale: float = 5.0
    flow_shift: float = 3.0
    bot_task: str = "image"
    use_system_prompt: str = "None"  # None | dynamic | en_vanilla | en_recaption | en_think_recaption | en_unified | custom
    sequence_template: str = "pretrain"
    max_new_tokens: int = 2048
    do_sample: bool = True
    temperature: float = 1.0  # transformers' fallbacks (the released files set 0.6 / 1024 / 0.95)
    top_k: int = 50
    top_p: float = 1.0
    drop_think: bool = False
    max_length: int = 12800
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if self.bot_task not in BOT_TASKS:
            problems.append(f"bot_task {self.bot_task!r} is not one of {BOT_TASKS}")
        if self.sequence_template not in SEQUENCE_TEMPLATES:
            problems.append(f"sequence_template {self.sequence_template!r} is not one of {SEQUENCE_TEMPLATES}")
        if int(self.diff_infer_steps) < 1:
            problems.append(f"diff_infer_steps must be >= 1, got {self.diff_infer_steps}")
        if int(self.max_new_tokens) < 0:
            problems.append(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if float(self.temperature) < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if int(self.top_k) < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < float(self.top_p) <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if problems:
            raise ValueError("generation config: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GenerationConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known and v is not None}
        extra = {k: v for k, v in data.items() if k not in known}
        if "use_system_prompt" in values:
            values["use_system_prompt"] = str(values["use_system_prompt"])
        return cls(**values, extra=extra)

    @classmethod
    def from_file(cls, path: str | Path) -> "GenerationConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **data}

    def with_overrides(self, **changes: Any) -> "GenerationConfig":
        """A copy with the given fields changed; None values mean "keep" (a CLI flag left unset)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def tiny_generation_config() -> GenerationConfig:
    """The tiny preset's generation config (CONTRACTS.md): the Instruct flow at toy size."""
    return GenerationConfig(diff_infer_steps=8, diff_guidance_scale=5.0, flow_shift=3.0, bot_task="think_recaption",
                            use_system_prompt="en_unified", sequence_template="instruct", max_new_tokens=32,
                            do_sample=True, temperature=0.6, top_k=1024, top_p=0.95, drop_think=False,
                            max_length=4096)


def write_generation_config_file(directory: str | Path, config: GenerationConfig | None = None) -> Path:
    """Write `generation_config.json` (official keys) for a checkpoint directory; the tiny preset's
    config unless one is given."""
    path = Path(directory) / "generation_config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps((config or tiny_generation_config()).to_dict(), indent=2, sort_keys=True) + "\n")
    return path
