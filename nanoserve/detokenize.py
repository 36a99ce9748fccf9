"""Incremental detokenisation: the text a stream of token ids adds, one step at a time.

Decoding each new token on its own is wrong in two ways. A byte-level BPE token can hold part of a
UTF-8 character (an emoji is often split over two or three tokens), so its text alone is U+FFFD;
and a SentencePiece tokenizer strips the leading space of the first token it decodes, so
"▁world" alone is "world" although it means " world" after "Hello". Decoding the whole sequence
every step is right but costs O(n) per token.

vLLM's answer, used here: decode a short window twice, with and without the new tokens, and emit
only the difference. The window starts at `prefix_offset`, a few tokens before `read_offset` (the
first token whose text has not been emitted), so the decoder sees the context that decides a
leading space. While the window's text ends in U+FFFD the tail is an unfinished character and
nothing is emitted; the offsets move only after a clean emission, so a window always starts on a
character boundary. The deltas concatenate to `tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns output token ids, fed a few at a time, into text deltas.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=...) -> str`, or None (all deltas "").
        skip_special_tokens: passed to every decode, as the engine's own full decode does.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # every id fed so far
        self.prefix_offset = 0  # the decode window starts here (context for the leading space)
        self.read_offset = 0  # text of ids before this index has been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Feeds new ids; returns the text they complete ("" while a character is unfinished)."""
        self.token_ids.extend(int(t) for t in new_token_ids)
        if self.tokenizer is None or self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        # Hold back while the tail is half a character; also when the new ids added no text
        # (a skipped special token), so that the offsets keep a window that decodes to something.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text held back at the end of a sequence (a final U+FFFD the full decode also shows)."""
        if self.tokenizer is None or self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
