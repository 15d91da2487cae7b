"""Tokenizer: the checkpoint's tokenizer for the real model, a byte-level BPE for `tiny`.

Both carry the HunyuanImage-3 special tokens by name, so the sequence builder never hard-codes
ids. The tiny tokenizer is a real BPE (HF `tokenizers`), so BPE(A + B) != BPE(A) + BPE(B) holds
for it as for the real one: the sequence builder must encode segment by segment, always the same
way, in the AR and in the DiT (vLLM-Omni #3499).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

NUM_RATIO_TOKENS = 37  # <img_ratio_0..36>: 33 ResolutionGroup buckets + 4 extra resolutions
IMAGE_SIZE_BASES = (256, 512, 1024)

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|startoftext|>", "<boi>", "<eoi>", "<img>", "<pad>", "<cfg>",
    "<recaption>", "</recaption>", "<think>", "</think>", "<answer>", "</answer>",
    "<timestep>", "<guidance>", "<timestep_r>", "<joint_img_sep>",
    *[f"<img_size_{b}>" for b in IMAGE_SIZE_BASES],
    *[f"<img_ratio_{i}>" for i in range(NUM_RATIO_TOKENS)],
]

TINY_TOKENIZER_FILE = Path(__file__).parent / "assets" / "tiny_tokenizer.json"


class Tokenizer:
    """A thin wrapper giving the engine what it needs: encode/decode and special ids by name."""

    def __init__(self, backend) -> None:
        # backend: a `tokenizers.Tokenizer` (tiny) or a transformers tokenizer (checkpoint)
        self._backend = backend
        self._is_hf_fast = not hasattr(backend, "token_to_id")
        missing = [t for t in ("<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>", "</recaption>", "</think>")
                   if self.token_id(t, required=False) is None]
        if missing:
            raise ValueError(f"tokenizer lacks HunyuanImage-3 special tokens: {missing}")

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Encode one text segment as plain text; no BOS/EOS added.

        Special-token strings inside the text ("<cfg>", "</think>", ...) stay text: a prompt must
        not be able to inject control tokens into the sequence.
        """
        if not text:
            return []
        if self._is_hf_fast:
            return list(self._backend.encode(text, add_special_tokens=False, split_special_tokens=True))
        self._backend.encode_special_tokens = True
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str, required: bool = True) -> int | None:
        if self._is_hf_fast:
            tid = self._backend.convert_tokens_to_ids(token)
            tid = None if tid == getattr(self._backend, "unk_token_id", -1) else tid
        else:
            tid = self._backend.token_to_id(token)
        if tid is None and required:
            raise KeyError(f"token {token!r} is not in the tokenizer")
        return tid

    @property
    def vocab_size(self) -> int:
        if self._is_hf_fast:
            return len(self._backend)
        return self._backend.get_vocab_size(with_added_tokens=True)

    # -- special ids ----------------------------------------------------------------------------
    @cached_property
    def bos(self) -> int: return self.token_id("<|startoftext|>")
    @cached_property
    def eos(self) -> int: return self.token_id("<|endoftext|>")
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
        pad = self.token_id("<pad>", required=False)
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
    def joint_img_sep(self) -> int: return self.token_id("<joint_img_sep>")
    @cached_property
    def ratio_ids(self) -> list[int]:
        return [self.token_id(f"<img_ratio_{i}>") for i in range(NUM_RATIO_TOKENS)]

    def size_id(self, base_size: int) -> int:
        return self.token_id(f"<img_size_{base_size}>")

    @cached_property
    def special_ids(self) -> set[int]:
        """Ids the CoT decoder must never sample (end tags are allowed separately)."""
        ids = {self.token_id(t, required=False) for t in SPECIAL_TOKENS}
        ids.discard(None)
        return ids  # type: ignore[return-value]


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
    """Load the checkpoint's tokenizer from a local directory, or the tiny one when path is None."""
    if path is None:
        from tokenizers import Tokenizer as HFTokenizer

        return Tokenizer(HFTokenizer.from_file(str(TINY_TOKENIZER_FILE)))
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False))


if __name__ == "__main__":  # regenerate the shipped tiny tokenizer
    TINY_TOKENIZER_FILE.parent.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save(str(TINY_TOKENIZER_FILE))
    print("wrote", TINY_TOKENIZER_FILE)
