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


def build_char_tokenizer(charset: str = DEFAULT_CHARSET, with_unk: bool = True) -> PreTrainedTokenizerFast:
    """A fast tokenizer mapping each character of ``charset`` to one id.

    ``with_unk=False`` leaves ``<unk>`` out (ids: <pad>, <bos>, <eos>, then ``charset``): the
    exact 15-token vocabulary of the TRL comparison (bench/peer_trl.py); a character outside
    ``charset`` then raises instead of mapping to ``<unk>``.
    """
    specials = SPECIAL_TOKENS if with_unk else SPECIAL_TOKENS[:3]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in dict.fromkeys(charset):
        vocab.setdefault(ch, len(vocab))
    unk = "<unk>" if with_unk else None
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    # one piece per character, newlines included ("." would leave "\n\n" whole, an unknown token)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without separators
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token=unk, padding_side="left")


def save_and_reload(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> PreTrainedTokenizerFast:
    """Save in HF format and load back through ``AutoTokenizer`` (the real loading path)."""
    tokenizer.save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))
