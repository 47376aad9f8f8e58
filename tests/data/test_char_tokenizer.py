import pytest

from orbit_lightning.data import CharTokenizer


def test_round_trip_and_ids():
    tok = CharTokenizer()
    text = "37+485=522\n(2*3)-x y"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id == 1 and ids[-1] == tok.eos_token_id == 2
    assert len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text + "<eos>"
    assert tok.decode([tok.pad_token_id] * 3, skip_special_tokens=False) == "<pad><pad><pad>"


def test_default_vocab_layout():
    tok = CharTokenizer()
    # 3 specials + 10 digits + "+-*=() \n" (8) + 26 letters
    assert tok.vocab_size == len(tok) == 3 + 10 + 8 + 26
    assert tok.encode("0") == [3] and tok.encode("z") == [tok.vocab_size - 1]


def test_call_matches_encode():
    tok = CharTokenizer("ab")
    assert tok("ab", add_bos=True) == {"input_ids": [1, 3, 4]}
    assert tok(["a", "bb"]) == {"input_ids": [[3], [4, 4]]}


def test_unknown_character_is_named():
    with pytest.raises(ValueError, match=r"'#' at position 2"):
        CharTokenizer().encode("1+#")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        CharTokenizer().decode([999])
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer("abca")


def test_save_and_load(tmp_path):
    tok = CharTokenizer("0123456789+=?")
    path = tok.save_pretrained(tmp_path / "tok")
    assert path.endswith("tokenizer_char.json")
    loaded = CharTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded.chars == tok.chars and loaded.encode("12+3=?") == tok.encode("12+3=?")
    with pytest.raises(FileNotFoundError, match="tokenizer_char.json"):
        CharTokenizer.from_pretrained(tmp_path)
