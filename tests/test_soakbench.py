"""soakbench's greedy check: an answer under load is held to the quiet server's, and counted where it
differs (the bench's exit status is 1 on any)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from benchmarks import soakbench


def server(answers: list[str]) -> httpx.MockTransport:
    """A stand-in for /v1/completions that answers each greedy request with the next of `answers`."""
    queue = list(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert request.url.path == "/v1/completions" and body["temperature"] == 0.0
        assert body["max_tokens"] == soakbench.GREEDY_TOKENS
        return httpx.Response(200, json={"choices": [{"text": queue.pop(0)}]})

    return httpx.MockTransport(handle)


def test_a_greedy_answer_under_load_is_held_to_the_quiet_one():
    question = soakbench.QUESTIONS[0]
    quiet = {q: "Paris." for q in soakbench.QUESTIONS}

    async def ask(answers: list[str]) -> list[soakbench.Result]:
        async with httpx.AsyncClient(transport=server(answers), base_url="http://test") as http:
            assert await soakbench.greedy_text(http, "m", question) == (200, answers[0])
            rng = random.Random(0)
            return [await soakbench.one_request(http, "greedy", rng, "m", quiet) for _ in answers[1:]]

    results = asyncio.run(ask(["Paris.", "Paris.", "Paris, France.", "Paris."]))
    assert [(r.is_right, r.differs) for r in results] == [(True, False), (False, True), (True, False)]
    greedy = next(row for row in soakbench.summarize(results) if row["kind"] == "greedy")
    assert (greedy["requests"], greedy["wrong_answers"], greedy["differ_from_quiet"]) == (3, 1, 1)
