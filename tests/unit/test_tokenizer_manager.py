"""The TokenizerManager between real rings in this process: this test plays the scheduler
(pops the REQUEST channel), feeds the TEXT_OUT channel through a real Detokenizer core, and
hands what it pops to the TM as the worker process's reader does (deliver)."""

import asyncio
import gc
import threading
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from httpapi.errors import APIError, engine_unavailable
from ipc.channel import Channel
from ipc.ring import Batch
from protocol.payloads import pack_prompt_logprobs
from protocol.records import REQUEST, TOKEN_OUT, Finish, RequestKind, TokenKind
from protocol.sampling_params import SamplingParams
from runtime.detokenizer.core import Detokenizer
from runtime.http_worker.chat_template import ChatTemplate
from runtime.http_worker.core import LONG_CONVERSATION_MESSAGES, LONG_DECODE_IDS, ModelInfo, TokenizerManager
from runtime.http_worker.process import RequestOutbox


def deliver(tm: TokenizerManager, text_in: Channel) -> None:
    """Every TEXT_OUT batch waiting, to the TM."""
    while (batch := text_in.pop()) is not None:
        tm.dispatch(batch.records, batch.payload)


def opened(new: np.ndarray) -> Batch:
    """The scheduler's OPEN record of the request in the REQUEST record `new`."""
    rec = np.zeros(1, TOKEN_OUT.dtype)
    rec["kind"], rec["worker"], rec["slot"], rec["gen"] = TokenKind.OPEN, new["worker"], new["slot"], new["gen"]
    rec["prompt_tokens"] = new["prompt_len"]
    return Batch(rec, np.zeros(0, np.uint8))


def token(new: np.void, ids: list[int], k: int) -> Batch:
    """The scheduler's TOKEN record of the k-th of `ids` for the request in the REQUEST record
    `new` (a 3-token prompt), the last one finishing it by length."""
    rec = np.zeros(1, TOKEN_OUT.dtype)
    rec["kind"], rec["worker"], rec["slot"], rec["gen"] = TokenKind.TOKEN, new["worker"], new["slot"], new["gen"]
    rec["token"], rec["prompt_tokens"], rec["completion_tokens"] = ids[k - 1], 3, k
    rec["finish"] = Finish.LENGTH if k == len(ids) else Finish.NONE
    return Batch(rec, np.zeros(0, np.uint8))


def test_request_the_detokenizer_refuses_is_aborted_in_the_scheduler(tokenizer, tm_rings):
    """The detokenizer refuses a request past its open limit (503 overloaded) while the scheduler
    holds it: the TM must abort it there, or it runs to max_tokens for nobody (seen: six such
    requests of 4000 tokens each after a burst of 70 x 128 choices)."""
    waker, req_out, req_in, text_out, text_in = tm_rings
    router = Detokenizer(tokenizer, max_open=1)
    model = ModelInfo("", "m", "LlamaForCausalLM", 256, tokenizer.vocab_size)

    async def run() -> tuple[np.ndarray, np.ndarray]:
        tm = TokenizerManager(0, RequestOutbox(req_out).send, tokenizer, model, request_timeout=60)
        try:
            params = SamplingParams(max_new_tokens=4000, ignore_eos=True)
            groups = [await tm.submit([[1, 2, 3]], [params]) for _ in range(2)]
            news = req_in.pop().records
            assert news["kind"].tolist() == [RequestKind.NEW] * 2
            for new in news:  # the second OPEN is past the detokenizer's limit
                recs, blob = router.handle(opened(new))
                if len(recs):
                    text_out.push_all(recs, blob)
            deliver(tm, text_in)
            with pytest.raises(APIError) as refused:
                await asyncio.wait_for(groups[1].finished(), 5)
            assert refused.value.status == 503
            assert not groups[0].done
            batch = req_in.pop()
            return news, np.zeros(0, REQUEST.dtype) if batch is None else batch.records
        finally:
            tm.close()

    news, aborts = asyncio.run(run())
    address = [(int(r["kind"]), int(r["slot"]), int(r["gen"])) for r in aborts]
    assert address == [(RequestKind.ABORT, int(news[1]["slot"]), int(news[1]["gen"]))]


def test_stream_interval_wakes_a_stream_every_k_tokens_and_a_non_stream_at_its_end(tokenizer, tm_rings):
    """--stream-interval 3: a streamed choice's coroutine wakes at tokens 1, 4, 7 and at its
    end (SGLang's rule), with every token's text; a non-streamed one once, at its end."""
    waker, req_out, req_in, text_out, text_in = tm_rings
    router = Detokenizer(tokenizer, max_open=4)
    model = ModelInfo("", "m", "LlamaForCausalLM", 256, tokenizer.vocab_size)
    ids = tokenizer.encode(" one two three four five six seven eight", add_special_tokens=False)
    assert len(ids) == 8

    async def watch(group) -> tuple[list[int], str]:
        woken, text = [], ""
        while not group.done:
            for state in await group.next_news():
                woken.append(state.completion_tokens)
                text += state.take()[0]
        return woken, text

    async def run():
        tm = TokenizerManager(0, RequestOutbox(req_out).send, tokenizer, model, request_timeout=60, stream_interval=3)
        try:
            params = SamplingParams(max_new_tokens=len(ids))
            streamed = await tm.submit([[1, 2, 3]], [params], stream=True)
            whole = await tm.submit([[1, 2, 3]], [params])
            watchers = [asyncio.create_task(watch(g)) for g in (streamed, whole)]
            news = req_in.pop().records
            for batch in [opened(new) for new in news] + [token(new, ids, k) for k in range(1, 9) for new in news]:
                text_out.push_all(*router.handle(batch))
                deliver(tm, text_in)
                await asyncio.sleep(0.02)  # each record read, and its coroutine run, before the next
            return await asyncio.gather(*watchers)
        finally:
            tm.close()

    (stream_woken, stream_text), (whole_woken, whole_text) = asyncio.run(run())
    want = tokenizer.decode(ids)
    assert (stream_woken, stream_text) == ([1, 4, 7, 8], want)
    assert (whole_woken, whole_text) == ([8], want)


def test_a_finished_request_is_freed_by_refcount_alone(tokenizer, tm_rings):
    """A choice holds its group weakly: once a request ended and its route let go of its group,
    the group, its states and their lists are freed at once, with the cyclic collector off. A
    cycle between them left every request's objects to the collector, whose young collections
    then ran every ~2,000 requests of a busy worker, each scanning every live request."""
    waker, req_out, req_in, text_out, text_in = tm_rings
    router = Detokenizer(tokenizer, max_open=4)
    model = ModelInfo("", "m", "LlamaForCausalLM", 256, tokenizer.vocab_size)
    ids = tokenizer.encode(" one two three", add_special_tokens=False)

    async def run() -> tuple[str, weakref.ref]:
        tm = TokenizerManager(0, RequestOutbox(req_out).send, tokenizer, model, request_timeout=60)
        try:
            group = await tm.submit([[1, 2, 3]], [SamplingParams(max_new_tokens=len(ids))], stream=True)
            new = req_in.pop().records[0]
            for batch in [opened(new)] + [token(new, ids, k) for k in range(1, len(ids) + 1)]:
                text_out.push_all(*router.handle(batch))
                deliver(tm, text_in)
            (state,) = await group.finished()
            text = state.take()[0]
            freed = weakref.ref(group)
            del group, state
            return text, freed
        finally:
            tm.close()

    gc.disable()
    try:
        text, freed = asyncio.run(run())
        assert text == tokenizer.decode(ids)
        assert freed() is None
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def template(tokenizer):
    return ChatTemplate(tokenizer)


ROLE_TEXT = st.tuples(
    st.sampled_from(["system", "user", "assistant"]), st.text(st.characters(codec="utf-8"), max_size=30)
)


@settings(max_examples=150, deadline=None)
@given(conversation=st.lists(ROLE_TEXT, min_size=1, max_size=5))
def test_chat_template_renders_as_apply_chat_template(tokenizer, template, conversation):
    messages = [{"role": role, "content": text} for role, text in conversation]
    assert template.fast
    want = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=False)
    assert template.render(messages) == want
    assert template.render(messages) == want  # a render leaves nothing behind for the next


def test_big_decodes_and_conversations_run_off_the_event_loop(tokenizer, tm_rings):
    """A /detokenize of many ids or a chat template of a long conversation would stall every
    stream of the worker while it runs on the event loop: both go to a thread past a size."""
    waker, req_out, req_in, text_out, text_in = tm_rings
    model = ModelInfo("", "m", "LlamaForCausalLM", 4096, tokenizer.vocab_size)
    loop_threads = []

    async def run() -> tuple[set[int], set[int], set[int], set[int]]:
        tm = TokenizerManager(0, RequestOutbox(req_out).send, tokenizer, model, request_timeout=60)
        loop_threads.append(threading.get_ident())
        decoded, rendered = [], []
        decode, render = tokenizer.decode, tm._chat_template.render

        def watched_decode(*args, **kwargs):
            decoded.append(threading.get_ident())
            return decode(*args, **kwargs)

        def watched_render(messages):
            rendered.append(threading.get_ident())
            return render(messages)

        tm.tokenizer.decode, tm._chat_template.render = watched_decode, watched_render
        try:
            assert await tm.decode([42] * 8) == decode([42] * 8)
            small_decode = set(decoded)
            assert await tm.decode([42] * (LONG_DECODE_IDS + 1)) == decode([42] * (LONG_DECODE_IDS + 1))
            big_decode = set(decoded) - small_decode
            await tm.chat_ids([{"role": "user", "content": "hi"}])
            small_render = set(rendered)
            turns = [
                {"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(LONG_CONVERSATION_MESSAGES + 1)
            ]
            await tm.chat_ids(turns)
            big_render = set(rendered) - small_render
            return small_decode, big_decode, small_render, big_render
        finally:
            del tm.tokenizer.decode
            tm.close()

    small_decode, big_decode, small_render, big_render = asyncio.run(run())
    assert small_decode == small_render == {loop_threads[0]}
    assert big_decode and big_render and loop_threads[0] not in big_decode | big_render


def test_prompt_logprobs_records_are_collected_without_a_wake(tokenizer, tm_rings):
    """TEXT_OUT PROMPT_LOGPROBS records (two, as a chunked prefill sends them) are kept on the
    choice as PromptLogprobs columns: no wake, no TTFT, no completion count, until the first
    token's record, which wakes the streamed choice; take_prompt_logprobs joins them once. A
    stale one (an old generation of the slot) is dropped."""
    waker, req_out, req_in, text_out, text_in = tm_rings
    router = Detokenizer(tokenizer, max_open=4)
    model = ModelInfo("", "m", "LlamaForCausalLM", 256, tokenizer.vocab_size)
    prompt = list(range(300, 307))  # 7 positions: [0, 4) then [4, 7)
    lps = np.array([np.nan, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0], np.float32)
    ranks = np.arange(7) + 1
    top_ids = np.array([[0, 0]] + [[t, t + 1] for t in prompt[1:]])
    top_lps = np.stack([lps, lps - 1], axis=1)

    def prompt_record(new: np.void, first: int, end: int, gen=None) -> Batch:
        rec = np.zeros(1, TOKEN_OUT.dtype)
        rec["kind"], rec["worker"], rec["slot"] = TokenKind.PROMPT_LOGPROBS, new["worker"], new["slot"]
        rec["gen"] = new["gen"] if gen is None else gen
        rec["token"], rec["completion_tokens"], rec["prompt_tokens"], rec["n_top"] = first, end - first, 7, 2
        part = pack_prompt_logprobs(
            prompt[first:end], lps[first:end], ranks[first:end], top_ids[first:end], top_lps[first:end]
        )
        rec["payload_off"], rec["payload_len"] = 0, len(part)
        return Batch(rec, np.frombuffer(part, np.uint8))

    def token(new: np.void) -> Batch:
        rec = np.zeros(1, TOKEN_OUT.dtype)
        rec["kind"], rec["worker"], rec["slot"], rec["gen"] = TokenKind.TOKEN, new["worker"], new["slot"], new["gen"]
        rec["token"], rec["prompt_tokens"], rec["completion_tokens"] = tokenizer.encode(" ok")[0], 7, 1
        rec["finish"] = Finish.LENGTH
        return Batch(rec, np.zeros(0, np.uint8))

    async def feed(tm: TokenizerManager, batch: Batch) -> None:
        text_out.push_all(*router.handle(batch))
        deliver(tm, text_in)
        await asyncio.sleep(0.05)  # anything woken runs

    async def run():
        tm = TokenizerManager(0, RequestOutbox(req_out).send, tokenizer, model, request_timeout=60)
        try:
            params = SamplingParams(max_new_tokens=1, prompt_logprobs=2)
            group = await tm.submit([prompt], [params], stream=True)
            (new,) = req_in.pop().records
            (state,) = group.states
            await feed(tm, opened(new))
            await feed(tm, prompt_record(new, 0, 4))
            await feed(tm, prompt_record(new, 0, 4, gen=int(new["gen"]) + 1))  # stale
            await feed(tm, prompt_record(new, 4, 7))
            before = (list(group.news), state.first_ns, state.completion_tokens, len(state.prompt_logprobs))
            await feed(tm, token(new))
            news = await asyncio.wait_for(group.next_news(), 5)
            return before, news, state, state.take_prompt_logprobs(), state.take_prompt_logprobs()
        finally:
            tm.close()

    before, news, state, plp, again = asyncio.run(run())
    assert before == ([], 0, 0, 2), "prompt logprobs alone wake nothing and count no token"
    assert news == [state] and state.first_ns > 0 and state.completion_tokens == 1
    assert plp.first == 0 and plp.token_ids.tolist() == prompt and plp.ranks.tolist() == ranks.tolist()
    np.testing.assert_array_equal(plp.logprobs, lps)
    np.testing.assert_array_equal(plp.top_ids, top_ids)
    np.testing.assert_array_equal(plp.top_logprobs, top_lps)
    assert again is None, "taken once"


def test_an_engine_gone_fails_each_request_with_an_error_of_its_own(tokenizer, tm_rings):
    """While the engine is gone every request fails with the kept 503. Raised as that one
    instance, each raise would prepend the failing request's frames to its __traceback__ and
    keep them alive: the HTTP worker grew tens of MB during each engine restart of the soak
    (and without bound once restarts were used up), the more the more 503s it answered."""
    waker, req_out, req_in, text_out, text_in = tm_rings
    model = ModelInfo("", "m", "LlamaForCausalLM", 256, tokenizer.vocab_size)

    async def run() -> tuple[list[APIError], list[APIError], APIError]:
        tm = TokenizerManager(0, RequestOutbox(req_out).send, tokenizer, model, request_timeout=60)
        try:
            in_flight = [await tm.submit([[1, 2, 3]], [SamplingParams(max_new_tokens=8)]) for _ in range(2)]
            kept = engine_unavailable("The engine's scheduler process exited")
            tm.fail_all(kept)
            failed = []
            for group in in_flight:
                with pytest.raises(APIError) as e:
                    await group.finished()
                failed.append(e.value)
            refused = []
            for _ in range(50):
                with pytest.raises(APIError) as e:
                    await tm.submit([[1, 2, 3]], [SamplingParams(max_new_tokens=8)])
                refused.append(e.value)
                with pytest.raises(APIError) as e:  # an engine call (pause, weights) alike
                    await tm.call({"op": "pause"}, timeout=1)
                refused.append(e.value)
            return failed, refused, kept
        finally:
            tm.close()

    failed, refused, kept = asyncio.run(run())
    errors = failed + refused
    assert all(e.status == 503 and e.message == kept.message for e in errors)
    assert len({id(e) for e in errors} | {id(kept)}) == len(errors) + 1
    assert kept.__traceback__ is None
    assert max(traceback_length(e) for e in refused) == traceback_length(refused[0])


def traceback_length(err: BaseException) -> int:
    n, tb = 0, err.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n
