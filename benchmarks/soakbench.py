"""soakbench: the real server under a long mixed load, for what breaks only with time.

Starts `nanoserve serve` on the embedded default model at its default precision (or drives
`--url`), then runs `--clients` concurrent clients for `--duration-s` seconds. Each client loops,
picking a kind of request at random from the mix:

- plain: a non-streamed completion;
- greedy: a non-streamed completion at temperature 0, whose text must equal the answer the same
  question got from the quiet server before the load began (the engine is batch invariant: what
  else it runs must not change an answer);
- stream: a streamed chat completion, read to [DONE];
- structured: a chat completion with `response_format` json_schema (nested objects, an enum, an
  array), whose content must parse as JSON and match the schema's shape;
- tool: a chat completion with two tools and `tool_choice="required"`, whose tool call arguments
  must parse as JSON (these two at temperature 0.5; one that max_tokens cut is counted as cut,
  not as wrong);
- disconnect (10%): a streamed chat completion the client drops after its second chunk;
- malformed (5%): a body the server must answer with a 4xx (bad JSON, a temperature of -1, an
  unknown model, max_tokens past the context).

Every request is one CSV row (kind, HTTP status, seconds, whether the answer was right). The table
counts requests, 2xx/4xx/5xx and wrong answers per kind; then, with every client stopped and the
server idle, the KV blocks still in use (from /metrics) and the server's resident memory, sampled
every 5 s, in the first and the last minute. A healthy run has no 5xx, no wrong answers, no greedy
answer that differs from the quiet one and no blocks in use; the exit status is 1 on a 5xx or on
any such differing answer.

    python benchmarks/soakbench.py                       # 32 clients, 10 minutes
    python benchmarks/soakbench.py --clients 4 --duration-s 20    # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from nanoserve.instruments.csv_writer import write_csv
from nanoserve.serving.server.metrics import parse_text

ROOT = Path(__file__).resolve().parent.parent

KINDS = ("plain", "greedy", "stream", "structured", "tool", "disconnect", "malformed")
DEFAULT_MIX = {"plain": 0.10, "greedy": 0.15, "stream": 0.25, "structured": 0.175, "tool": 0.175, "disconnect": 0.10,
               "malformed": 0.05}
GREEDY_TOKENS = 32

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.", "List two uses of Python.", "Who wrote Hamlet?",
    "Describe a cat to someone who has never seen one.", "Give me a short tip for sleeping well.",
]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["student", "teacher", "engineer"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]


@dataclass
class Result:
    kind: str
    status: int  # HTTP status; 0: no response (a transport error)
    seconds: float
    is_right: bool  # the answer has the shape its kind asks for (a 4xx for malformed)
    error: str = ""
    is_cut: bool = False  # finish_reason "length": max_tokens ended it, not a wrong answer
    differs: bool = False  # greedy: answered, but not as the quiet server answered


async def greedy_text(http: httpx.AsyncClient, model: str, question: str) -> tuple[int, str | None]:
    r = await http.post("/v1/completions", json={"model": model, "prompt": question, "max_tokens": GREEDY_TOKENS,
                                                  "temperature": 0.0})
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else None


async def quiet_answers(base: str, model: str) -> dict[str, str]:
    """Each question's greedy answer from the server with nothing else running."""
    answers = {}
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0)) as http:
        for question in QUESTIONS:
            status, text = await greedy_text(http, model, question)
            if text is None:
                raise RuntimeError(f"the quiet server answered {question!r} with HTTP {status}")
            answers[question] = text
    return answers


def structured_ok(content: str) -> bool:
    try:
        value = json.loads(content)
    except (TypeError, ValueError):
        return False
    required = PERSON_SCHEMA["required"]
    return (isinstance(value, dict) and all(k in value for k in required) and isinstance(value["age"], int)
            and value["role"] in PERSON_SCHEMA["properties"]["role"]["enum"]
            and isinstance(value["address"], dict) and isinstance(value["address"].get("city"), str)
            and isinstance(value["skills"], list) and all(isinstance(s, str) for s in value["skills"]))


def tool_ok(message: dict) -> bool:
    calls = message.get("tool_calls") or []
    names = {t["function"]["name"] for t in TOOLS}
    try:
        return bool(calls) and all(c["function"]["name"] in names and isinstance(json.loads(c["function"]["arguments"]), dict)
                                   for c in calls)
    except (KeyError, TypeError, ValueError):
        return False


def malformed_body(rng: random.Random, model: str) -> tuple[str, bytes]:
    question = rng.choice(QUESTIONS)
    good = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 8}
    choice = rng.randrange(4)
    if choice == 0:
        return "/v1/chat/completions", b'{"model": "x", "messages": [}'
    bad = dict(good)
    if choice == 1:
        bad["temperature"] = -1
    elif choice == 2:
        bad["model"] = "no-such-model"
    else:
        bad["max_tokens"] = 10**9
    return "/v1/chat/completions", json.dumps(bad).encode()


async def one_request(http: httpx.AsyncClient, kind: str, rng: random.Random, model: str,
                      quiet: dict[str, str]) -> Result:
    question = rng.choice(QUESTIONS)
    messages = [{"role": "user", "content": question}]
    start = time.perf_counter()
    status, is_right, is_cut, error, differs = 0, False, False, "", False
    try:
        if kind == "greedy":
            status, text = await greedy_text(http, model, question)
            is_right = text == quiet[question]
            differs = text is not None and not is_right
        elif kind == "plain":
            r = await http.post("/v1/completions", json={"model": model, "prompt": question, "max_tokens": 32})
            status = r.status_code
            is_right = status == 200 and isinstance(r.json()["choices"][0]["text"], str)
        elif kind == "structured":
            r = await http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Describe a person as JSON."}],
                "max_tokens": 256, "temperature": 0.5, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "person", "schema": PERSON_SCHEMA, "strict": True}}})
            status = r.status_code
            choice = r.json()["choices"][0] if status == 200 else {}
            is_cut = choice.get("finish_reason") == "length"
            is_right = status == 200 and structured_ok(choice["message"]["content"])
        elif kind == "tool":
            r = await http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "max_tokens": 256, "temperature": 0.5, "tools": TOOLS, "tool_choice": "required"})
            status = r.status_code
            choice = r.json()["choices"][0] if status == 200 else {}
            is_cut = choice.get("finish_reason") == "length"
            is_right = status == 200 and tool_ok(choice["message"])
        elif kind in ("stream", "disconnect"):
            body = {"model": model, "messages": messages, "max_tokens": 48, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                status = r.status_code
                num_chunks, done = 0, False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    num_chunks += 1
                    if kind == "disconnect" and num_chunks == 2:
                        break  # leaving the block closes the connection mid-stream
                is_right = status == 200 and (done or (kind == "disconnect" and num_chunks == 2))
        else:
            path, raw = malformed_body(rng, model)
            r = await http.post(path, content=raw, headers={"content-type": "application/json"})
            status = r.status_code
            is_right = 400 <= status < 500
    except (httpx.HTTPError, KeyError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"[:200]
    return Result(kind, status, time.perf_counter() - start, is_right, error, is_cut and not is_right, differs)


async def client_loop(base: str, model: str, seed: int, deadline: float, mix: dict[str, float],
                      results: list[Result], quiet: dict[str, str]) -> None:
    rng = random.Random(seed)
    kinds, weights = list(mix), list(mix.values())
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0)) as http:
        while time.perf_counter() < deadline:
            results.append(await one_request(http, rng.choices(kinds, weights)[0], rng, model, quiet))


async def sample_rss(pid: int | None, deadline: float, samples: list[tuple[float, float]]) -> None:
    if pid is None:
        return
    import psutil

    proc, start = psutil.Process(pid), time.perf_counter()
    while time.perf_counter() < deadline:
        samples.append((time.perf_counter() - start, proc.memory_info().rss / 2**20))
        await asyncio.sleep(5.0)


def metrics_of(base: str) -> dict[str, float]:
    return parse_text(httpx.get(base + "/metrics", timeout=30).text)


def wait_idle(base: str, timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.perf_counter() + timeout_s
    while True:
        m = metrics_of(base)
        if (m.get("nanoserve_num_requests_running", 0) == 0 and m.get("nanoserve_num_requests_waiting", 0) == 0) \
                or time.perf_counter() > deadline:
            return m
        time.sleep(0.5)


def start_server(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanoserve", "serve", "--port", str(port), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base, deadline = f"http://127.0.0.1:{port}", time.perf_counter() + 300
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within 300 s; see {log}")


def summarize(results: list[Result]) -> list[dict]:
    rows = []
    for kind in (*KINDS, "all"):
        mine = [r for r in results if kind in ("all", r.kind)]
        rows.append({
            "kind": kind, "requests": len(mine),
            "status_2xx": sum(200 <= r.status < 300 for r in mine),
            "status_4xx": sum(400 <= r.status < 500 for r in mine),
            "status_5xx": sum(r.status >= 500 for r in mine),
            "no_response": sum(r.status == 0 for r in mine),
            "wrong_answers": sum(not r.is_right and not r.is_cut for r in mine),
            "differ_from_quiet": sum(r.differs for r in mine),
            "cut_by_max_tokens": sum(r.is_cut for r in mine),
            "median_s": round(sorted(r.seconds for r in mine)[len(mine) // 2], 3) if mine else None,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="drive a running server instead of starting one")
    parser.add_argument("--model", default=None, help="the model id to send (default: the server's first)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="extra `nanoserve serve` flags, one string")
    parser.add_argument("--out", default="runs/soakbench.csv")
    args = parser.parse_args(argv)

    proc = None
    if args.url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        log = Path(args.out).with_suffix(".server.log")
        proc = start_server(port, args.server_args.split(), log)
        base = f"http://127.0.0.1:{port}"
    else:
        base = args.url.rstrip("/")
    try:
        model = args.model or httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        results: list[Result] = []
        rss: list[tuple[float, float]] = []

        async def run() -> None:
            quiet = await quiet_answers(base, model)
            deadline = time.perf_counter() + args.duration_s
            await asyncio.gather(sample_rss(proc.pid if proc else None, deadline, rss),
                                 *(client_loop(base, model, args.seed + i, deadline, DEFAULT_MIX, results, quiet)
                                   for i in range(args.clients)))

        asyncio.run(run())
        idle = wait_idle(base)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

    rows = summarize(results)
    print(f"soakbench: {args.clients} clients for {args.duration_s:.0f} s against {base} ({model}), pid {os.getpid()}")
    print(f"{'kind':<11}{'requests':>9}{'2xx':>7}{'4xx':>6}{'5xx':>6}{'no resp':>8}{'wrong':>7}{'cut':>5}"
          f"{'differ':>7}{'median s':>10}")
    for row in rows:
        print(f"{row['kind']:<11}{row['requests']:>9}{row['status_2xx']:>7}{row['status_4xx']:>6}{row['status_5xx']:>6}"
              f"{row['no_response']:>8}{row['wrong_answers']:>7}{row['cut_by_max_tokens']:>5}{row['differ_from_quiet']:>7}"
              f"{row['median_s'] or 0:>10.3f}")
    greedy = rows[KINDS.index("greedy")]
    print(f"greedy answers that differ from the quiet server's: {greedy['differ_from_quiet']} of {greedy['requests']}")
    used = idle.get("nanoserve_kv_blocks_used")
    print(f"KV blocks in use after the run: {used:.0f} of {idle.get('nanoserve_kv_blocks_total', 0):.0f}"
          if used is not None else "KV blocks in use: /metrics has no nanoserve_kv_blocks_used")
    first = [m for t, m in rss if t < 60]
    last = [m for t, m in rss if t >= rss[-1][0] - 60] if rss else []
    if first and last:
        print(f"server RSS: first minute {min(first):.0f}-{max(first):.0f} MiB, last minute {min(last):.0f}-{max(last):.0f} MiB")
    for r in [r for r in results if r.error][:5]:
        print(f"  e.g. {r.kind}: {r.error}")
    write_csv(args.out, [{"kind": r.kind, "status": r.status, "seconds": round(r.seconds, 6), "is_right": r.is_right,
                          "is_cut": r.is_cut, "differs": r.differs, "error": r.error} for r in results])
    write_csv(Path(args.out).with_suffix(".summary.csv"), rows)
    write_csv(Path(args.out).with_suffix(".rss.csv"), [{"t_s": round(t, 1), "rss_mib": round(m, 1)} for t, m in rss])
    print(f"wrote {args.out}")
    return 1 if any(row["status_5xx"] or row["differ_from_quiet"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
