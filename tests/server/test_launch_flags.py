"""SGLang's and vLLM's launch flags (runtime/config.py): every alias of a ringserve setting, by
flag and by environment variable; the refusals (tensor / data parallelism, an alias and its
target given different values); list settings; then a real server (the null model) started
with several served names, a copied --tokenizer-path, vLLM's aliases, --log-requests, --root-path,
--return-tokens-as-token-ids, --enable-force-include-usage, --max-logprobs and
--enable-per-request-metrics, and
`python -m runtime serve --tp 2` refused with the reason."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest

from runtime.config import ALIASES, ServerArgs
from runtime.http_worker.asgi import Cors

# ---------------------------------------------------------------- parsing

ALIAS_VALUES = {
    "max_model_len": ("512", 512),
    "gpu_memory_utilization": ("0.5", 0.5),
    "max_num_seqs": ("8", 8),
    "max_num_batched_tokens": ("4096", 4096),
    "tensor_parallel_size": ("1", 1),
    "tp": ("1", 1),
    "data_parallel_size": ("1", 1),
    "dp": ("1", 1),
    "lora_modules": ("a4=/adapters/a4", ("a4=/adapters/a4",)),
    "max_loras": ("4", 4),
}
NEEDS_LORA = ("lora_modules",)  # an adapter without --enable-lora is refused


@pytest.mark.parametrize("alias", list(ALIASES))
def test_alias_by_flag_and_env(alias):
    raw, value = ALIAS_VALUES[alias]
    target = ALIASES[alias]
    lora = alias in NEEDS_LORA
    by_flag = ServerArgs.from_cli([f"--{alias.replace('_', '-')}", raw, *(["--enable-lora"] if lora else [])])
    by_env = ServerArgs.from_env(
        {f"RINGSERVE_{alias.upper()}": raw, **({"RINGSERVE_ENABLE_LORA": "1"} if lora else {})}
    )
    assert getattr(by_flag, target) == value and by_env == by_flag
    assert ServerArgs.from_env(by_flag.to_env()) == by_flag  # the alias travels as its target's variable
    assert f"RINGSERVE_{alias.upper()}" not in by_flag.to_env()


def test_every_alias_is_tested_and_no_field_is_an_alias():
    fields = set(ServerArgs.__dataclass_fields__)
    assert set(ALIASES) == set(ALIAS_VALUES)
    assert not set(ALIASES) & fields and set(ALIASES.values()) <= fields


def test_vllm_short_flags():
    assert ServerArgs.from_cli(["-tp", "1", "-dp", "1"]).tp_size == 1


def test_alias_and_target_agreeing_is_fine():
    args = ServerArgs.from_cli(["--max-model-len", "512", "--context-length", "512"])
    assert args.context_length == 512


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--max-model-len", "512", "--context-length", "1024"], "--max-model-len 512 and --context-length 1024"),
        (["--max-num-seqs", "8", "--max-running-requests", "9"], "conflict"),
        (
            [
                "--tp",
                "1",
                "--tensor-parallel-size",
                "1",
                "--max-num-batched-tokens",
                "1",
                "--chunked-prefill-size",
                "2",
            ],
            "conflict",
        ),
        (["--tp", "2"], "tensor parallelism is not supported; run several servers behind sglang-router"),
        (["--tensor-parallel-size", "4"], "tensor parallelism is not supported"),
        (["--tp-size", "2"], "tensor parallelism is not supported"),
        (["--dp", "2"], "data parallelism is not supported; run several servers behind sglang-router"),
        (["--served-model-name", '["a,b"]'], "served-model-name"),
        (["--allowed-origins", '["a"'], "JSON list"),
        (["--root-path", "api/"], "--root-path must be a path"),
        (["--root-path", "/api/"], "--root-path must be a path"),
    ],
)
def test_refusals(argv, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs.from_cli(argv)


@pytest.mark.parametrize(
    "env,match",
    [
        ({"RINGSERVE_MAX_MODEL_LEN": "512", "RINGSERVE_CONTEXT_LENGTH": "1024"}, "RINGSERVE_MAX_MODEL_LEN 512"),
        ({"RINGSERVE_TP": "2"}, "tensor parallelism is not supported"),
        ({"RINGSERVE_GPU_MEMORY_UTILIZATION": "x"}, "RINGSERVE_GPU_MEMORY_UTILIZATION"),
    ],
)
def test_env_refusals(env, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs.from_env(env)


def test_list_settings():
    args = ServerArgs.from_cli(
        ["--served-model-name", "first", "second", "--allowed-origins", '["http://a", "http://b"]']
    )
    assert args.served_model_name == ("first", "second")
    assert args.allowed_origins == ("http://a", "http://b")
    assert ServerArgs.from_env(args.to_env()) == args
    assert ServerArgs.from_env({"RINGSERVE_SERVED_MODEL_NAME": "x, y"}).served_model_name == ("x", "y")
    assert ServerArgs.from_env({"RINGSERVE_ALLOWED_ORIGINS": "[]"}).allowed_origins == ()
    assert ServerArgs.from_cli(["--allowed-origins"]).allowed_origins == ()  # no value: none
    assert ServerArgs(served_model_name=["a"]).served_model_name == ("a",)  # the engine's spec: JSON lists


def test_defaults():
    """No CORS unless origins are listed (a page on another origin cannot read the answers); methods
    and headers then default to any."""
    args = ServerArgs()
    assert args.allowed_origins == () and args.allowed_methods == args.allowed_headers == ("*",)
    assert not args.allow_credentials and args.tp_size == args.dp_size == 1
    assert Cors.of(args) is None and Cors.of(ServerArgs(allowed_origins=("*",))) is not None


def test_accepted_flags_without_effect():
    args = ServerArgs.from_cli(["--trust-remote-code", "--enable-metrics", "--disable-cuda-graph", "--log-requests"])
    assert args.trust_remote_code and args.enable_metrics and args.disable_cuda_graph and args.log_requests
    helps = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for words in ("never code from the hub", "/metrics is always on", "captures no CUDA graphs", "--max-model-len"):
        assert words in " ".join(helps.split()), words


def test_serve_tp_2_fails_with_the_reason():
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", "--tp", "2"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "tensor parallelism is not supported; run several servers behind sglang-router" in done.stderr


def test_serve_refuses_a_tokenizer_path_without_a_tokenizer(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", "--tokenizer-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "--tokenizer-path" in done.stderr


# ---------------------------------------------------------------- a real server

NAMES = ("primary", "alias-b", "alias-c")


@pytest.fixture(scope="module")
def tokenizer_copy(tmp_path_factory):
    from gpu.models.model_files import resolve_model_dir

    src = resolve_model_dir(None)
    dst = tmp_path_factory.mktemp("tokenizer")
    for path in src.iterdir():
        if path.name.startswith("tokenizer") or path.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(path, dst / path.name)
    return dst


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("log") / "server.err"


@pytest.fixture(scope="module")
def server(start_server, tokenizer_copy, server_log):
    """Its stderr (the workers' logs) goes to server_log: fd 2 is that file while it starts."""
    saved = os.dup(2)
    with open(server_log, "wb") as log:
        os.dup2(log.fileno(), 2)
    try:
        return start(start_server, tokenizer_copy)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def start(start_server, tokenizer_copy):
    return start_server(
        start_server.Server.granian,
        null_model=True,
        served_model_name=",".join(NAMES),
        tokenizer_path=tokenizer_copy,
        log_requests=1,
        max_model_len=1024,  # vLLM's names, as environment variables
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        max_total_tokens=8192,
        return_tokens_as_token_ids=1,
        enable_force_include_usage=1,
        root_path="/api/llm",
        max_logprobs=3,
        enable_per_request_metrics=1,
    )


def test_served_names_through_the_openai_client(server):
    client = server.openai_client()
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        out = client.completions.create(model=name, prompt="Hi", max_tokens=3)
        assert out.model == NAMES[0] and out.choices[0].text
        assert client.models.retrieve(name).id == name
    chat = client.chat.completions.create(model=NAMES[2], messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == NAMES[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_aliases_reach_the_engine(server):
    info = httpx.get(server.url("/get_server_info"), timeout=30).json()
    assert info["context_length"] == 1024 and info["max_running_requests"] == 8
    assert info["mem_fraction_static"] == 0.3


def test_tokens_as_ids_and_forced_usage(server):
    """--return-tokens-as-token-ids: logprobs name tokens "token_id:<id>" (a request may say
    false); --enable-force-include-usage: a stream carries usage unasked, on every chunk (each
    choice's tokens so far, as vLLM's) and in a chunk of its own at the end."""
    client = server.openai_client()
    lp = client.completions.create(model=NAMES[0], prompt="Hi", max_tokens=4, logprobs=2).choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens) and len(lp.tokens) == 4
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp.top_logprobs for t in top)
    chat = client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True
    )
    assert all(re.fullmatch(r"token_id:\d+", c.token) for c in chat.choices[0].logprobs.content)
    ids = [int(t.split(":")[1]) for t in lp.tokens]
    text = httpx.post(server.url("/detokenize"), json={"tokens": ids}, timeout=30).json()["text"]
    plain = client.completions.create(
        model=NAMES[0], prompt="Hi", max_tokens=4, logprobs=0, extra_body={"return_tokens_as_token_ids": False}
    )
    assert "".join(plain.choices[0].logprobs.tokens) == text == plain.choices[0].text
    chunks = list(client.completions.create(model=NAMES[0], prompt="Hi", max_tokens=3, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks)
    chat = client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    used = [c.usage.completion_tokens for c in chat]
    assert used == sorted(used) and used[-1] == 3


def test_max_logprobs_bounds_every_field_that_asks_for_logprobs(server):
    """--max-logprobs (vLLM's): a request asking more per position is a 400 naming its field;
    -1, the whole vocabulary, too (a server that serves it: test_whole_vocab_logprobs_server)."""
    hi = [{"role": "user", "content": "Hi"}]
    chat = {"model": NAMES[0], "messages": hi, "max_tokens": 2, "logprobs": True}
    completion = {"model": NAMES[0], "prompt": "Hi", "max_tokens": 2}
    ok = httpx.post(server.url("/v1/chat/completions"), json={**chat, "top_logprobs": 3}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    for path, body, param in [
        ("/v1/chat/completions", {**chat, "top_logprobs": 4}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "logprob_token_ids": [1, 2, 3, 4]}, "logprob_token_ids"),
        ("/v1/completions", {**completion, "logprobs": 4}, "logprobs"),
        ("/v1/completions", {**completion, "prompt_logprobs": 4}, "prompt_logprobs"),
        ("/v1/completions", {**completion, "echo": True, "logprobs": 4}, "logprobs"),
        ("/v1/chat/completions", {**chat, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {**completion, "logprobs": -1}, "logprobs"),
    ]:
        r = httpx.post(server.url(path), json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert "--max-logprobs" in r.json()["error"]["message"]


TIMINGS = {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "mean_itl_ms", "tokens_per_second"}


def test_per_request_metrics_on_one_choice_answers(server):
    """--enable-per-request-metrics (vLLM's): a one-choice answer's `metrics`, consistent with
    each other; a stream's ride its usage chunk alone; answers of several choices carry none."""
    client = server.openai_client()
    hi = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=NAMES[0], messages=hi, max_tokens=4, extra_body={"min_tokens": 4})
    m = chat.model_extra["metrics"]
    assert set(m) == TIMINGS and all(v >= 0 for v in m.values())
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / 3)
    seconds = (m["time_to_first_token_ms"] + m["generation_time_ms"]) / 1000
    assert m["tokens_per_second"] == pytest.approx(4 / seconds, rel=0.01)
    completion = client.completions.create(model=NAMES[0], prompt="Hi", max_tokens=2)
    assert set(completion.model_extra["metrics"]) == TIMINGS
    chunks = list(client.chat.completions.create(model=NAMES[0], messages=hi, max_tokens=1, stream=True))
    assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])
    assert chunks[-1].choices == [] and set(chunks[-1].model_extra["metrics"]) == TIMINGS - {"mean_itl_ms"}
    several = [
        client.chat.completions.create(model=NAMES[0], messages=hi, max_tokens=2, n=2),
        client.completions.create(model=NAMES[0], prompt=["Hi", "Yo"], max_tokens=2),
    ]
    assert all("metrics" not in (a.model_extra or {}) for a in several)


def test_root_path_is_served_and_so_is_the_bare_path(server):
    """--root-path (vLLM's): a proxy that keeps the prefix and one that strips it both work."""
    assert httpx.get(server.url("/api/llm/v1/models"), timeout=30).json()["data"][0]["id"] == NAMES[0]
    assert httpx.get(server.url("/v1/models"), timeout=30).status_code == 200
    assert httpx.get(server.url("/api/llmx/v1/models"), timeout=30).status_code == 404
    out = openai.OpenAI(base_url=server.url("/api/llm/v1"), api_key="none", max_retries=0).completions.create(
        model=NAMES[0], prompt="Hi", max_tokens=2
    )
    assert out.choices[0].text


def test_tokenizer_path_is_used(server, tokenizer_copy):
    info = httpx.get(server.url("/get_model_info"), timeout=30).json()
    assert info["tokenizer_path"] == str(tokenizer_copy) and info["model_path"] != str(tokenizer_copy)
    ids = httpx.post(server.url("/tokenize"), json={"prompt": "Hello world"}, timeout=30).json()["tokens"]
    text = httpx.post(server.url("/detokenize"), json={"tokens": ids}, timeout=30).json()["text"]
    assert text == "Hello world"


def test_log_requests(server, server_log):
    rid = "logged-request-1"
    httpx.post(
        server.url("/v1/completions"),
        headers={"x-request-id": rid},
        json={"prompt": "a secret prompt text", "max_tokens": 4},
        timeout=60,
    ).raise_for_status()
    deadline = time.monotonic() + 10
    err = ""
    while time.monotonic() < deadline and f"cmpl-{rid}" not in err:
        time.sleep(0.2)
        err = server_log.read_text()
    (line,) = [line for line in err.splitlines() if f"cmpl-{rid}" in line]
    assert "completions" in line and "completion tokens" in line and "finish length" in line
    assert "secret" not in err


def test_no_cors_by_default(server):
    """Without --allowed-origins no answer carries CORS headers and a preflight is a 405, so a
    page on another origin cannot read the server's answers."""
    resp = httpx.get(server.url("/v1/models"), headers={"origin": "http://anywhere.example"}, timeout=30)
    assert resp.status_code == 200 and not any(k.startswith("access-control-") for k in resp.headers)
    pre = httpx.options(
        server.url("/v1/chat/completions"),
        headers={"origin": "http://anywhere.example", "access-control-request-method": "POST"},
        timeout=30,
    )
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
