"""The whole mesh as real processes (redis, kvstore + mooncake_master, prefill, decode,
gateway), driven over HTTP with the official openai client."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdmesh.services.gateway.constraints import bad_words_token_ids
from pdmesh.shared.engine import LLM, SamplingParams
from tests.mesh import MODEL, pd_mesh
from tests.prometheus_text import sample
from tests.services.gateway.bad_inputs import cases as bad_cases
from tests.shared.engine.hf_reference import assert_like_reference, from_json, hf_prompt_logprobs

KEY = "test-key"
ENGINE_LEN = 3584  # the decode instance's --max-model-len (the checkpoint's: 4096)
# the engines serve LoRA adapters loaded at runtime (none at start)
LORA = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def services(qwen3_path, tmp_path_factory, registry_prefix):
    # the decode instance serves shorter sequences than the checkpoint: the gateway
    # enforces and reports the engines' limit
    with pd_mesh(qwen3_path, tmp_path_factory.mktemp("mesh-logs"), registry_prefix + "-gw",
                 gateway_args=["--api-key", KEY],
                 prefill_args=LORA,
                 decode_args=["--max-model-len", str(ENGINE_LEN), *LORA]) as started:
        yield started


@pytest.fixture(scope="module")
def mesh(services):
    return services["gateway"].info["http"]


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(qwen3_path):
    return LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16)


def greedy(offline: LLM, prompt, n: int) -> str:
    out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                    ignore_eos=True))
    return out[0].outputs[0].text


def test_models_and_health(mesh, client, qwen3_path):
    import time

    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert abs(models[0].created - time.time()) < 60  # a real time, not 0
    assert models[0].max_model_len == ENGINE_LEN  # the engines', not the checkpoint's
    card = models[0].model_dump()  # vLLM's fields: the model as given, its permission
    assert card["root"] == str(qwen3_path) and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"
    assert card["permission"][0]["allow_sampling"] is True
    h = httpx.get(mesh + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["prefill"] == 1 and h.json()["decode"] == 1


def test_completion_equals_offline_engine(client, offline):
    prompt = list(range(500, 547))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "priority": 0})
    assert r.choices[0].text == greedy(offline, prompt, 16)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 47 and r.usage.completion_tokens == 16


def test_streaming_chat_equals_non_streaming(client, offline):
    messages = [{"role": "user", "content": "def quicksort(items):"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                           temperature=0, extra_body={"ignore_eos": True})
    parts = []
    reason = None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    assert "".join(parts) == whole.choices[0].message.content and reason == "length"
    prompt = offline.tokenizer.apply_chat_template(messages)
    expected = greedy(offline, offline.tokenizer.encode(prompt, add_special_tokens=False), 20)
    assert whole.choices[0].message.content == expected


def test_sixteen_concurrent_requests(client, offline):
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(16)]

    def one(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    assert got == [greedy(offline, p, 12) for p in prompts]


def test_shared_prefix_is_served_from_the_pool(client):
    base = list(range(1000, 1064))  # four full blocks
    client.completions.create(model=MODEL, prompt=base + [7, 8], max_tokens=2)
    r = client.completions.create(model=MODEL, prompt=base + [9, 10, 11], max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 64


def test_stop_string_truncates(client, offline):
    prompt = list(range(700, 740))
    full = greedy(offline, prompt, 24)
    stop = full[5:8]
    assert stop and stop in full
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt="import os", max_tokens=12, temperature=1.0, seed=42)
    assert client.completions.create(**kw).choices[0].text == \
        client.completions.create(**kw).choices[0].text


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 1 for t in lp.top_logprobs)


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "priority": 2**31}, 400, "priority"),  # int32
    ({"model": MODEL, "prompt": "x", "priority": "high"}, 400, "priority"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
])
def test_malformed_requests(mesh, body, status, needle):
    r = httpx.post(mesh + "/v1/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize(("path", "body", "status", "needle"),
                         [pytest.param(*case[1:], id=case[0]) for case in bad_cases(MODEL)])
def test_bad_input_corpus(mesh, path, body, status, needle):
    """Each bad request: a 4xx in OpenAI's error shape naming what is wrong, and the
    gateway healthy after it."""
    headers = {"Authorization": f"Bearer {KEY}"}
    if isinstance(body, bytes):
        r = httpx.post(mesh + path, content=body, timeout=60,
                       headers={**headers, "Content-Type": "application/json"})
    else:
        r = httpx.post(mesh + path, json=body, timeout=60, headers=headers)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"], err
    assert httpx.get(mesh + "/health", timeout=10).status_code == 200


def test_api_key_required(mesh):
    r = httpx.post(mesh + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.get(mesh + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401


def test_mesh_still_serves_after_bad_requests(client):
    r = client.completions.create(model=MODEL, prompt="x = 1", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def decode_load(registry_prefix, role="decode"):
    """A function that reads the (one) decode (or prefill) instance's load over its Health
    RPC."""
    import grpc

    from pdmesh.shared.infra.registry import Registry
    from pdmesh.shared.proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    [inst] = Registry(prefix=registry_prefix + "-gw").instances(role=role)
    stub = (decode_pb2_grpc.DecodeStub if role == "decode" else prefill_pb2_grpc.PrefillStub)
    health = stub(grpc.insecure_channel(inst.address)).Health
    return lambda: health(common_pb2.HealthRequest(), timeout=5).load


def decode_freed(load, within_s=10.0) -> bool:
    """Whether decode runs nothing and holds no KV block within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        now = load()
        if now.running == 0 and now.free_kv_blocks == now.total_kv_blocks:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_client_disconnect_aborts_on_decode(mesh, registry_prefix):
    """A client that drops a stream frees the request's KV blocks on decode at once."""
    load = decode_load(registry_prefix)
    body = {"model": MODEL, "prompt": list(range(50, 90)), "max_tokens": 3000,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", mesh + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
            assert load().running == 1
    assert decode_freed(load), load()


def test_clients_that_leave_before_their_first_token_abort_their_prompts(services, mesh,
                                                                         client, offline,
                                                                         registry_prefix):
    """32 long prompts at once, half streamed, whose clients give up after 0.5 s, most
    before their first token (their prompts queued on prefill, or offloaded to decode):
    the engines drop them instead of computing every one, and the mesh answers the next
    request as before."""
    loads = [decode_load(registry_prefix, role) for role in ("prefill", "decode")]
    metrics = [services[role].info["metrics"] for role in ("prefill", "decode")]

    def scheduled() -> float:  # requests an engine started computing (aborted waiting: not)
        return sum(sample(httpx.get(url, timeout=10).text,
                          "pdmesh_request_queue_time_seconds_count") for url in metrics)

    before = scheduled()
    bodies = [{"model": MODEL, "prompt": [(37 * i + 11 * j) % 4000 + 50 for j in range(3000)],
               "max_tokens": 8, "ignore_eos": True, "stream": i % 2 == 1} for i in range(32)]

    def leave(body) -> bool:  # whether the client gave up (no answer within 0.5 s)
        with httpx.Client(timeout=httpx.Timeout(30, read=0.5),
                          headers={"Authorization": f"Bearer {KEY}"}) as c:
            try:
                c.post(mesh + "/v1/completions", json=body)
            except httpx.ReadTimeout:
                return True
        return False

    with ThreadPoolExecutor(len(bodies)) as pool:
        gave_up = sum(pool.map(leave, bodies))
    assert gave_up >= 24, f"only {gave_up} of 32 clients left before an answer"
    deadline = time.monotonic() + 30
    while any(ld().running or ld().waiting for ld in loads):
        assert time.monotonic() < deadline, [ld() for ld in loads]
        time.sleep(0.1)
    started = scheduled() - before
    assert started <= 16, f"{started:.0f} of 32 abandoned prompts were computed anyway"
    assert all(decode_freed(ld) for ld in loads), [ld() for ld in loads]
    prompt = list(range(600, 640))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == greedy(offline, prompt, 8)


def test_min_tokens_past_the_prefill_token(client):
    """The prefill instance makes one token; a min_tokens beyond it is decode's to keep
    (it was a 400: "must be <= max_tokens (1)")."""
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=9,
                                  extra_body={"min_tokens": 7, "stop_token_ids": list(
                                      range(0, 4096, 3))})
    assert 7 <= r.usage.completion_tokens <= 9


def test_a_completion_without_max_tokens_stops_at_16(client):
    r = client.completions.create(model=MODEL, prompt=[11, 12, 13],
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_max_tokens_past_the_context_is_refused(mesh):
    r = httpx.post(mesh + "/v1/completions", timeout=30, headers={
        "Authorization": f"Bearer {KEY}"}, json={"model": MODEL, "prompt": [5] * 100,
                                                 "max_tokens": ENGINE_LEN - 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert f"maximum context length is {ENGINE_LEN}" in r.json()["error"]["message"]


def test_echo_puts_the_prompt_before_the_answer(client, offline):
    for prompt in ("def add(a, b):", [40, 41, 42]):
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                          temperature=0)
        echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                           temperature=0, echo=True)
        given = prompt if isinstance(prompt, str) else offline.tokenizer.decode(
            prompt, skip_special_tokens=False)
        assert echoed.choices[0].text == given + plain.choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, stream=True)
            if c.choices)
        assert streamed == echoed.choices[0].text


def test_prompt_logprobs_equal_a_forward_pass_through_prefill_and_decode(client, offline,
                                                                          qwen3_path):
    """Computed by the prefill instance over the whole prompt, though its KV is in the
    pool already; on each completion choice, at the top of a chat completion."""
    prompt = list(range(1200, 1250))  # three full blocks
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)  # into the pool
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert_like_reference(from_json(got), prompt, hf_prompt_logprobs(qwen3_path, prompt), 2)
    assert all(v["decoded_token"] == offline.tokenizer.decode([int(k)])
               for e in got[1:] for k, v in e.items())
    assert r.choices[0].text == greedy(offline, prompt, 3)  # the answer as without them
    messages = [{"role": "user", "content": "def add(a, b):"}]
    ids = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages),
                                   add_special_tokens=False)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                          extra_body={"prompt_logprobs": 0})
    assert "prompt_logprobs" not in chat.choices[0].model_extra
    assert_like_reference(from_json(chat.model_extra["prompt_logprobs"]), ids,
                          hf_prompt_logprobs(qwen3_path, ids), 0)


def test_echo_with_logprobs_gives_the_prompt_tokens_their_logprobs(client, offline):
    """vLLM's echo: the echoed prompt's tokens first in the logprobs (the first without
    any), with the prompt's logprobs; whole and in the stream's first chunk."""
    prompt = "def add(a, b):\n    return"
    ids = offline.tokenizer.encode(prompt)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2,
              extra_body={"ignore_eos": True})
    c = client.completions.create(**kw).choices[0]
    lp = c.logprobs
    assert c.text == prompt + greedy(offline, prompt, 4)
    assert lp.tokens[:len(ids)] == [offline.tokenizer.decode([t]) for t in ids]
    assert len(lp.tokens) == len(ids) + 4 and len(lp.token_logprobs) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    pl = c.model_extra["prompt_logprobs"]
    assert lp.token_logprobs[1:len(ids)] == [pl[j][str(ids[j])]["logprob"]
                                             for j in range(1, len(ids))]
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    # vLLM's: the echoed or chosen token always among its top_logprobs (n + 1 when it is
    # not among the n likeliest), and each token's place in the answer's text
    tops = zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True)
    assert all(tok in top for tok, top in tops)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:j])) for j in range(len(lp.tokens))]
    chunks = [ch.choices[0].logprobs for ch in client.completions.create(**kw, stream=True)
              if ch.choices and ch.choices[0].logprobs]
    assert [o for ch in chunks for o in ch.text_offset] == lp.text_offset  # (streamed too)
    first = next(ch for ch in client.completions.create(**kw, stream=True) if ch.choices)
    assert first.choices[0].text.startswith(prompt)
    assert first.choices[0].logprobs.token_logprobs[:len(ids)] == lp.token_logprobs[:len(ids)]


def test_fields_it_does_not_know_are_accepted(client):
    """As vLLM: ignored (a warning per field name in the gateway's log)."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        metadata={"k": "v"}, store=False, service_tier="auto", response_format={
            "type": "text"}, extra_body={"bogus_field": 1, "prompt": "x"})
    assert r.usage.completion_tokens >= 1 and r.choices[0].message.content is not None


def test_a_client_leaving_a_whole_answer_aborts_it_on_decode(mesh, registry_prefix):
    """Not streamed: a client that gives up waiting frees the request on decode too."""
    load = decode_load(registry_prefix)
    body = {"model": MODEL, "prompt": list(range(50, 90)), "max_tokens": 3000,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(mesh + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=2),
                   headers={"Authorization": f"Bearer {KEY}"})
    assert decode_freed(load), load()


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}


@pytest.mark.parametrize("sampled", [False, True])
def test_json_schema_answers_validate_after_the_hand_off(client, sampled):
    """response_format json_schema, greedy and sampled, streamed and not: the prefill
    instance masks the first token, the decode instance rebuilds the grammar from it."""
    import jsonschema

    kw = {"temperature": 1.0, "seed": 11} if sampled else {"temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    for i in range(3):
        messages = [{"role": "user", "content": f"who is number {i}?"}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60,
                                           response_format=fmt, **kw)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(
                               model=MODEL, messages=messages, max_tokens=60, stream=True,
                               response_format=fmt, **kw) if c.choices)
        assert streamed == r.choices[0].message.content


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_regex": r"[A-Z][a-z]{2,4} [0-9]{2}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,4} [0-9]{2}", t)),
    ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": r"id-[0-9]{4}"}}, lambda t: re.fullmatch(r"id-\d{4}", t)),
    ({"guided_grammar": 'start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]{1,3}/'},
     lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3})?\)", t)),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                      "maxItems": 3}},
     lambda t: isinstance(json.loads(t), list) and 1 <= len(json.loads(t)) <= 3),
])
def test_guided_outputs_match(client, extra, check):
    for seed in (1, 2):
        r = client.completions.create(model=MODEL, prompt=f"answer {seed}:", max_tokens=40,
                                      temperature=0.9, seed=seed, extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), \
            r.choices[0].text


def test_json_object_with_logit_bias(client, offline):
    """json_object: any JSON object; a bias towards "}" closes it at once."""
    close = offline.tokenizer.encode("}", add_special_tokens=False)
    assert len(close) == 1
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "an object"}], max_tokens=30,
        temperature=0, response_format={"type": "json_object"},
        logit_bias={str(close[0]): 50})
    assert json.loads(r.choices[0].message.content) == {}


def test_logit_bias_steers_greedy_tokens(client, offline):
    prompt = [300, 301, 302]
    plain = greedy(offline, prompt, 4)
    target = next(t for t in range(1000, 1100)
                  if offline.tokenizer.decode([t]) not in plain and offline.tokenizer.decode(
                      [t]).strip())
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(target): 100},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == offline.tokenizer.decode([target] * 4)


def _a_word_in(tokenizer, tokens: list[int], n: int, skip: int = 0) -> tuple[str, list[int]]:
    """The first text of ``n`` tokens of ``tokens`` (from ``skip`` on) that, as a bad
    word, the gateway tokenizes into those very tokens."""
    for k in range(skip, len(tokens) - n + 1):
        word = tokenizer.decode(tokens[k:k + n])
        if word.strip() and tokens[k:k + n] in bad_words_token_ids([word], tokenizer):
            return word, tokens[k:k + n]
    raise AssertionError(f"no {n}-token word in {tokens}")


@pytest.mark.parametrize("chat", [False, True])
def test_bad_words_keep_a_greedy_answer_clear_of_them(client, offline, chat):
    """A two-token word that opens the greedy answer (the prefill instance samples its
    first token; decode must not follow it with the second) and a one-token word from
    later on: the answer is the offline engine's with them banned, and holds neither."""
    text = "class Node:"
    messages = [{"role": "user", "content": text}]
    tok = offline.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False) \
        if chat else tok.encode(text)
    plain = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True))[0].outputs[0]
    two, two_ids = _a_word_in(tok, plain.token_ids, 2)
    one, one_ids = _a_word_in(tok, plain.token_ids, 1, skip=2)
    banned = bad_words_token_ids([two, one], tok)
    want = offline.generate([prompt], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True,
        bad_words_token_ids=banned))[0].outputs[0]
    ids = want.token_ids
    assert one_ids[0] not in ids and all(ids[i:i + 2] != two_ids for i in range(len(ids)))
    kw = dict(model=MODEL, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True, "bad_words": [two, one]})
    if chat:
        got = client.chat.completions.create(messages=messages, **kw).choices[0].message.content
    else:
        got = client.completions.create(prompt=text, **kw).choices[0].text
    assert got == want.text != plain.text


def test_vllm_endpoints(mesh, client, offline):
    auth = {"Authorization": f"Bearer {KEY}"}
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len == ENGINE_LEN
    r = httpx.get(mesh + "/v1/models/other", headers=auth, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(mesh + "/version", headers=auth, timeout=10).json()["version"]
    assert httpx.get(mesh + "/ping", timeout=10).status_code == 200  # a probe: no key
    assert httpx.post(mesh + "/ping", timeout=10).status_code == 200
    assert httpx.get(mesh + "/load", headers=auth, timeout=10).json() == {"server_load": 0}
    text = "def add(a, b):"
    r = httpx.post(mesh + "/tokenize", headers=auth, timeout=10,
                   json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == offline.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == ENGINE_LEN and len(r["token_strs"]) == r["count"]
    messages = [{"role": "user", "content": "hi"}]
    plain = httpx.post(mesh + "/tokenize", headers=auth, timeout=10,
                       json={"prompt": text}).json()
    assert plain["token_strs"] is None and plain["tokens"] == r["tokens"]  # (vLLM's shape)
    for words in (ENGINE_LEN + 10, 2_000_000):  # past the context: tokens, then the text
        t0 = time.monotonic()
        long = httpx.post(mesh + "/tokenize", headers=auth, timeout=30,
                          json={"prompt": " x" * words})
        assert long.status_code == 400 and long.json()["error"]["param"] == "prompt", long.text
        assert f"max_model_len ({ENGINE_LEN})" in long.json()["error"]["message"]
        assert time.monotonic() - t0 < 5
    chat = httpx.post(mesh + "/tokenize", headers=auth, timeout=10,
                      json={"messages": messages}).json()["tokens"]
    assert chat == offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages),
                                            add_special_tokens=False)
    back = httpx.post(mesh + "/detokenize", headers=auth, timeout=10,
                      json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    for path, body, needle in (("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                               ("/tokenize", {"prompt": 5}, "prompt"),
                               ("/detokenize", {"tokens": [99_999]}, "tokens"),
                               ("/detokenize", {"tokens": "x"}, "tokens"),
                               ("/detokenize", b"{", "JSON"),
                               ("/tokenize", {"model": "other", "prompt": "x"}, "model")):
        kw = {"content": body, "headers": {**auth, "Content-Type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body, "headers": auth}
        r = httpx.post(mesh + path, timeout=10, **kw)
        assert r.status_code in (400, 404) and needle in r.json()["error"]["message"], r.text


def test_n_choices_whole_and_streamed(client):
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=8, temperature=1.0, seed=5,
              n=4, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) > 1  # each choice draws its own
    assert r.usage.completion_tokens == 32 and r.usage.prompt_tokens < 32
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded
    texts = {i: "" for i in range(4)}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(4)] == [c.text for c in r.choices]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3,
        temperature=1.0, seed=9, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.content for c in chat.choices)


def test_best_of_answers_the_most_likely_candidate(client):
    """best_of=3: the candidates are n=3's choices (same seed), the answer the one whose
    sampled tokens are the most likely together."""
    kw = dict(model=MODEL, prompt=[70, 71, 72], max_tokens=6, temperature=1.0, seed=21,
              extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, logprobs=0, **kw)
    best = max(three.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    r = client.completions.create(n=1, best_of=3, **kw)
    assert [c.text for c in r.choices] == [best.text] and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 18  # every candidate's tokens


def test_stop_reason_and_include_stop_str(client, offline):
    prompt = list(range(700, 740))
    full = greedy(offline, prompt, 24)
    stop = full[5:8]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00"],
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop
    kept = client.completions.create(**{**kw, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}})
    assert kept.choices[0].text == full[:full.index(stop) + len(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **{**kw, "stream": True, "extra_body": {"ignore_eos": True,
                                                "include_stop_str_in_output": True}})
        if c.choices)
    assert streamed == kept.choices[0].text
    ids = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                    ignore_eos=True))[0].outputs[0].token_ids
    by_token = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                         temperature=0, extra_body={"stop_token_ids": [ids[3]]})
    assert by_token.choices[0].model_extra["stop_reason"] == ids[3]
    length = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert length.choices[0].model_extra["stop_reason"] is None


def test_continuous_usage_token_ids_and_truncation(client, offline):
    chunks = [c for c in client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})]
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 5
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                  logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    long = list(range(100, 160))
    cut = client.completions.create(model=MODEL, prompt=long, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 10})
    assert cut.usage.prompt_tokens == 10
    assert cut.choices[0].text == greedy(offline, long[-10:], 4)
    echoed = client.completions.create(model=MODEL, prompt=long, max_tokens=4, temperature=0,
                                       echo=True, extra_body={"truncate_prompt_tokens": 10})
    # echo shows the prompt the model was given: the cut one
    assert echoed.choices[0].text == offline.tokenizer.decode(
        long[-10:], skip_special_tokens=False) + cut.choices[0].text


def test_return_token_ids_and_prompt_text(client, offline):
    """vLLM's return_token_ids: the prompt's and the answer's ids beside the text (a
    stream: the prompt's in its first chunk, each chunk's own); return_prompt_text: the
    chat's rendered prompt. Not asked: null, as vLLM answers."""
    ids = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5,
                                      temperature=0, extra_body=ids).to_dict()["choices"][0]
    want = offline.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5,
                                                        ignore_eos=True))[0].outputs[0]
    assert whole["prompt_token_ids"] == [5, 6, 7]
    assert whole["token_ids"] == list(want.token_ids) and whole["text"] == want.text
    chunks = [c.to_dict()["choices"][0] for c in client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0, stream=True,
        extra_body=ids)]
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    ask = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                          temperature=0, extra_body={**ids,
                                                                     "return_prompt_text": True})
    got = chat.to_dict()
    prompt = offline.tokenizer.apply_chat_template(ask, add_generation_prompt=True)
    assert got["prompt_text"] == prompt
    assert got["prompt_token_ids"] == offline.tokenizer.encode(prompt, add_special_tokens=False)
    assert len(got["choices"][0]["token_ids"]) == chat.usage.completion_tokens == 4
    streamed = [c.to_dict() for c in client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=4, temperature=0, stream=True, extra_body=ids)]
    assert streamed[0]["prompt_token_ids"] == got["prompt_token_ids"]
    assert [t for c in streamed for ch in c["choices"] for t in ch.get("token_ids") or []
            ] == got["choices"][0]["token_ids"]
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2,
                                           temperature=0).to_dict()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    message = plain["choices"][0]["message"]
    assert "tool_calls" not in message and message["refusal"] is None  # (vLLM's, OpenAI's)
    assert plain["usage"]["completion_tokens_details"] is None  # (no reasoning parser)


def test_a_batch_of_prompts(client, offline):
    """A list of prompts: each its n choices, numbered prompt by prompt (vLLM's order);
    the prompts' tokens counted once each."""
    prompts = [[40, 41, 42, 43], [900, 901, 902]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0,
                                  n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [greedy(offline, p, 5) for p in prompts]
    assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 20
    texts = ["", "", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=["def f(x):", "import"],
                                           max_tokens=4, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[:2] == [client.completions.create(
        model=MODEL, prompt=p, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text for p in ("def f(x):", "import")]


def test_logprobs_under_a_grammar_are_json(mesh, client):
    """Tokens a grammar forbids have logprob -inf: answered at vLLM's floor (-9999), so
    the answer stays JSON, whole and streamed."""
    kw = dict(model=MODEL, prompt="ok?", max_tokens=5, temperature=0, logprobs=5,
              extra_body={"guided_choice": ["yes", "no"]})
    r = client.completions.create(**kw)
    assert r.choices[0].text in ("yes", "no")
    tops = [v for d in r.choices[0].logprobs.top_logprobs for v in d.values()]
    assert tops and all(-9999.0 <= v <= 0 for v in tops)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    ok = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
        extra_body={"chat_template_kwargs": {"continue_final_message": True,
                                             "add_generation_prompt": False}})
    assert ok.choices[0].message.content is not None  # the request's own fields decide


def test_lora_adapters_load_and_unload_at_runtime_under_streaming_load(mesh, services, client,
                                                                       qwen3_path, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, behind the API key, on
    every instance of the mesh, while streams of the base model and of an adapter run:
    no stream fails, each ends with the offline engine's text (the unloaded adapter's
    streams with that adapter to their last token), a new request for the unloaded
    adapter is a 404 in OpenAI's shape, and the adapter loaded meanwhile serves."""
    from pdmesh.shared.engine import LoRARequest
    from tests.shared.engine.lora_reference import make_adapters

    sql, chat = make_adapters(qwen3_path, tmp_path, "qwen3", [(4, 8.0, False),
                                                              (8, 16.0, True)], 3)
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body: dict, headers=auth) -> httpx.Response:
        return httpx.post(mesh + path, json=body, headers=headers, timeout=60)

    offline = LLM(str(qwen3_path), device="cpu", dtype="float32", block_size=16,
                  enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt, n = list(range(400, 431)), 160
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    want = {name: offline.generate([prompt], params, lora_request=None if path is None
                                   else LoRARequest(name, 1, str(path)))[0].outputs[0].text
            for name, path in ((MODEL, None), ("sql", sql), ("chat", chat))}
    assert len(set(want.values())) == 3
    assert post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(sql)},
                headers={}).status_code == 401
    for body, status, words in (
            ({"lora_name": "sql"}, 400, "Both 'lora_name' and 'lora_path'"),
            ({"lora_name": "x", "lora_path": str(qwen3_path)}, 400, "adapter_config.json"),
            ({"lora_name": MODEL, "lora_path": str(sql)}, 400, "already been loaded"),
            ({"lora_name": "sql", "lora_path": str(sql)}, 200, "added successfully"),
            ({"lora_name": "sql", "lora_path": str(sql)}, 400, "already been loaded")):
        r = post("/v1/load_lora_adapter", body)
        assert r.status_code == status and words in r.text, r.text
    cards = {m.id: m for m in client.models.list().data}
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(sql)

    def stream(model: str) -> tuple[str, str | None]:
        text, reason = "", None
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
            started.release()
        return text, reason

    import threading
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(6) as pool:
        running = [(m, pool.submit(stream, m)) for m in (MODEL, "sql") * 3]
        for _ in running:
            started.acquire(timeout=60)  # (every stream has its first tokens)
        # vLLM's lora_requests_info on the decode instance: the adapter its requests run
        # (once they have come from prefill)
        deadline, info = time.monotonic() + 30, ""
        while 'running_lora_adapters="sql"' not in info and time.monotonic() < deadline:
            scraped = httpx.get(services["decode"].info["metrics"], timeout=10).text
            info = next(line for line in scraped.splitlines()
                        if line.startswith("pdmesh_lora_requests_info{"))
        loaded = post("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(chat)})
        unloaded = post("/v1/unload_lora_adapter", {"lora_name": "sql"})
        busy = sum(not f.done() for _, f in running)
        results = [(m, f.result(timeout=120)) for m, f in running]
    assert loaded.status_code == 200 and unloaded.status_code == 200, (loaded.text,
                                                                       unloaded.text)
    assert unloaded.text == "Success: LoRA adapter 'sql' removed successfully."
    assert busy > 0  # (the load and the unload came while streams ran)
    assert 'running_lora_adapters="sql"' in info and 'max_lora="2"' in info, info
    assert abs(float(info.rsplit(" ", 1)[1]) - time.time()) < 120
    for model, (text, reason) in results:
        assert reason == "length" and text == want[model], model
    with pytest.raises(openai.NotFoundError, match="sql"):
        client.completions.create(model="sql", prompt=prompt, max_tokens=2)
    r = post("/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert r.status_code == 404 and r.json()["error"]["message"] == \
        "The lora adapter 'sql' cannot be found."
    got = client.completions.create(model="chat", prompt=prompt, max_tokens=n,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want["chat"]
    r = post("/tokenize", {"model": "chat", "prompt": "def add(a, b):"})  # (vLLM's too)
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    assert post("/tokenize", {"model": "sql", "prompt": "x"}).status_code == 404
    assert post("/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(mesh, qwen3_path, tmp_path):
    """Qwen3: three adapters loaded at runtime and the base model in one batch through the
    PD mesh (two device slots: one adapter's requests wait their turn), token for token
    transformers + PEFT's. (Last: the adapters stay loaded.)"""
    from tests.services.pd.lora_mesh import mixed_batch

    got, want = mixed_batch(mesh, MODEL, qwen3_path, "qwen3", tmp_path, api_key=KEY)
    assert len({str(want[k]) for k in (0, 3, 4)}) == 3  # each adapter tells
    assert got == want
