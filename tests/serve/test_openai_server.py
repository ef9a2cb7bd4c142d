"""The server through the real `openai` client (and raw HTTP where clients send raw payloads):
outputs equal the LLM's, streams equal whole answers, seeds reproduce under load, bad input is
a 400 that leaves the server healthy, disconnects free their requests, metrics add up."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time

import httpx
import pytest

from infer import SamplingParams

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

PROMPTS = ["The capital of France is", "def add(a, b):\n", "Once upon a time, in a land"]


def metrics(running) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. 'vllm:num_requests_running'."""
    text = httpx.get(f"{running.url}/metrics", timeout=30).text
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + (json.dumps(extra, sort_keys=True) if extra else "")
            out[key] = s.value
    return out


def test_models_and_health(running) -> None:
    models = running.client().models.list().data
    assert [m.id for m in models] == ["smollm2-4l"]
    assert models[0].model_extra["max_model_len"] == 128
    assert models[0].model_extra["root"] == "smollm2-135m[:4]"
    assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}


def test_greedy_completion_equals_llm_generate(running) -> None:
    client = running.client()
    expected = running.llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    got = client.completions.create(model="smollm2-4l", prompt=PROMPTS, temperature=0,
                                    max_tokens=12, extra_body={"return_token_ids": True})
    assert got.id.startswith("cmpl-") and got.object == "text_completion"
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, want in zip(got.choices, expected):
        assert choice.text == want.text
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.finish_reason == ("length" if len(want.token_ids) == 12 else "stop")
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in expected)
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in expected)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_openai_defaults_are_16_tokens_at_temperature_1(running) -> None:
    got = running.client().completions.create(model="smollm2-4l", prompt=PROMPTS[2],
                                              extra_body={"ignore_eos": True, "seed": 5})
    assert got.usage.completion_tokens == 16
    # temperature 1.0 (not infer's greedy default): seed 5 gives seed 5's draw
    want = running.llm.generate(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=16,
                                                           seed=5, ignore_eos=True))[0]
    assert got.choices[0].text == want.text


def test_stream_equals_whole_answer_and_ends_with_usage(running) -> None:
    client = running.client()
    whole = client.completions.create(model="smollm2-4l", prompt=PROMPTS[0], temperature=0,
                                      max_tokens=14, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model="smollm2-4l", prompt=PROMPTS[0], temperature=0, max_tokens=14, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    content, usage = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == 14
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert len(content) > 1  # one event per step, not one at the end


def test_every_answer_and_event_carries_the_servers_fingerprint(running) -> None:
    """Completions and chats, whole and streamed (usage event included): one fingerprint, the
    one the server's engine gives."""
    from infer.serve.app import system_fingerprint

    fingerprint = running.server.served.fingerprint
    assert fingerprint == system_fingerprint(running.server.engine)
    client = running.client()
    common = dict(model="smollm2-4l", max_tokens=3, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "Hi"}]
    answers = [client.completions.create(prompt=PROMPTS[0], **common),
               client.chat.completions.create(messages=messages, **common)]
    for stream in (client.completions.create(prompt=PROMPTS[0], stream=True, **common,
                                             stream_options={"include_usage": True}),
                   client.chat.completions.create(messages=messages, stream=True, **common)):
        answers += list(stream)
    assert len(answers) > 4
    assert {a.system_fingerprint for a in answers} == {fingerprint}


def test_chat_equals_llm_chat_plain_streamed_and_as_parts(running) -> None:
    client = running.client()
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name a planet.\nOne word."}]
    want = running.llm.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0]
    got = client.chat.completions.create(model="smollm2-4l", messages=messages, temperature=0,
                                         max_tokens=10)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    # Text parts join with newlines, as vLLM joins them.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Name a planet."},
                                                       {"type": "text", "text": "One word."}]}]
    chunks = list(client.chat.completions.create(model="smollm2-4l", messages=parts,
                                                 temperature=0, max_completion_tokens=10,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_stop_string_is_cut_and_never_half_streamed(running) -> None:
    client = running.client()
    free = running.llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24,
                                                           ignore_eos=True))[0].text
    words = [w for w in free.split() if len(w) >= 3 and free.find(w) > 0]
    assert words, free
    stop = words[len(words) // 2]
    cut = free[:free.find(stop)]
    got = client.completions.create(model="smollm2-4l", prompt=PROMPTS[1], temperature=0,
                                    max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    kept = client.completions.create(model="smollm2-4l", prompt=PROMPTS[1], temperature=0,
                                     max_tokens=24, stop=[stop], extra_body={
                                         "ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop  # vLLM's field: the stop string kept
    streamed = ""
    for c in client.completions.create(model="smollm2-4l", prompt=PROMPTS[1], temperature=0,
                                       max_tokens=24, stop=stop, stream=True,
                                       extra_body={"ignore_eos": True}):
        streamed += c.choices[0].text
        assert streamed == cut[:len(streamed)]  # never a character past the cut
    assert streamed == cut


def test_continuous_usage_stats_count_each_event(running) -> None:
    """stream_options.continuous_usage_stats: each event carries its choice's tokens so far,
    ending at the final usage's count; without it (or without include_usage) no event does."""
    body = {"model": "smollm2-4l", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True}
    url = f"{running.url}/v1/completions"

    def events(options: dict) -> list[dict]:
        with httpx.stream("POST", url, json=body | {"stream_options": options}, timeout=60) as r:
            return [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: {")]

    got = events({"include_usage": True, "continuous_usage_stats": True})
    counts = [e["usage"]["completion_tokens"] for e in got if e["choices"]]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6, counts
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 6
    prompt = got[-1]["usage"]["prompt_tokens"]
    assert all(e["usage"]["prompt_tokens"] == prompt for e in got)
    for options in ({"include_usage": True}, {"continuous_usage_stats": True}):
        assert all("usage" not in e for e in events(options) if e["choices"]), options


def test_stop_reason_names_what_stopped_the_choice(running) -> None:
    """vLLM's stop_reason: the stop string matched, the stop token id, or null (max_tokens)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = running.llm.generate(PROMPTS[1], params)[0]
    words = [w for w in free.text.split() if len(w) >= 3 and free.text.find(w) > 0]
    body = {"model": "smollm2-4l", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    url = f"{running.url}/v1/completions"
    for extra, reason in (({}, None), ({"stop": ["\u2603", words[0]]}, words[0]),
                          ({"stop_token_ids": [free.token_ids[3]]}, free.token_ids[3])):
        choice = httpx.post(url, json=body | extra, timeout=60).json()["choices"][0]
        assert choice["stop_reason"] == reason, (extra, choice)
        assert choice["finish_reason"] == ("length" if reason is None else "stop")


def test_usage_counts_each_prompt_once(running) -> None:
    """Prompt tokens and their cached part, over n choices of two prompts: once per prompt."""
    import dataclasses

    from infer.serve.protocol import Job, usage

    outs = running.llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2))
    choices = []
    for out in outs:
        for i in range(3):  # choice i found the prompt cached 4 tokens further
            metrics = dataclasses.replace(out.metrics, num_cached_tokens=4 * i)
            choices.append(dataclasses.replace(out, metrics=metrics))
    job = Job("completion", "cmpl-x", "smollm2-4l", 0, [dataclasses.replace(
        o, request_id=f"{k}") for k, o in enumerate(choices)], 3, False, False, False)
    got = usage(job, choices)
    assert got["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert got["prompt_tokens_details"]["cached_tokens"] == 0
    assert got["completion_tokens"] == 6 * 2


def test_seeds_reproduce_while_other_requests_run(running) -> None:
    client = running.client()

    def sampled(seed=None, prompt=PROMPTS[2]) -> str:
        extra = {"ignore_eos": True} | ({"seed": seed} if seed is not None else {})
        return client.completions.create(model="smollm2-4l", prompt=prompt, temperature=1.5,
                                         max_tokens=16, extra_body=extra).choices[0].text

    alone = sampled(seed=11)
    assert sampled(seed=11) == alone
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        others = [pool.submit(sampled, seed=s, prompt=PROMPTS[s % 2]) for s in range(4)]
        busy = pool.submit(sampled, seed=11)
        assert busy.result() == alone
        [o.result() for o in others]
    assert sampled() != sampled()  # unseeded requests draw fresh seeds


def test_n_choices_draw_with_seed_plus_i(running) -> None:
    client = running.client()
    got = client.completions.create(model="smollm2-4l", prompt=PROMPTS[0], temperature=1.2,
                                    max_tokens=10, n=3, seed=40,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    for i, choice in enumerate(got.choices):
        alone = client.completions.create(model="smollm2-4l", prompt=PROMPTS[0],
                                          temperature=1.2, max_tokens=10, seed=40 + i,
                                          extra_body={"ignore_eos": True})
        assert choice.text == alone.choices[0].text
    assert len({c.text for c in got.choices}) > 1
    single = client.completions.create(model="smollm2-4l", prompt=PROMPTS[0], max_tokens=10,
                                       extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert got.usage.completion_tokens == 30


BAD = [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=1000), "max_tokens"),
    (dict(n=0), "n"), (dict(n=99), "n"), (dict(best_of=3), "best_of"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(frequency_penalty=1.0), "frequency_penalty"),
    (dict(repetition_penalty=1.2), "repetition_penalty"), (dict(logit_bias={"5": 3}), "logit_bias"),
    (dict(logprobs=21), "logprobs"), (dict(echo=True), "echo"), (dict(suffix="x"), "suffix"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(seed=-3), "seed"), (dict(seed="7"), "seed"), (dict(top_k=1.5), "top_k"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(prompt=""), "prompt"), (dict(prompt=[]), "prompt"), (dict(prompt=[49152]), "prompt"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(response_format={"type": "json_schema"}),
                                             "response_format"),
    (dict(temperature=10**400), "temperature"), (dict(top_p=-10**400), "top_p"),
    (dict(add_special_tokens="no"), "add_special_tokens"),
    # vLLM extensions that change the output were ignored as unknown fields.
    (dict(truncate_prompt_tokens=2), "truncate_prompt_tokens"),
    (dict(allowed_token_ids=[5, 6]), "allowed_token_ids"), (dict(bad_words=["the"]), "bad_words"),
    (dict(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_completion_requests_are_400_with_the_field(running, fields, param) -> None:
    body = {"model": "smollm2-4l", "prompt": PROMPTS[0], "max_tokens": 4} | fields
    r = httpx.post(f"{running.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param, error
    assert httpx.get(f"{running.url}/health").status_code == 200


def test_errors_through_the_client_and_raw(running) -> None:
    client = running.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-4l", temperature=-1,
                                       messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-4l", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    url = f"{running.url}/v1/completions"
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}
                      ).status_code == 400
    assert httpx.post(url, content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"}
                      ).status_code == 400
    assert httpx.post(url, json=[1, 2]).status_code == 400
    deep = httpx.post(url, content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert deep.status_code == 400 and "JSON" in deep.json()["error"]["message"]
    wrong_method = httpx.get(url)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == 405
    missing = httpx.get(f"{running.url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(f"{running.url}/health").status_code == 200


def test_unknown_fields_are_ignored_and_neutral_values_accepted(running) -> None:
    body = {"model": "smollm2-4l", "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
            "some_new_openai_field": {"x": 1}, "presence_penalty": 0, "repetition_penalty": 1.0,
            "logprobs": None, "best_of": 1, "user": "me", "truncate_prompt_tokens": None,
            "bad_words": [], "spaces_between_special_tokens": True}
    r = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_a_field_of_the_other_endpoint_is_logged_as_ignored(caplog) -> None:
    from infer.serve.protocol import _UnknownFields

    warn = _UnknownFields()
    with caplog.at_level(logging.INFO, logger="infer"):
        # max_completion_tokens is chat's: a completion would silently keep its 16 tokens.
        warn({"prompt": "x", "max_completion_tokens": 5, "max_tokens": 3}, "completion")
        warn({"messages": [], "max_completion_tokens": 5, "prompt": "x"}, "chat")
        warn({"prompt": "x", "max_completion_tokens": 5}, "completion")  # once per process
    ignored = [r.getMessage() for r in caplog.records]
    assert len(ignored) == 2, ignored
    assert "'max_completion_tokens'" in ignored[0] and "completion" in ignored[0]
    assert "'prompt'" in ignored[1] and "chat" in ignored[1]


def test_duplicate_request_ids_are_refused_while_running(running) -> None:
    url = f"{running.url}/v1/completions"
    body = {"prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "request_id": "mine"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, json=body, timeout=120)
        deadline = time.monotonic() + 60
        while metrics(running)["vllm:num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = httpx.post(url, json=body | {"max_tokens": 2}, timeout=60)
        assert second.status_code == 400
        assert second.json()["error"]["message"] == "request id 'mine' is already in use"
        # Streamed, the refusal comes before any event: a 400, not a 200 with an error event.
        streamed = httpx.post(url, json=body | {"max_tokens": 2, "stream": True}, timeout=60)
        assert streamed.status_code == 400, streamed.text
        assert streamed.json()["error"]["param"] == "request_id"
        assert first.result().status_code == 200
        assert first.result().json()["id"] == "mine"


def test_a_disconnect_mid_stream_aborts_and_frees_the_pages(running) -> None:
    engine = running.server.engine
    free_before = engine.allocator.num_free()
    before = metrics(running)
    stream = running.client().completions.create(
        model="smollm2-4l", prompt=PROMPTS[2], max_tokens=100, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(2), stream):
        pass
    # Counted as generated, as vLLM counts them, not when the request ends: the step that
    # brought a token counted it before its event was sent.
    assert metrics(running)["vllm:generation_tokens_total"] \
        >= before["vllm:generation_tokens_total"] + 2
    stream.close()
    deadline = time.monotonic() + 60
    while metrics(running)["vllm:num_requests_running"] != 0:
        assert time.monotonic() < deadline, "the aborted request still runs"
        time.sleep(0.05)
    after = metrics(running)
    aborted = 'vllm:request_success_total{"finished_reason": "abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 100
    assert engine.allocator.num_free() == free_before
    assert not engine.scheduler.seqs


def test_eight_concurrent_streams_complete_and_share_steps(running) -> None:
    engine = running.server.engine
    first_step = engine.num_steps
    before = metrics(running)

    def stream(i: int) -> tuple[str, int]:
        chunks = list(running.client().completions.create(
            model="smollm2-4l", prompt=PROMPTS[i % 3] + " " * (i // 3), temperature=0,
            max_tokens=12, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}))
        return "".join(c.choices[0].text for c in chunks[:-1]), chunks[-1].usage

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))
    want = running.llm.generate([PROMPTS[i % 3] + " " * (i // 3) for i in range(8)],
                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [text for text, _ in results] == [w.text for w in want]
    records = [r for r in engine.step_records() if r.index >= first_step]
    assert max(r.decode_rows for r in records) > 1  # requests decoded together
    after = metrics(running)
    usages = [u for _, u in results]
    assert (after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
            == sum(u.completion_tokens for u in usages) == 8 * 12)
    assert (after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
            == sum(u.prompt_tokens for u in usages))
    done = 'vllm:request_success_total{"finished_reason": "length"}'
    assert after[done] - before.get(done, 0) == 8
    assert after["vllm:num_requests_running"] == 0
    assert after['infer:step_seconds_count{"kind": "decode"}'] > before.get(
        'infer:step_seconds_count{"kind": "decode"}', 0)


def _sse_events(response: httpx.Response) -> list:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_benchmark_clients_raw_payloads(running) -> None:
    """What `vllm bench serve` (openai and openai-chat backends) and SGLang's bench_serving
    send, byte for byte in their fields."""
    vllm_completion = {"model": "smollm2-4l", "prompt": PROMPTS[0], "repetition_penalty": 1.0,
                       "max_tokens": 9, "logprobs": None, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}, "temperature": 0.0}
    vllm_chat = {"model": "smollm2-4l", "messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPTS[1]}]}], "temperature": 0.0, "max_completion_tokens": 9,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    sglang = {"model": "smollm2-4l", "prompt": PROMPTS[2], "temperature": 0.0, "best_of": 1,
              "max_tokens": 9, "stream": True, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
    for path, body in (("completions", vllm_completion), ("chat/completions", vllm_chat),
                       ("completions", sglang)):
        with httpx.stream("POST", f"{running.url}/v1/{path}", json=body, timeout=60) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _sse_events(r)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9


def test_tokenize_and_detokenize(running) -> None:
    r = httpx.post(f"{running.url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert r["tokens"] == running.llm.tokenizer.encode(PROMPTS[0])
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    back = httpx.post(f"{running.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == PROMPTS[0]


TOKENIZE_BAD = [
    ("tokenize", {"prompt": "Hi", "add_special_tokens": "no"}, "add_special_tokens"),
    ("tokenize", {"prompt": "Hi", "add_special_tokens": 0}, "add_special_tokens"),
    ("tokenize", {"prompt": ["Hi"]}, "prompt"),
    ("detokenize", {"tokens": [72.9]}, "tokens"), ("detokenize", {"tokens": [True]}, "tokens"),
    ("detokenize", {"tokens": "72"}, "tokens"), ("detokenize", {}, "tokens"),
    ("detokenize", {"tokens": [10**30]}, "tokens"),
]


def test_tokenize_and_detokenize_refuse_ill_typed_fields(running) -> None:
    """Each a 400 naming the field, as the completion fields of the same names: "no" is not
    a request for BOS, nor is 72.9 token 72."""
    for path, body, param in TOKENIZE_BAD:
        r = httpx.post(f"{running.url}/{path}", json=body, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.text)


def test_a_client_that_times_out_aborts_its_whole_request(running) -> None:
    before = metrics(running)
    # The server's programs may be compiled already (engines over these weights share them):
    # the wait is the 110 decode steps alone, each reading the 113 MB tied head, ~0.2 s or more.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{running.url}/v1/completions", timeout=httpx.Timeout(10.0, read=0.05), json={
            "prompt": PROMPTS[0], "max_tokens": 110, "temperature": 0, "ignore_eos": True})
    deadline = time.monotonic() + 60
    aborted = 'vllm:request_success_total{"finished_reason": "abort"}'
    while metrics(running).get(aborted, 0) < before.get(aborted, 0) + 1:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    assert metrics(running)["vllm:num_requests_running"] == 0
    assert not running.server.engine.scheduler.seqs


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "smollm2-4l", "prompt": "a\ud800"}),
    ("/v1/completions", {"model": "smollm2-4l", "prompt": ["ok", "b\udfff"]}),
    ("/v1/chat/completions", {"model": "smollm2-4l",
                              "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/completions", {"model": "\ud800", "prompt": "hi"}),
    ("/v1/completions", {"model": "smollm2-4l", "prompt": "hi", "request_id": "\udc00"}),
    ("/tokenize", {"model": "smollm2-4l", "prompt": "\ud800"}),
])
def test_a_lone_surrogate_escape_is_a_400(running, path, body) -> None:
    """Valid JSON, no Unicode text: the tokenizer raised TypeError, a 404's rendering
    UnicodeEncodeError, and a request_id one failed after the whole generation: 500s."""
    raw = json.dumps(body).encode()  # ensure_ascii: the lone half goes as a \\udXXX escape
    assert rb"\ud" in raw
    r = httpx.post(f"{running.url}{path}", content=raw,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
    emoji = {"model": "smollm2-4l", "prompt": "\U0001F600", "max_tokens": 1}
    assert httpx.post(f"{running.url}/v1/completions", content=json.dumps(emoji).encode(),
                      headers={"content-type": "application/json"}).status_code == 200


def test_errors_quote_a_huge_value_in_part_and_ids_past_the_context_by_count(running) -> None:
    """A 400 quoted the whole value it refused (a 2M-entry stop_token_ids came back as 6 MB,
    rendered on the event loop); a prompt of millions of ids was checked id by id, twice,
    before its length was refused (25M ids: 36 s of the event loop). A list past the context
    that starts with an id is now refused by its count, whatever the rest holds."""
    from infer.serve.protocol import ApiError

    url = f"{running.url}/v1/completions"
    r = httpx.post(url, json={"model": "smollm2-4l", "prompt": "hi",
                              "stop_token_ids": list(range(200_000)) + [-1]}, timeout=60)
    assert r.status_code == 400, r.text[:200]
    assert len(r.json()["error"]["message"]) <= ApiError.MAX_MESSAGE_CHARS + 100
    r = httpx.post(url, json={"model": "smollm2-4l", "prompt": [5] + ["x"] * 200_000},
                   timeout=60)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"
    at_limit = httpx.post(url, json={"model": "smollm2-4l", "prompt": [5] * 127,
                                     "max_tokens": 1})
    assert at_limit.status_code == 200, at_limit.text
