"""Embeddings (PoolingParams, Engine.embed, POST /v1/embeddings): the prompt's final-normed hidden
states pooled (last token, mean, first token), L2-normalised where asked. Held to transformers'
own model.model(...).last_hidden_state over the same tokens, pooled by hand, through chunked
prompts, deferred output, preemption and generation requests in the same steps (whose tokens
stay what they are without them); the checkpoint's pooling read from a sentence-transformers
modules.json (Qwen3-Embedding's shape: last token, Normalize) and a GGUF's pooling_type; the
server through the official openai client."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import CharTokenizer, config_of, greedy, make_hf_model, nanoserve_model_from_hf

from nanoserve import Engine, PoolingParams
from nanoserve.inputs import TokenRun, lay_out
from nanoserve.model import default
from nanoserve.model.weights import checkpoint_source
from nanoserve.parallel import TensorParallelModel
from nanoserve.pooling import DEFAULT_POOLING, checkpoint_pooling, gguf_pooling

PROMPTS = [[5, 9, 13, 22, 7, 41, 3, 8, 60, 33, 21], [17, 4], [30 + i % 50 for i in range(40)], [11]]


@pytest.fixture(scope="module")
def hf():
    return make_hf_model("qwen3", seed=5)


def reference(hf, prompt: list[int], pooling: str, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """transformers' last_hidden_state (the final norm's output) at the pooled rows, by hand."""
    with torch.no_grad():
        h = hf.model(torch.tensor([prompt])).last_hidden_state[0].double()  # [P, E]
    vector = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[pooling]
    vector = vector if dimensions is None else vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_close(got, expected: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float64)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5, (got, expected)
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0).item() >= 0.99999


def engine_of(hf, pooling: PoolingParams | None = None, **config) -> Engine:
    config = config_of(**({"dtype": "float32", "quantization": None, "block_size": 4, "num_kv_blocks": 64,
                           "max_num_seqs": 4} | config))
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config, pooling)


def assert_all_blocks_free(engine: Engine) -> None:
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert not engine.requests


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 7},  # long prompts in chunks: a mean sums each chunk's rows as they come
    {"deferred_output": True, "max_num_batched_tokens": 7},  # the vector comes home a step later
    {"batch_invariant": True, "max_num_batched_tokens": 7},  # every step's layers in C (fused_decode.c)
])
def test_embeddings_equal_transformers(hf, pooling, config):
    engine = engine_of(hf, **config)
    for normalize in (False, True):
        outputs = engine.embed(PROMPTS, pooling=pooling, normalize=normalize)
        for out, prompt in zip(outputs, PROMPTS, strict=True):
            assert_close(out.embedding, reference(hf, prompt, pooling, normalize))
            assert out.finished and out.finish_reason == "stop"
            assert list(out.prompt_token_ids) == prompt and len(out.token_ids) == 0
    assert_all_blocks_free(engine)


def test_no_head_is_run_for_embedding_rows(hf, monkeypatch):
    engine = engine_of(hf, max_num_batched_tokens=7)
    head, rows = engine.model.lm_head_weight, []

    def counted(x):
        rows.append(x.shape[0])
        return head(x)

    monkeypatch.setattr(engine.model, "lm_head_weight", counted)
    engine.embed(PROMPTS, pooling="mean")
    assert rows and set(rows) == {0}  # every step ran the head on no row at all
    engine.generate([PROMPTS[1]], greedy(3))
    assert rows[-3:] == [1, 1, 1]  # and a generation's rows still go through it


def test_dimensions_cut_the_vector_and_normalise_it_again(hf):
    engine = engine_of(hf)
    (out,) = engine.embed([PROMPTS[0]], pooling="mean", dimensions=5)
    assert len(out.embedding) == 5
    assert_close(out.embedding, reference(hf, PROMPTS[0], "mean", True, dimensions=5))
    with pytest.raises(ValueError, match="dimensions=40 exceeds the model's hidden size 32"):
        engine.embed([PROMPTS[0]], dimensions=40)
    with pytest.raises(ValueError, match="dimensions=5 needs normalize=True"):
        engine.embed([PROMPTS[0]], normalize=False, dimensions=5)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("bad", [{"pooling": "max"}, {"normalize": 1}, {"dimensions": 0}, {"dimensions": True}])
def test_bad_pooling_params_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PoolingParams(**bad)


def test_an_embedding_prompt_over_max_model_len_is_refused(hf):
    engine = engine_of(hf, max_model_len=16)
    engine.embed([[5] * 16])  # the prompt alone counts: nothing is generated after it
    with pytest.raises(ValueError, match=r"prompt \(17 tokens\) exceeds max_model_len=16"):
        engine.embed([[5] * 17])
    assert_all_blocks_free(engine)


class ForwardLog:
    """Wraps a model's forward: for each step, (rows that sample, rows pooled)."""

    def __init__(self, model) -> None:
        self.steps: list[tuple[int, int]] = []
        self.forward = model.forward

    def __call__(self, inputs, kv):
        pooled = inputs.pooled_indices
        self.steps.append((inputs.logits_indices.shape[0], 0 if pooled is None else pooled.shape[0]))
        return self.forward(inputs, kv)


@pytest.mark.parametrize("deferred", [False, True])
def test_embeddings_beside_generation_preempted_and_in_chunks(hf, monkeypatch, deferred):
    """Two long generations admitted first, then embedding requests whose prompts come in chunks:
    the pool runs short as the generations grow, the most recent admissions (the embeddings) are
    preempted and forward their prompts again, a mean pooling each row once."""
    config = {"num_kv_blocks": 20, "max_num_batched_tokens": 4, "deferred_output": deferred}
    generations = [[3, 14, 15, 92, 6], [27, 18, 28, 18, 28]]
    embeddings = [(PROMPTS[2], "mean"), ([40 + i % 30 for i in range(37)], "last"), (PROMPTS[0], "cls"),
                  ([8 + i % 70 for i in range(33)], "mean")]
    engine = engine_of(hf, **config)
    log = ForwardLog(engine.model)
    monkeypatch.setattr(engine.model, "forward", log)
    params = [greedy(48)] * 2 + [PoolingParams(pooling, normalize=False) for _, pooling in embeddings]
    outputs = engine.generate(generations + [prompt for prompt, _ in embeddings], params)
    for out, (prompt, pooling) in zip(outputs[2:], embeddings, strict=True):
        assert_close(out.embedding, reference(hf, prompt, pooling, False))
    assert sum(out.num_preemptions for out in outputs[2:]) > 0
    assert any(sampled and pooled for sampled, pooled in log.steps)  # both kinds in one step
    assert all(out.embedding is None for out in outputs[:2])
    alone = engine_of(hf, **config).generate(generations, greedy(48))
    assert [out.token_ids for out in outputs[:2]] == [out.token_ids for out in alone]
    assert_all_blocks_free(engine)


def test_a_tensor_parallel_model_refuses_embeddings_by_name(hf):
    engine = engine_of(hf)
    step = lay_out([TokenRun([5, 6, 7], 0, [0], 1, pooled=(0, 3))], 4, torch.device("cpu"))
    assert step.pooled_indices.tolist() == [0, 1, 2] and step.logits_indices.tolist() == [2]
    # the refusal comes before the group is touched: any model's weights will do
    with pytest.raises(ValueError, match="embedding requests"):
        TensorParallelModel.forward(engine.model, step, engine.kv)
    engine.model.__class__ = TensorParallelModel  # as rank 0's model looks to the engine
    with pytest.raises(ValueError, match="embedding requests \\(PoolingParams\\) are not served with tensor_parallel"):
        engine.embed([PROMPTS[0]])
    assert_all_blocks_free(engine)


def test_an_aborted_embedding_returns_its_blocks(hf):
    engine = engine_of(hf, max_num_batched_tokens=8)
    rid = engine.add_request(PROMPTS[2], PoolingParams("mean"))
    engine.step()  # its first chunk
    assert engine.requests[rid].block_ids
    (out,) = engine.abort(rid)
    assert out.finish_reason == "abort" and out.embedding is None
    assert_all_blocks_free(engine)


def test_a_prefix_cache_hit_serves_last_pooling_and_not_mean(hf):
    engine = engine_of(hf, enable_prefix_caching=True)
    prompt = PROMPTS[2]
    engine.generate([prompt], greedy(2))
    last, mean = engine.generate([prompt, prompt], [PoolingParams("last"), PoolingParams("mean")])
    assert last.num_cached_tokens > 0 and mean.num_cached_tokens == 0
    assert_close(last.embedding, reference(hf, prompt, "last", True))
    assert_close(mean.embedding, reference(hf, prompt, "mean", True))


# ---- the checkpoint's own pooling ------------------------------------------------------------------------


def write_sentence_transformers(directory: Path, flags: dict[str, bool], normalize: bool) -> None:
    """sentence-transformers' modules.json: Transformer, Pooling (1_Pooling/config.json), Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False} | flags
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def qwen3_embedding_dir(hf, tmp_path_factory) -> Path:
    """The tiny Qwen3 saved as Qwen3-Embedding is: last-token pooling, then Normalize."""
    directory = tmp_path_factory.mktemp("qwen3-embedding")
    hf.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default.default_model_dir() / name, directory / name)
    write_sentence_transformers(directory, {"pooling_mode_lasttoken": True}, normalize=True)
    return directory


def test_from_pretrained_pools_as_the_checkpoint_says(hf, qwen3_embedding_dir):
    engine = Engine.from_pretrained(qwen3_embedding_dir, config_of(dtype="float32", quantization=None,
                                                                   num_kv_blocks=32, block_size=4))
    assert engine.pooling == PoolingParams("last", normalize=True)
    outputs = engine.embed(PROMPTS[:2])
    for out, prompt in zip(outputs, PROMPTS[:2], strict=True):
        assert_close(out.embedding, reference(hf, prompt, "last", True))
    if importlib.util.find_spec("sentence_transformers") is None:
        return  # not installed: the hand-pooled reference above is the check
    import sentence_transformers

    st = sentence_transformers.SentenceTransformer(str(qwen3_embedding_dir), device="cpu")
    with torch.no_grad():
        features = st({"input_ids": torch.tensor([PROMPTS[0]]), "attention_mask": torch.ones(1, len(PROMPTS[0]))})
    assert_close(outputs[0].embedding, features["sentence_embedding"][0].double())


@pytest.mark.parametrize(("flags", "normalize", "expected"), [
    ({"pooling_mode_lasttoken": True}, True, PoolingParams("last", True)),
    ({"pooling_mode_mean_tokens": True}, False, PoolingParams("mean", False)),
    ({"pooling_mode_cls_token": True}, True, PoolingParams("cls", True)),
])
def test_sentence_transformers_pooling_is_read(tmp_path, flags, normalize, expected):
    write_sentence_transformers(tmp_path, flags, normalize)
    assert checkpoint_pooling(tmp_path, False) == expected


@pytest.mark.parametrize("flags", [{"pooling_mode_max_tokens": True}, {},
                                   {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}])
def test_a_pooling_config_nanoserve_cannot_serve_is_refused_by_name(tmp_path, flags):
    write_sentence_transformers(tmp_path, flags, normalize=False)
    with pytest.raises(ValueError, match="exactly one of"):
        checkpoint_pooling(tmp_path, False)


def test_a_checkpoint_without_sentence_transformers_config_pools_the_last_token(tmp_path):
    assert checkpoint_pooling(tmp_path, False) == DEFAULT_POOLING == PoolingParams("last", True)


def write_gguf_metadata(path: Path, pooling_type: int | None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, "qwen3")
    if pooling_type is not None:
        writer.add_uint32(gguf.Keys.LLM.POOLING_TYPE.format(arch="qwen3"), pooling_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("pooling_type", "expected"), [
    (1, PoolingParams("mean", True)), (2, PoolingParams("cls", True)), (3, PoolingParams("last", True)),
    (0, None), (4, None), (None, None),  # none, rank, absent: nothing nanoserve pools
])
def test_gguf_pooling_type_is_read(tmp_path, pooling_type, expected):
    path = write_gguf_metadata(tmp_path / "m.gguf", pooling_type)
    assert gguf_pooling(path) == expected
    assert checkpoint_pooling(*checkpoint_source(path)) == (expected or DEFAULT_POOLING)


def test_a_gguf_pooling_type_outside_llamacpps_enum_is_refused(tmp_path):
    path = write_gguf_metadata(tmp_path / "m.gguf", 9)
    with pytest.raises(ValueError, match=r"pooling_type=9 is outside llama.cpp's enum \[0, 1, 2, 3, 4\]"):
        gguf_pooling(path)


# ---- the server: POST /v1/embeddings through the openai client ---------------------------------------------


def serve(engine: Engine, requests):
    """Runs `requests(client, raw)` (an async function of an openai.AsyncOpenAI client and an httpx
    client, both over the app in process) and returns what it returns, with the /metrics text."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    httpx2 = pytest.importorskip("httpx2")  # the transport the openai client is built on
    from nanoserve.serving.server.app import create_app

    app = create_app(engine, "tiny")

    async def main():
        raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny")
        client = openai.AsyncOpenAI(base_url="http://tiny/v1", api_key="unused", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))
        try:
            result = await requests(client, raw)
            metrics = (await raw.get("/metrics")).text
        finally:
            await raw.aclose()
            await client.close()
            await app.state.async_engine.shutdown()
        return result, metrics

    return asyncio.run(main())


def test_the_server_embeds_as_transformers_does(hf):
    engine = engine_of(hf, PoolingParams("last", normalize=True), max_num_batched_tokens=8)
    text = "a cat sat on the mat"
    ids = CharTokenizer(hf.config.vocab_size).encode(text)

    async def requests(client, raw):
        one = await client.embeddings.create(model="tiny", input=text, encoding_format="float")
        default_format = await client.embeddings.create(model="tiny", input=text)  # the client asks base64, decodes
        many = await client.embeddings.create(model="tiny", input=[text, "dogs"], encoding_format="base64")
        tokens = await client.embeddings.create(model="tiny", input=PROMPTS[0])
        token_lists = await client.embeddings.create(model="tiny", input=PROMPTS[:3], dimensions=6)
        plain = await raw.post("/v1/embeddings", json={"input": [text, "dogs"], "encoding_format": "base64"})
        return one, default_format, many, tokens, token_lists, plain.json()

    (one, default_format, many, tokens, token_lists, plain), metrics = serve(engine, requests)
    assert_close(one.data[0].embedding, reference(hf, ids, "last", True))
    assert one.model == "tiny" and one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    # base64: OpenAI's little-endian float32 bytes
    assert default_format.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-7)
    dogs = CharTokenizer(hf.config.vocab_size).encode("dogs")
    for got, prompt in zip(many.data, [ids, dogs], strict=True):
        raw = base64.b64decode(got.embedding)
        assert_close(struct.unpack(f"<{len(raw) // 4}f", raw), reference(hf, prompt, "last", True))
    assert [d["embedding"] for d in plain["data"]] == [d.embedding for d in many.data]
    assert [d["index"] for d in plain["data"]] == [0, 1] and plain["object"] == "list"
    assert many.usage.prompt_tokens == len(ids) + len(dogs)
    assert_close(tokens.data[0].embedding, reference(hf, PROMPTS[0], "last", True))
    for got, prompt in zip(token_lists.data, PROMPTS[:3], strict=True):
        assert len(got.embedding) == 6
        assert_close(got.embedding, reference(hf, prompt, "last", True, dimensions=6))
    assert "nanoserve_embedding_requests_total 10.0" in metrics.splitlines()
    assert_all_blocks_free(engine)


def test_bad_embedding_requests_are_400s_naming_the_field(hf):
    openai = pytest.importorskip("openai")
    normalising = engine_of(hf, PoolingParams("last", normalize=True))
    not_normalising = engine_of(hf, PoolingParams("mean", normalize=False))

    async def refusals(client, raw):
        found = []
        for kwargs in ({"input": []}, {"input": ["ok", ""]}, {"input": [[5, 6], [500]]}, {"input": 7},
                       {"input": "x", "encoding_format": "hex"}, {"input": "x", "dimensions": 0},
                       {"input": "x", "dimensions": 33}, {"input": "x" * 300}):
            with pytest.raises(openai.BadRequestError) as e:
                await client.embeddings.create(model="tiny", **kwargs)
            found.append(e.value.body["param"])
        with pytest.raises(openai.NotFoundError) as e:
            await client.embeddings.create(model="other", input="x")
        found.append(e.value.body["param"])
        return found

    found, _ = serve(normalising, refusals)
    assert found == ["input", "input", "input", "input", "encoding_format", "dimensions", "dimensions", "input",
                     "model"]
    assert_all_blocks_free(normalising)

    async def dimensions(client, raw):
        with pytest.raises(openai.BadRequestError) as e:
            await client.embeddings.create(model="tiny", input="x", dimensions=4)
        plain = await client.embeddings.create(model="tiny", input="xy")
        return e.value, plain

    (error, plain), _ = serve(not_normalising, dimensions)
    assert error.body["param"] == "dimensions" and "does not normalise" in error.body["message"]
    ids = CharTokenizer(hf.config.vocab_size).encode("xy")
    assert_close(plain.data[0].embedding, reference(hf, ids, "mean", False))
    assert_all_blocks_free(not_normalising)
