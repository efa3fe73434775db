"""Response bodies checked with the official openai client's own types and parser, and
the logprobs token vocab against the real SmolLM2 tokenizer."""

import dataclasses
import os

import httpx
import numpy as np
import openai
import orjson
import pytest
from openai._models import construct_type
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion

from httpapi.errors import APIError, bad_request, engine_unavailable, model_not_found, unauthorized
from httpapi.info import check_model, models_body, served_model_name, server_info_body
from httpapi.logprobs import LOGPROB_FLOOR, LogprobVocab, TokenLogprobs
from httpapi.responses import (
    ChoiceResult,
    RandomIds,
    Usage,
    chat_completion_body,
    completion_body,
    generate_body,
    new_request_id,
    now,
    per_request_metrics,
)
from runtime.config import ServerArgs

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return LogprobVocab.from_tokenizer(tokenizer)


def client(handler) -> openai.OpenAI:
    """The real openai client; only the network is replaced, by a handler serving our bytes."""
    return openai.OpenAI(
        api_key="k",
        base_url="http://ringserve.test/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )


def serve(status: int, body: bytes):
    return lambda request: httpx.Response(status, content=body, headers={"content-type": "application/json"})


def logprobs_of(tokenizer, text: str, k: int) -> TokenLogprobs:
    ids = tokenizer.encode(text)
    rng = np.random.default_rng(0)
    top = rng.integers(0, 49152, size=(len(ids), k))
    return TokenLogprobs.of(ids, -rng.random(len(ids)), top, np.sort(-rng.random((len(ids), k)), axis=1)[:, ::-1])


def test_token_table_bytes_rebuild_the_text(tokenizer, vocab):
    text = "Hello, wörld! 你好 🦙 tab\tnewline\n  spaces"
    ids = tokenizer.encode(text)
    assert b"".join(vocab.bytes[i] for i in ids).decode() == tokenizer.decode(ids) == text
    assert len(vocab.bytes) == len(tokenizer) == 49152
    assert vocab.bytes[2] == b"<|im_end|>"  # special tokens are their own text
    # a token holding part of a UTF-8 character: escaped text, exact bytes
    partial = [i for i in ids if vocab.bytes[i] and not _is_utf8(vocab.bytes[i])]
    assert partial and all("\\x" in vocab.text[i] for i in partial)
    assert sum(vocab.chars[i] for i in ids) == len(text)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_chat_completion_parses_with_openai_types(tokenizer, vocab):
    lp = logprobs_of(tokenizer, "Paris is 🦙", 3)
    choices = [
        ChoiceResult(0, "Paris is 🦙", "stop", Usage(20, len(lp), 16), lp),
        ChoiceResult(1, "Lyon", "length", Usage(20, 4, 0), logprobs_of(tokenizer, "Lyon", 3)),
    ]
    body = chat_completion_body("chatcmpl-1", 1700000000, MODEL, choices, n=2, vocab=vocab)
    resp = ChatCompletion.model_validate(orjson.loads(body))
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.created == 1700000000
    assert [c.message.content for c in resp.choices] == ["Paris is 🦙", "Lyon"]
    assert [c.finish_reason for c in resp.choices] == ["stop", "length"]
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == 20 and resp.usage.completion_tokens == len(lp) + 4
    assert resp.usage.total_tokens == 20 + len(lp) + 4 and resp.usage.prompt_tokens_details.cached_tokens == 16
    content = resp.choices[0].logprobs.content
    assert bytes(b for t in content for b in t.bytes).decode() == "Paris is 🦙"
    assert [t.logprob for t in content] == pytest.approx(lp.logprobs.tolist())
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].token == vocab.text[int(lp.top_ids[0, 0])]


def test_completion_parses_with_openai_types(tokenizer, vocab):
    lp = logprobs_of(tokenizer, " a b ünï", 2)
    body = completion_body(
        "cmpl-1", now(), MODEL, [ChoiceResult(0, " a b ünï", "length", Usage(5, len(lp)), lp)], n=1, vocab=vocab
    )
    resp = Completion.model_validate(orjson.loads(body))
    assert resp.object == "text_completion" and resp.choices[0].text == " a b ünï"
    logprobs = resp.choices[0].logprobs
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    starts = [" a b ünï".find(t.strip()) for t in logprobs.tokens if "\\x" not in t]
    assert all(s >= 0 for s in starts)
    # OpenAI's: the chosen token always, so logprobs + 1 entries at most; vLLM's order: it first
    assert len(logprobs.top_logprobs) == len(lp) and all(len(d) <= 3 for d in logprobs.top_logprobs)
    assert [next(iter(d)) for d in logprobs.top_logprobs] == logprobs.tokens
    assert resp.usage.total_tokens == 5 + len(lp)


def test_completion_without_alternatives_and_minus_infinity(vocab):
    lp = TokenLogprobs.of([42, 43], [-np.inf, -0.5])
    body = completion_body("cmpl-2", now(), MODEL, [ChoiceResult(0, "xy", "stop", Usage(1, 2), lp)], 1, vocab)
    logprobs = Completion.model_validate(orjson.loads(body)).choices[0].logprobs
    assert logprobs.token_logprobs == [LOGPROB_FLOOR, -0.5]
    # logprobs 0: each position's own token alone, as vLLM answers
    assert [list(d.values()) for d in logprobs.top_logprobs] == [[LOGPROB_FLOOR], [-0.5]]
    assert [list(d) for d in logprobs.top_logprobs] == [[t] for t in logprobs.tokens]


def test_abort_finish_reason_reaches_the_client(vocab):
    """ "abort" is not in the openai types' Literal; the client's own parser takes it anyway."""
    body = chat_completion_body("chatcmpl-3", now(), MODEL, [ChoiceResult(0, "Par", "abort", Usage(3, 1))], 1)
    parsed = construct_type(type_=ChatCompletion, value=orjson.loads(body))
    assert parsed.choices[0].finish_reason == "abort" and parsed.choices[0].message.content == "Par"
    resp = client(serve(200, body)).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert resp.choices[0].finish_reason == "abort"


def test_openai_client_reads_a_completion(vocab):
    body = completion_body(
        new_request_id("cmpl"), now(), MODEL, [ChoiceResult(i, f"t{i}", "stop", Usage(4, 1)) for i in range(4)], n=2
    )
    resp = client(serve(200, body)).completions.create(model=MODEL, prompt=["a", "b"], n=2)
    assert [c.text for c in resp.choices] == ["t0", "t1", "t2", "t3"] and resp.id.startswith("cmpl-")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (8, 4)  # each prompt counted once


@pytest.mark.parametrize(
    "err,cls",
    [
        (bad_request("temperature must be between 0 and 2", "temperature"), openai.BadRequestError),
        (model_not_found("gpt-5"), openai.NotFoundError),
        (unauthorized(), openai.AuthenticationError),
        (engine_unavailable(), openai.InternalServerError),
    ],
)
def test_openai_client_maps_errors(err: APIError, cls):
    with pytest.raises(cls) as caught:
        client(serve(err.status, err.body())).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.status_code == err.status
    assert caught.value.body == {"message": err.message, "type": err.type, "param": err.param, "code": err.code}


def test_generate_body_is_sglang_shaped(vocab):
    lp = TokenLogprobs.of([42], [-0.25], [[42, 7]], [[-0.25, -2.0]])
    one = orjson.loads(
        generate_body(
            ["r1"],
            [ChoiceResult(0, "x", "stop", Usage(3, 1, 2), lp, matched_stop=2)],
            batch=False,
            vocab=vocab,
            return_text_in_logprobs=True,
        )
    )
    assert one["text"] == "x"
    meta = one["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 1, 2)
    assert meta["output_token_logprobs"] == [[-0.25, 42, vocab.text[42]]]
    assert meta["output_top_logprobs"] == [[[-0.25, 42, vocab.text[42]], [-2.0, 7, vocab.text[7]]]]
    batch = orjson.loads(
        generate_body(
            ["a", "b"],
            [ChoiceResult(0, "x", "length", Usage(3, 5)), ChoiceResult(1, "y", "abort", Usage(3, 1))],
            batch=True,
        )
    )
    assert [o["meta_info"]["finish_reason"] for o in batch] == [{"type": "length", "length": 5}, {"type": "abort"}]


def test_models_and_server_info():
    body = models_body((MODEL, "alias"), 1700000000, 8192)
    page = orjson.loads(body)
    assert page["object"] == "list" and Model.model_validate(page["data"][0]).id == MODEL
    # every name's root is the model, by name: never a path of the server's disk
    assert [card["root"] for card in page["data"]] == [MODEL, MODEL]
    listed = client(serve(200, body)).models.list()
    assert [m.id for m in listed] == [MODEL, "alias"]
    info = orjson.loads(
        server_info_body(dataclasses.asdict(ServerArgs(api_key="secret", port=1234)), max_total_num_tokens=1000)
    )
    assert info["port"] == 1234 and info["max_total_num_tokens"] == 1000 and "api_key" not in info
    assert "secret" not in orjson.dumps(info).decode()


def test_served_model_name_and_model_check():
    assert served_model_name(None) == MODEL
    assert served_model_name("/m/Qwen2-0.5B/") == "Qwen2-0.5B"
    assert served_model_name("/m/tiny.Q4_0.gguf") == "tiny.Q4_0"
    assert served_model_name("/m/x", "mine") == "mine"
    check_model(None, (MODEL,))
    check_model(MODEL, (MODEL,))
    with pytest.raises(APIError) as caught:
        check_model("gpt-4o", (MODEL,))
    assert (caught.value.status, caught.value.param, caught.value.code) == (404, "model", "model_not_found")


def test_usage_counts_each_prompt_once():
    per_choice = [Usage(10, 3, 8), Usage(10, 4, 10), Usage(7, 5, 0), Usage(7, 6, 7)]
    assert Usage.combine(per_choice, n=2) == Usage(17, 18, 8)
    assert Usage.combine(per_choice, n=1) == Usage(34, 18, 25)
    assert Usage(3, 4).as_dict() == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_logprob_vocab_of_a_sentencepiece_tokenizer():
    """Llama 2 / Mistral style: "▁" pieces and <0xNN> byte fallback (a real tokenizers object)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "<0xE2>", "<0x82>", "<0xAC>", "\u2581hello", "\u2581", "h", "i"]
    backend = Tokenizer(
        models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>", byte_fallback=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    spm = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    vocab = LogprobVocab.from_tokenizer(spm, vocab_size=12)
    assert vocab.bytes[:7] == [b"<unk>", b"<s>", b"</s>", b"\xe2", b"\x82", b"\xac", b" hello"]
    assert vocab.bytes[10:] == [b"", b""]  # a padded embedding's extra ids
    assert b"".join(vocab.bytes[i] for i in (6, 3, 4, 5)).decode() == " hello€"
    assert vocab.text[3] == "\\xe2" and vocab.chars[3:6] == [1, 0, 0]


def test_request_ids_are_distinct_across_pool_refills_and_forks():

    ids = RandomIds()
    seen = [ids.next_hex() for _ in range(3 * RandomIds.POOL_BYTES // RandomIds.ID_BYTES + 5)]
    assert len(set(seen)) == len(seen) and all(len(i) == 32 for i in seen)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's next id comes from a pool of its own, not the parent's copy
        os.write(write, ids.next_hex().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read), os.close(write)
    assert child != ids.next_hex() and child not in seen
    assert new_request_id("chatcmpl").startswith("chatcmpl-")


def test_vllms_prompt_keys_are_null_unless_asked(vocab):
    """vLLM's answers always hold `prompt_logprobs` and `prompt_token_ids` (the chat response's,
    each completion choice's), null unless asked, and its clients read them without a check."""
    chat = orjson.loads(
        chat_completion_body("chatcmpl-4", now(), MODEL, [ChoiceResult(0, "Hi", "stop", Usage(3, 1))], 1)
    )
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert ChatCompletion.model_validate(chat).prompt_logprobs is None  # an attribute, as vLLM's clients read it
    asked = orjson.loads(
        chat_completion_body(
            "chatcmpl-5", now(), MODEL, [ChoiceResult(0, "Hi", "stop", Usage(3, 1))], 1, None, None, [7, 8]
        )
    )
    assert asked["prompt_token_ids"] == [7, 8]
    body = completion_body("cmpl-3", now(), MODEL, [ChoiceResult(0, "x", "stop", Usage(1, 1))], 1, vocab)
    choice = orjson.loads(body)["choices"][0]
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None and "token_ids" not in choice


def test_per_request_metrics_split_the_request_at_its_submission_and_first_token():
    s = 1_000_000_000  # ns
    # arrived at 10 s, submitted at 10.25 s, first token at 11 s, 5 tokens by 13 s
    m = per_request_metrics(10 * s, 10 * s + s // 4, 11 * s, 13 * s, 5)
    assert m == pytest.approx(
        {
            "queue_time_ms": 250.0,
            "time_to_first_token_ms": 750.0,
            "generation_time_ms": 2000.0,
            "mean_itl_ms": 500.0,  # 4 gaps between 5 tokens
            "tokens_per_second": 5 / 2.75,  # from the submission: the prefill counts
        }
    )
    one = per_request_metrics(10 * s, 10 * s, 11 * s, 11 * s, 1)
    assert "mean_itl_ms" not in one and one["generation_time_ms"] == 0.0
    none_yet = per_request_metrics(10 * s, 10 * s, 0, 12 * s, 0)  # ended before a token (an abort)
    assert set(none_yet) == {"queue_time_ms", "tokens_per_second"} and none_yet["tokens_per_second"] == 0.0
