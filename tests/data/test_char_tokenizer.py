from transformers import AutoTokenizer

from asyncrl.data.char_tokenizer import build_char_tokenizer, save_and_reload


def test_round_trip_through_autotokenizer(tmp_path):
    tok = save_and_reload(build_char_tokenizer(), tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok("12+34=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 7  # <bos> + one token per character
    assert again("12+34=")["input_ids"] == ids
    assert tok.decode(ids, skip_special_tokens=True) == "12+34="
    assert tok.padding_side == "left"
    batch = tok(["1+2=", "123+456="], padding=True)["input_ids"]
    assert batch[0][:4] == [tok.pad_token_id] * 4


def test_without_unk_the_vocabulary_is_specials_then_charset(tmp_path):
    """The TRL comparison's 15 tokens: <pad> <bos> <eos>, digits, + and = (bench/peer_trl.py)."""
    tok = save_and_reload(build_char_tokenizer("0123456789+=", with_unk=False), tmp_path)
    assert len(tok) == 15 and tok.unk_token is None
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("9+1=")["input_ids"] == [1, 12, 13, 4, 14]
    assert tok.decode(tok("9+1=")["input_ids"], skip_special_tokens=True) == "9+1="
