"""nanoserve/detokenize.py: deltas worked out by hand on byte and SentencePiece stand-ins, then
the real default model's tokenizer, whose full decode is the reference for every split."""

from __future__ import annotations

import pytest

from nanoserve.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer

SPECIAL = 256  # the byte tokenizer's one special token


class ByteTokenizer:
    """Ids 0..255 are raw UTF-8 bytes, as a byte-level BPE's smallest tokens are."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i == SPECIAL:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                if not skip_special_tokens:
                    out.append("<eos>")
            else:
                run.append(i)
        return "".join(out) + run.decode("utf-8", errors="replace")


class PieceTokenizer:
    """SentencePiece's habit: "▁" is a space, and the decoded text's first space is dropped."""

    pieces = ["▁Hello", "▁world", "!", "▁", "x"]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = "".join(self.pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def utf8(text: str) -> list[int]:
    return list(text.encode())


def test_a_character_split_over_tokens_is_held_until_it_is_whole():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert utf8("a€") == [0x61, 0xE2, 0x82, 0xAC]
    assert [detok.add([b]) for b in utf8("a€")] == ["a", "", "", "€"]
    assert detok.text == "a€"


def test_several_tokens_at_once_and_a_four_byte_emoji():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.add(utf8("hé")) == "hé"
    assert detok.add(utf8("😀")[:3]) == ""
    assert detok.add(utf8("😀")[3:] + utf8("中")) == "😀中"
    assert detok.text == "hé😀中" and detok.flush() == ""


def test_a_skipped_special_token_adds_nothing_and_breaks_nothing():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert [detok.add([t]) for t in [0x61, SPECIAL, 0x62]] == ["a", "", "b"]
    assert detok.text == "ab"
    shown = IncrementalDetokenizer(ByteTokenizer(), skip_special_tokens=False)
    assert [shown.add([t]) for t in [0x61, SPECIAL, 0x62]] == ["a", "<eos>", "b"]


def test_flush_emits_an_unfinished_tail_as_the_full_decode_does():
    detok = IncrementalDetokenizer(ByteTokenizer())
    ids = utf8("ok") + utf8("😀")[:2]
    assert [detok.add([t]) for t in ids] == ["o", "k", "", ""]
    assert detok.flush() == REPLACEMENT_CHAR  # b"\xf0\x9f" decodes to one U+FFFD
    assert detok.text == ByteTokenizer().decode(ids) == "ok" + REPLACEMENT_CHAR
    assert detok.flush() == ""


def test_the_leading_space_of_a_later_token_is_kept():
    detok = IncrementalDetokenizer(PieceTokenizer())
    # Decoded alone, "▁world" would be "world": the window's context keeps its space.
    assert PieceTokenizer().decode([1]) == "world"
    assert [detok.add([t]) for t in [0, 1, 2, 3, 4]] == ["Hello", " world", "!", " ", "x"]
    assert detok.text == PieceTokenizer().decode([0, 1, 2, 3, 4]) == "Hello world! x"


def test_no_tokenizer_gives_empty_deltas():
    detok = IncrementalDetokenizer(None)
    assert detok.add([1, 2, 3]) == "" and detok.flush() == "" and detok.text == ""
    assert detok.token_ids == [1, 2, 3]


# ---- the default model's tokenizer ----------------------------------------------------------------

TEXTS = [
    "Hello, world! The café is naïve.",
    "   three leading spaces, then  two inside",
    " one leading space",
    "Emoji: 😀🎉 and a family 👨‍👩‍👧 and a flag 🇫🇷.",
    "中文文本：你好，世界。日本語もある。",
    "Mixed 한국어 and Ελληνικά and עברית with 🤖\nnewlines\n\n and\ttabs",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def deltas(tokenizer, ids: list[int], chunk: int) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    out = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    out.append(detok.flush())
    assert detok.text == "".join(out)
    return out


@pytest.mark.weights
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_deltas_concatenate_to_the_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text  # the reference round-trips
    parts = deltas(tokenizer, ids, chunk)
    assert "".join(parts) == full
    assert not any(REPLACEMENT_CHAR in p for p in parts)  # no half character ever escapes


@pytest.mark.weights
def test_the_real_tokenizer_really_splits_characters_over_tokens(tokenizer):
    # Without this the multi-byte cases above would prove nothing: some token alone is half a character.
    ids = tokenizer.encode(TEXTS[3] + TEXTS[4], add_special_tokens=False)
    assert any(tokenizer.decode([i]).endswith(REPLACEMENT_CHAR) for i in ids)
    parts = deltas(tokenizer, ids, 1)
    assert "" in parts[:-1]  # and the detokenizer held something back


@pytest.mark.weights
def test_special_tokens_in_the_stream_are_skipped_like_the_full_decode(tokenizer):
    ids = tokenizer.encode("Hi 😀", add_special_tokens=False)
    ids = ids + [tokenizer.eos_token_id] + tokenizer.encode(" there", add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == "Hi 😀 there"
    assert "".join(deltas(tokenizer, ids, 1)) == full
