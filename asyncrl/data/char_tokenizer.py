"""A character-level tokenizer built locally with HF ``tokenizers``.

One token per character, ``<bos>`` prepended, left padding; saved in HF format and
loaded back with ``AutoTokenizer`` -- the same path a real checkpoint's tokenizer takes.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Every character the built-in synthetic tasks use (arithmetic, countdown, answer tags).
DEFAULT_CHARSET = "0123456789+-*/()=,:<>. abcdefghijklmnopqrstuvwxyz"


def build_char_tokenizer(charset: str = DEFAULT_CHARSET) -> PreTrainedTokenizerFast:
    """A fast tokenizer mapping each character of ``charset`` to one id."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(charset):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without separators
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", padding_side="left")


def save_and_reload(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> PreTrainedTokenizerFast:
    """Save in HF format and load back through ``AutoTokenizer`` (the real loading path)."""
    tokenizer.save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))
