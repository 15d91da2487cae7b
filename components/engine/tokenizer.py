"""Tokenizer: the checkpoint's `tokenizer.json` for the real model, a byte-level BPE for `tiny`.

Both are read with HF `tokenizers` directly (the official `HunyuanImage3TokenizerFast` is a
`PreTrainedTokenizerFast` over the same `tokenizer.json`), and both carry the HunyuanImage-3 special
tokens under their official names, so the sequence builder never hard-codes ids.

Encoding follows the official tokenizer: special-token strings written in a text segment
(`<think>`, `</recaption>`, `<answer>`, ... inside a system prompt or a prompt) become the special
tokens. Image-structure tokens (`<boi>`, `<img>`, `<img_ratio_k>`, ...) in a user's text would break
the sequence layout; `image_structure_token_in` finds them so such a row fails with a clear message.

The tiny tokenizer is a real BPE, so BPE(A + B) != BPE(A) + BPE(B) holds for it as for the real
one: the sequence builder encodes segment by segment exactly as the official template does.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path

NUM_RATIO_TOKENS = 37  # <img_ratio_0..36>: 33 ResolutionGroup buckets + 4 extra resolutions
IMAGE_SIZE_BASES = (256, 512, 1024)

# The official token strings (tokenization_hunyuan_image_3.py `setup_special_tokens`, the chat
# template and the ratio/size tokens).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|startoftext|>", "<boi>", "<eoi>", "<boa>", "<eoa>", "<bov>", "<eov>", "<img>",
    "<audio>", "<video>", "<pad>", "<cfg>", "<timestep>", "<timestep_r>", "<guidance>", "<joint_img_sep>",
    "<answer>", "</answer>", "<think>", "</think>", "<recaption>", "</recaption>",
    "<ref>", "</ref>", "<quad>", "</quad>",
    *[f"<img_size_{b}>" for b in IMAGE_SIZE_BASES],
    *[f"<img_ratio_{i}>" for i in range(NUM_RATIO_TOKENS)],
]
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|startoftext|>", "<|endoftext|>", "<pad>"

# Tokens that only the sequence builder may place: in a user's text they would forge an image block.
IMAGE_STRUCTURE_TOKENS = ("<boi>", "<eoi>", "<img>", "<joint_img_sep>", "<timestep>", "<guidance>",
                          "<timestep_r>", "<cfg>")
_IMAGE_STRUCTURE_PATTERN = re.compile(r"<img_(size|ratio)_\d+>")

TINY_TOKENIZER_FILE = Path(__file__).parent / "assets" / "tiny_tokenizer.json"

# transformers' `clean_up_tokenization` (applied by `PreTrainedTokenizerFast.decode` when the
# checkpoint's tokenizer_config.json sets clean_up_tokenization_spaces)
_CLEANUP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]


class Tokenizer:
    """What the engine needs from a tokenizer: segment encode/decode and special ids by name."""

    def __init__(self, backend, clean_up_tokenization_spaces: bool = False, source: str = "tiny") -> None:
        self._backend = backend  # a `tokenizers.Tokenizer`
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.source = source
        required = ("<|startoftext|>", "<|endoftext|>", "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>",
                    "<joint_img_sep>", "<answer>", "</answer>", "<think>", "</think>", "<recaption>",
                    "</recaption>", *[f"<img_ratio_{i}>" for i in range(NUM_RATIO_TOKENS)])
        missing = [t for t in required if self.token_id(t, required=False) is None]
        if missing:
            raise ValueError(f"tokenizer {source} lacks HunyuanImage-3 special tokens: {missing}")

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Encode one text segment as the official `tokenizer.encode(text, add_special_tokens=False)`:
        no BOS/EOS added; special-token strings in the text become special tokens."""
        if not text:
            return []
        self._backend.encode_special_tokens = False
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """As the official `tokenizer.decode(ids)`: special tokens written out, then transformers'
        tokenization-space clean-up when the checkpoint asks for it."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for before, after in _CLEANUP:
                text = text.replace(before, after)
        return text

    def token_id(self, token: str, required: bool = True) -> int | None:
        tid = self._backend.token_to_id(token)
        if tid is None and required:
            raise KeyError(f"token {token!r} is not in the tokenizer")
        return tid

    def token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    # -- special ids ----------------------------------------------------------------------------
    @cached_property
    def bos(self) -> int: return self.token_id(BOS_TOKEN)
    @cached_property
    def eos(self) -> int: return self.token_id(EOS_TOKEN)
    @cached_property
    def boi(self) -> int: return self.token_id("<boi>")
    @cached_property
    def eoi(self) -> int: return self.token_id("<eoi>")
    @cached_property
    def img(self) -> int: return self.token_id("<img>")
    @cached_property
    def cfg(self) -> int: return self.token_id("<cfg>")
    @cached_property
    def pad(self) -> int:
        pad = self.token_id(PAD_TOKEN, required=False)
        return pad if pad is not None else self.eos
    @cached_property
    def think(self) -> int: return self.token_id("<think>")
    @cached_property
    def think_end(self) -> int: return self.token_id("</think>")
    @cached_property
    def recaption(self) -> int: return self.token_id("<recaption>")
    @cached_property
    def recaption_end(self) -> int: return self.token_id("</recaption>")
    @cached_property
    def answer(self) -> int: return self.token_id("<answer>")
    @cached_property
    def answer_end(self) -> int: return self.token_id("</answer>")
    @cached_property
    def timestep(self) -> int: return self.token_id("<timestep>")
    @cached_property
    def guidance(self) -> int: return self.token_id("<guidance>")
    @cached_property
    def timestep_r(self) -> int: return self.token_id("<timestep_r>")
    @cached_property
    def joint_img_sep(self) -> int: return self.token_id("<joint_img_sep>")

    @cached_property
    def ratio_ids(self) -> list[int]:
        """Ids of `<img_ratio_0..36>`, by ratio index (official `get_all_ratio_token_ids`)."""
        return [self.token_id(f"<img_ratio_{i}>") for i in range(NUM_RATIO_TOKENS)]

    @cached_property
    def ratio_choice_ids(self) -> list[int]:
        """The ids the ratio step may pick, as the official Instruct code slices them:
        `[start_ratio_token_id, end_ratio_token_id]` (`<img_ratio_0>`..`<img_ratio_32>`) plus
        `ratio_token_other_slices` = [`<img_ratio_33>`, `<img_ratio_36>` + 1), as id ranges."""
        lo, hi = self.ratio_ids[0], self.ratio_ids[32]
        lo2, hi2 = self.ratio_ids[33], self.ratio_ids[36]
        return list(range(lo, hi + 1)) + list(range(lo2, hi2 + 1))

    def size_id(self, base_size: int) -> int:
        return self.token_id(f"<img_size_{base_size}>")

    @cached_property
    def image_structure_ids(self) -> dict[int, str]:
        """{id: token} of every image-structure token this vocabulary has."""
        names = [*IMAGE_STRUCTURE_TOKENS, *[f"<img_size_{b}>" for b in IMAGE_SIZE_BASES],
                 *[f"<img_ratio_{i}>" for i in range(NUM_RATIO_TOKENS)]]
        found = {self.token_id(t, required=False): t for t in names}
        found.pop(None, None)
        return found  # type: ignore[return-value]

    def image_structure_token_in(self, ids: list[int]) -> str | None:
        """The first image-structure token among `ids` (by name), or None."""
        table = self.image_structure_ids
        for t in ids:
            if t in table:
                return table[t]
            name = self.token(t)
            if name is not None and _IMAGE_STRUCTURE_PATTERN.fullmatch(name):
                return name
        return None


# -- the tiny tokenizer ---------------------------------------------------------------------------
def build_tiny_tokenizer(vocab_size: int = 1000):
    """Train the tiny byte-level BPE (deterministic) on a small built-in corpus."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return tok


def _tiny_corpus() -> list[str]:
    words = (
        "a an the of in on with and to make turn add remove change replace into from at by is "
        "cat dog bird horse house tree sky sea river mountain city street car boat flower garden "
        "red green blue yellow purple orange black white golden silver bright dark soft warm cold "
        "photo painting sketch watercolor portrait landscape close-up wide shot style light shadow "
        "sunset sunrise night day rain snow fog cloud clouds image picture background foreground "
        "User: Assistant: You are a helpful assistant that creates and edits images. "
        "The user wants the image to show think about the request recaption: a detailed description "
    ).split()
    lines = []
    for i, w in enumerate(words):
        for j in range(0, len(words), 7):
            lines.append(" ".join([w] + words[j:j + 6]) + ".\n\n")
    return lines


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer from a model directory (`tokenizer.json`, and
    `tokenizer_config.json` for the decode settings), or the tiny one when path is None."""
    from tokenizers import Tokenizer as HFTokenizer

    if path is None:
        return Tokenizer(HFTokenizer.from_file(str(TINY_TOKENIZER_FILE)), source="tiny")
    directory = Path(path)
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a HunyuanImage-3 checkpoint directory carries its tokenizer "
                                "as tokenizer.json")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return Tokenizer(HFTokenizer.from_file(str(file)),
                     clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                     source=str(directory))


def write_tokenizer_files(directory: str | Path, backend=None) -> list[Path]:
    """Write tokenizer files in the official checkpoint layout (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json), from the tiny BPE unless a `tokenizers.Tokenizer` is given.

    `load_tokenizer(directory)` reads them, and so does the official
    `HunyuanImage3TokenizerFast.from_pretrained(directory)` (a `PreTrainedTokenizerFast`)."""
    from tokenizers import Tokenizer as HFTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend = backend or HFTokenizer.from_file(str(TINY_TOKENIZER_FILE))
    tokenizer_json = directory / "tokenizer.json"
    backend.save(str(tokenizer_json))
    extra = [t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)]
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
               "additional_special_tokens": extra}
    config = {
        **special,
        "tokenizer_class": "HunyuanImage3TokenizerFast",
        "auto_map": {"AutoTokenizer": [None, "tokenization_hunyuan_image_3.HunyuanImage3TokenizerFast"]},
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "added_tokens_decoder": {
            str(backend.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    config_json = directory / "tokenizer_config.json"
    config_json.write_text(json.dumps(config, indent=2) + "\n")
    special_json = directory / "special_tokens_map.json"
    special_json.write_text(json.dumps(special, indent=2) + "\n")
    return [tokenizer_json, config_json, special_json]


if __name__ == "__main__":  # regenerate the shipped tiny tokenizer
    TINY_TOKENIZER_FILE.parent.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save(str(TINY_TOKENIZER_FILE))
    print("wrote", TINY_TOKENIZER_FILE)
