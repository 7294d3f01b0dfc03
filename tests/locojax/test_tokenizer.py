import numpy as np
import pytest

from locojax.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, pad_left


def test_byte_tokenizer_round_trips_unicode_and_drops_specials():
    tok = ByteTokenizer()
    text = "12+5=17\n#### 17 — ünïcode ✓"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id and max(ids[1:]) < 256
    assert tok.decode(ids + [tok.eos_id, tok.pad_id, 300]) == text
    assert load_tokenizer(None).vocab_size == 259
    # A rollout's rows (numpy, int32, each cut at its length) decode at once to what each row does.
    rows = [np.array(ids + [tok.eos_id, 300], np.int32), np.array([tok.pad_id] * 3 + ids[:4], np.int32)]
    assert tok.decode_batch([rows[0][:-1], rows[1], rows[1][:0]]) == [text, "12+", ""]
    assert tok.decode(np.array([0xE2, 0x80], np.int32)) == "\ufffd"  # a cut multi-byte character


def test_byte_decode_batch_is_each_rows_decode_and_keeps_rows_apart():
    tok = ByteTokenizer()
    euro = list("€".encode())  # three bytes: a row boundary must not join or split one character
    rows = [np.array(euro[:2], np.int32), np.array(euro[2:] + [65], np.int32),  # one char cut over two rows
            np.array([euro[0], tok.eos_id, euro[1], tok.pad_id, euro[2]], np.int32),  # specials dropped first
            np.array([], np.int32), [66, 300, -1, 67], np.array([[68, 69]], np.int32)]
    assert tok.decode_batch(rows) == [tok.decode(row) for row in rows] == ["\ufffd", "\ufffdA", "€", "", "BC", "DE"]
    random_rows = np.random.default_rng(0).integers(-2, 300, (16, 24)).astype(np.int32)
    cut = [row[:length] for row, length in zip(random_rows, range(0, 24, 3))]
    assert tok.decode_batch(cut) == [tok.decode(row) for row in cut]
    assert tok.decode_batch([]) == []


def test_pad_left_truncates_from_the_left():
    tokens, mask = pad_left([[1, 2, 3], [4], [5, 6, 7, 8, 9]], 4, pad_id=0)
    assert tokens.tolist() == [[0, 1, 2, 3], [0, 0, 0, 4], [6, 7, 8, 9]]
    assert mask.tolist() == [[False, True, True, True], [False, False, False, True], [True] * 4]
    assert tokens.dtype == np.int32


def test_hf_tokenizer_json_loads_through_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["what is 12 plus 5? 12+5=17 #### 17"] * 20, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tokenizer.token_to_id("<|im_end|>")
    assert tok.pad_id == tokenizer.token_to_id("<|endoftext|>")
    ids = tok.encode("12+5=17 #### 17")
    assert tok.decode(ids + [tok.eos_id]) == "12+5=17 #### 17"
    rows = [np.array(ids + [tok.eos_id], np.int32), np.array(tok.encode("what is 12"), np.int64),
            np.array([], np.int32)]
    assert tok.decode_batch(rows) == [tok.decode(row) for row in rows] == ["12+5=17 #### 17", "what is 12", ""]


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
