"""Streaming: incremental detokenisation, `stream`, and the AsyncEngine front.

The detokeniser's reference is the tokenizer's own decode of the whole id sequence; the streams'
reference is `Engine.generate` on a fresh engine with the same weights (greedy, so the tokens do
not depend on which other requests shared a step).
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import CharTokenizer, make_tiny_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve import SamplingParams
from nanoserve.detokenize import IncrementalDetokenizer
from nanoserve.instruments.load import concurrency
from nanoserve.serving.async_engine import AsyncEngine, EngineDeadError
from nanoserve.serving.streaming import stream

FFFD = "\ufffd"


def deltas_of(tokenizer, ids, chunks=None) -> list[str]:
    """Feeds `ids` in pieces of the given sizes (default one at a time); returns every delta, flush last."""
    detok = IncrementalDetokenizer(tokenizer)
    chunks = chunks or [1] * len(ids)
    out, start = [], 0
    for size in chunks:
        out.append(detok.add(ids[start : start + size]))
        start += size
    assert start == len(ids)
    out.append(detok.flush())
    return out


# ---- detokenisation ------------------------------------------------------------------------------


def test_char_tokenizer_deltas_are_one_char_per_token():
    tok = CharTokenizer(97)
    ids = [3, 4, 40, 2, 96, 5]  # 2 is special (skipped); the rest chr(32 + (i - 3) % 90): 40 -> 'E', 96 -> '#'
    assert deltas_of(tok, ids) == [" ", "!", "E", "", "#", '"', ""]
    assert "".join(deltas_of(tok, ids, [2, 3, 1])) == tok.decode(ids) == ' !E#"'


@pytest.fixture(scope="module")
def llama_style_tokenizer():
    """A SentencePiece-style tokenizer built here: '▁' marks a space, the decoder strips the first
    one, and bytes outside the vocabulary fall back to <0xNN> tokens (Llama's decoder chain)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁": 6,
             "<0xF0>": 7, "<0x9F>": 8, "<0x98>": 9, "<0x80>": 10, "▁and": 11}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_leading_space_and_byte_fallback_emoji(llama_style_tokenizer):
    tok = llama_style_tokenizer
    # Alone, "▁world" decodes to "world": decoding token by token would lose the space.
    assert tok.decode([4]) == "world"
    # F0 9F 98 80 is U+1F600: nothing is emitted until its fourth byte arrives; </s> is skipped.
    ids = [3, 4, 6, 7, 8, 9, 10, 5, 2, 11]
    assert deltas_of(tok, ids) == ["Hello", " world", " ", "", "", "", "😀", "!", "", " and", ""]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world 😀! and"
    # A first token that is a bare "▁" is stripped by the full decode, and so by the deltas.
    assert "".join(deltas_of(tok, [6, 3, 6, 4])) == tok.decode([6, 3, 6, 4]) == " Hello  world"


def test_unfinished_character_at_the_end_is_flushed_as_the_full_decode_shows_it(llama_style_tokenizer):
    tok = llama_style_tokenizer
    deltas = deltas_of(tok, [3, 7, 8])
    assert deltas == ["Hello", "", "", FFFD * 2]  # held back, then flushed: F0 9F never completed
    assert tok.decode([3, 7, 8]) == "Hello" + FFFD * 2


@pytest.fixture(scope="module")
def smol_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.weights
def test_real_tokenizer_emoji_split_over_two_tokens(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("Hello 😀")
    assert len(ids) == 3  # "Hello", then the emoji's bytes over two byte-level tokens
    assert tok.decode(ids[1:2]).endswith(FFFD)  # the middle token alone is half a character
    assert deltas_of(tok, ids) == ["Hello", "", " 😀", ""]


TEXTS = ["  leading spaces", "Hello 😀 world", "世界 and 漢字", "naïve café", "👨‍👩‍👧 family\n\ttab",
         "🇺🇸🇫🇷", " a  b   c", "end with emoji 🎉"]


@pytest.mark.weights
@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(st.lists(st.sampled_from(TEXTS), min_size=1, max_size=3), st.randoms(use_true_random=False))
def test_real_tokenizer_deltas_concatenate_to_the_text(smol_tokenizer, parts, rng):
    tok = smol_tokenizer
    text = "".join(parts)
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # the reference: byte-level BPE round-trips
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(min(rng.randint(1, 3), len(ids) - sum(chunks)))
    deltas = deltas_of(tok, ids, chunks)
    assert "".join(deltas) == text
    assert not any(FFFD in d for d in deltas)  # never half a character


@pytest.mark.weights
@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=12))
def test_real_tokenizer_arbitrary_ids_concatenate_to_the_full_decode(smol_tokenizer, ids):
    # Arbitrary ids include special tokens and stray UTF-8 continuation bytes: whatever the full
    # decode says (U+FFFD included), the deltas say the same.
    assert "".join(deltas_of(smol_tokenizer, ids)) == smol_tokenizer.decode(ids, skip_special_tokens=True)


# ---- stream(): one caller driving the engine -------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["hello", "abc", "the cat sat", "zz", "q", "paged attention", "xyzzy", "0123456789"]


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of each prompt run alone on its own engine."""
    engine = make_tiny_engine()
    out = {}
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True)
        (result,) = engine.generate([prompt], params)
        out[prompt] = (params, result.token_ids, result.text)
    return out


def test_stream_deltas_concatenate_to_generate(reference):
    engine = make_tiny_engine()
    params, want_ids, want_text = reference["hello"]
    deltas = list(stream(engine, "hello", params))
    assert [len(d.token_ids) for d in deltas] == [1] * len(want_ids)  # one token per step
    assert [t for d in deltas for t in d.token_ids] == want_ids
    assert "".join(d.text for d in deltas) == want_text == CharTokenizer(97).decode(want_ids)
    assert [d.finished for d in deltas] == [False] * (len(want_ids) - 1) + [True]
    assert deltas[-1].finish_reason == "length" and deltas[-1].output.token_ids == want_ids
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_stream_closed_early_aborts_and_frees_blocks():
    engine = make_tiny_engine()
    it = stream(engine, "hello", GREEDY)
    next(it), next(it)
    assert engine.allocator.num_free < engine.allocator.num_blocks
    it.close()
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_stream_rejects_bad_input_at_the_call():
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="prompt is empty"):
        stream(engine, "", GREEDY)


# ---- AsyncEngine -----------------------------------------------------------------------------------


def test_async_engine_many_coroutines_each_get_their_own_tokens(reference):
    engine = make_tiny_engine()  # max_num_seqs=4 < 8 prompts: some wait for a slot
    finished = []
    front = AsyncEngine(engine, on_finished=finished.append)

    async def one(prompt: str, delay: float):
        await asyncio.sleep(delay)
        ids, text, reasons = [], "", []
        async for delta in front.generate(prompt, reference[prompt][0]):
            ids += delta.token_ids
            text += delta.text
            reasons.append(delta.finish_reason)
        return prompt, ids, text, reasons

    async def main():
        results = await asyncio.gather(*(one(p, 0.002 * (i % 3)) for i, p in enumerate(PROMPTS)))
        await front.shutdown()
        return results

    for prompt, ids, text, reasons in asyncio.run(main()):
        _, want_ids, want_text = reference[prompt]
        assert ids == want_ids, prompt
        assert text == want_text, prompt
        assert reasons == [None] * (len(want_ids) - 1) + ["length"]
    assert len({o.request_id for o in finished}) == len(PROMPTS) and engine.requests == {}
    # The coroutines really overlapped: all four slots were busy at once.
    assert concurrency(finished).max_running == 4
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_async_engine_cancelled_consumer_aborts_while_others_finish(reference):
    engine = make_tiny_engine()
    finished = []
    front = AsyncEngine(engine, on_finished=finished.append)
    long_params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        got = []

        async def endless():
            async for delta in front.generate("hello", long_params):
                got.append(delta)

        async def closer():  # stops iterating from the inside: aclose() runs the abort
            gen = front.generate("abc", long_params)
            await gen.__anext__()
            await gen.aclose()

        task = asyncio.create_task(endless())
        other = asyncio.create_task(collect(front, "the cat sat", reference["the cat sat"][0]))
        while len(got) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await closer()
        ids = await other
        for _ in range(2000):  # the aborts land between two steps
            if not engine.requests:
                break
            await asyncio.sleep(0.001)
        await front.shutdown()
        return ids

    ids = asyncio.run(main())
    assert ids == reference["the cat sat"][1]
    reasons = sorted(o.finish_reason for o in finished)
    assert reasons == ["abort", "abort", "length"]
    assert all(len(o.token_ids) < 200 for o in finished if o.finish_reason == "abort")
    assert engine.requests == {} and engine.allocator.num_free == engine.allocator.num_blocks


async def collect(front: AsyncEngine, prompt, params) -> list[int]:
    return [t async for d in front.generate(prompt, params) for t in d.token_ids]


def test_async_engine_bad_request_raises_and_the_loop_keeps_serving(reference):
    engine = make_tiny_engine()
    front = AsyncEngine(engine)

    async def main():
        stream_ = await front.add_request("abc", reference["abc"][0])
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await front.add_request("x" * 250, SamplingParams(max_tokens=16))
        ids = [t async for d in stream_ for t in d.token_ids]
        await front.shutdown()
        return ids, stream_.prompt_token_ids

    ids, prompt_ids = asyncio.run(main())
    assert ids == reference["abc"][1]
    assert prompt_ids == CharTokenizer(97).encode("abc")


def test_async_engine_failed_step_fails_every_consumer():
    engine = make_tiny_engine()
    front = AsyncEngine(engine)

    def broken_step():
        raise RuntimeError("boom")

    engine.step = broken_step

    async def main():
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(front, "abc", GREEDY)
        with pytest.raises(EngineDeadError):
            await front.add_request("abc", GREEDY)
        assert not front.is_running

    asyncio.run(main())


# ---- sampling controls seen through a stream: stop strings, n > 1, logprobs -------------------------


def test_stop_string_cuts_the_streamed_text_where_generate_cuts_it(reference):
    params, want_ids, want_text = reference["the cat sat"]  # 8 tokens, one character each
    stop = want_text[3:5]
    cut = want_text[: want_text.find(stop)]  # the text ends before the first match, by hand
    with_stop = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, stop=(stop,))
    (ref,) = make_tiny_engine().generate(["the cat sat"], with_stop)
    assert ref.text == cut and ref.finish_reason == "stop"
    deltas = list(stream(make_tiny_engine(), "the cat sat", with_stop))
    assert "".join(d.text for d in deltas) == cut
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids  # ids include the matched ones
    # One character is held back (the stop is two long) until the next token shows it is safe.
    assert [d.text for d in deltas[:-1]] == [""] + list(cut[: len(deltas) - 2])

    async def via_async():
        front = AsyncEngine(make_tiny_engine())
        text = "".join([d.text async for d in front.generate("the cat sat", with_stop)])
        await front.shutdown()
        return text

    assert asyncio.run(via_async()) == cut


def test_n_copies_stream_apart_by_index_and_equal_generate():
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=8, ignore_eos=True, logprobs=2)
    want = make_tiny_engine().generate(["hello"], params)
    assert [o.index for o in want] == [0, 1, 2] and len({tuple(o.token_ids) for o in want}) > 1

    def gather(deltas):
        by_index = {}
        for d in deltas:
            ids, text, logprobs, reasons = by_index.setdefault(d.index, ([], [], [], []))
            ids += d.token_ids
            text.append(d.text)
            logprobs += d.logprobs
            reasons.append(d.finish_reason)
        return by_index

    async def via_async():
        front = AsyncEngine(make_tiny_engine())
        deltas = [d async for d in front.generate("hello", params)]
        await front.shutdown()
        return deltas

    for deltas in (list(stream(make_tiny_engine(), "hello", params)), asyncio.run(via_async())):
        assert {d.request_id for d in deltas} == {deltas[0].output.parent_id}
        by_index = gather(deltas)
        assert sorted(by_index) == [0, 1, 2]
        for out in want:
            ids, text, logprobs, reasons = by_index[out.index]
            assert ids == out.token_ids and "".join(text) == out.text
            assert logprobs == out.logprobs and len(logprobs) == 8
            assert reasons == [None] * 7 + ["length"]


def test_cancelled_n_copies_are_all_aborted():
    engine = make_tiny_engine()
    finished = []
    front = AsyncEngine(engine, on_finished=finished.append)
    params = SamplingParams(temperature=0.0, n=3, max_tokens=100, ignore_eos=True)

    async def main():
        gen = front.generate("hello", params)
        for _ in range(4):
            await gen.__anext__()
        await gen.aclose()
        for _ in range(2000):
            if not engine.requests:
                break
            await asyncio.sleep(0.001)
        await front.shutdown()

    asyncio.run(main())
    assert sorted(o.index for o in finished) == [0, 1, 2]
    assert [o.finish_reason for o in finished] == ["abort"] * 3
    assert engine.requests == {} and engine.allocator.num_free == engine.allocator.num_blocks

    sync_engine = make_tiny_engine()
    it = stream(sync_engine, "hello", params)
    next(it), next(it)
    it.close()
    assert sync_engine.requests == {} and sync_engine.allocator.num_free == sync_engine.allocator.num_blocks
