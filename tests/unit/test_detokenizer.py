"""The batch incremental detokenizer (runtime/detokenizer/incremental.py) against tokenizer.decode, with the
real SmolLM2 tokenizer (byte table and window paths) and a SentencePiece-style tokenizer."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from runtime.detokenizer.incremental import BatchDetokenizer, DetokOptions
from runtime.detokenizer.stop_strings import StopMatcher

CAPACITY = 64
TEXTS = [
    "héllo wörld, naïve café — déjà vu",
    "😀👍🏽🤖🧠🎉 emoji 👨‍👩‍👧‍👦 family ✓ ∑∫√",
    "世界你好，こんにちは、안녕하세요 Ελληνικά Русский",
    "plain ascii text with numbers 12345 and symbols {}[]<>",
]


@pytest.fixture(scope="module")
def table_detok(tokenizer):
    det = BatchDetokenizer(tokenizer, CAPACITY)
    assert det.table is not None, det.fallback_reason
    return det


@pytest.fixture(scope="module")
def window_detok(tokenizer):
    det = BatchDetokenizer(tokenizer, CAPACITY, use_byte_table=False)
    assert det.table is None
    return det


@pytest.fixture(params=["vectorised", "python", "window"])
def detok(request, table_detok, window_detok):
    """The byte table with every step vectorised (requests that need it still go through
    Python) or every step through the per-request Python path; or the window decode."""
    if request.param == "window":
        return window_detok
    table_detok.small_batch = 0 if request.param == "vectorised" else 1 << 30
    return table_detok


def stream(det, streams, options, rng, max_per_step=3):
    """Feeds every stream through det with random interleaving and 1..max_per_step tokens per
    request per step; checks each delta is whole UTF-8; -> (text, stop index) per stream."""
    assert len(streams) <= det.capacity
    for r, opt in enumerate(options):
        det.open(r, opt)
    pos = [0] * len(streams)
    text = [b""] * len(streams)
    stop = [None] * len(streams)
    while any(s is None for s in stop):
        queues = []
        for r in range(len(streams)):
            if stop[r] is None and rng.random() < 0.8:
                n = int(rng.integers(1, max_per_step + 1))
                queues.append(
                    [(r, t, pos[r] + k + 1 == len(streams[r])) for k, t in enumerate(streams[r][pos[r] : pos[r] + n])]
                )
                pos[r] = min(pos[r] + n, len(streams[r]))
        rows = []  # requests interleaved at random, each request's tokens in order
        while queues:
            q = queues[int(rng.integers(len(queues)))]
            rows.append(q.pop(0))
            queues = [q for q in queues if q]
        if not rows:
            continue
        req, tok, fin = (np.array(c) for c in zip(*rows))
        out = det.step(req, tok, fin)
        assert len(set(out.req.tolist())) == len(out.req), "one delta per request per step"
        for i, r in enumerate(out.req.tolist()):
            delta = out.delta(i)
            delta.decode("utf-8")  # raises on a broken character
            assert stop[r] is None, "output after the request finished"
            assert delta or out.finished[i], "empty delta for an unfinished request"
            text[r] += delta
            if out.finished[i]:
                stop[r] = int(out.stop[i])
    return [t.decode() for t in text], stop


def partial_tokens(tokenizer, limit=200):
    """Ids whose bytes are not valid UTF-8 on their own (pieces of multi-byte characters)."""
    ids = []
    for i in range(len(tokenizer)):
        if "\ufffd" in tokenizer.decode([i]):
            ids.append(i)
            if len(ids) == limit:
                break
    return ids


def test_byte_table_is_chosen_and_exact(tokenizer, table_detok):
    assert table_detok.fallback_reason == ""
    t = table_detok.table
    for i in (0, 2, 100, 10813, len(tokenizer) - 1):
        assert t.pieces[i] == t.blob[t.offset[i] : t.offset[i] + t.length[i]].tobytes()
    assert t.length[t.size] == 0 and t.plain[t.size]
    assert not t.plain[2], "added tokens never take the vectorised path"


def test_multibyte_characters_split_across_tokens(tokenizer, detok):
    streams = [tokenizer.encode(s, add_special_tokens=False) for s in TEXTS]
    assert any("\ufffd" in tokenizer.decode([i]) for i in streams[1]), "emoji must span several tokens"
    rng = np.random.default_rng(0)
    for max_per_step in (1, 3):
        got, stop = stream(detok, streams, [DetokOptions()] * len(streams), rng, max_per_step)
        assert got == TEXTS and stop == [-1] * len(streams)


@pytest.mark.parametrize("skip", [True, False])
def test_random_streams_equal_decode(tokenizer, detok, skip):
    rng = np.random.default_rng(1 + skip)
    partial = partial_tokens(tokenizer)
    specials = sorted(tokenizer.added_tokens_decoder)
    streams = []
    for r in range(CAPACITY):
        n = int(rng.integers(1, 40))
        pool = [rng.integers(0, len(tokenizer), n), rng.choice(partial, n), rng.choice(specials, n)]
        mix = rng.integers(0, 3, n) if r % 2 else rng.choice(3, n, p=[0.2, 0.7, 0.1])
        streams.append([int(pool[m][k]) for k, m in enumerate(mix)])
    opts = [DetokOptions(skip_special_tokens=skip)] * len(streams)
    got, _ = stream(detok, streams, opts, rng)
    for ids, text in zip(streams, got):
        assert text == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_adversarial_streams_equal_decode(tokenizer, detok):
    """Truncated and reordered pieces of multi-byte characters, specials in between."""
    rng = np.random.default_rng(3)
    emoji = tokenizer.encode("😀🤖世界é", add_special_tokens=False)
    streams = [
        emoji[:1],
        emoji[1:2],
        emoji[:2] + [2] + emoji[2:],
        emoji[::-1],
        emoji[:2] * 3,
        [1] + emoji[:1] + [0] + emoji[1:] + [2],
        [2, 2, 2],
        emoji[-1:] + emoji,
    ]
    for skip in (True, False):
        opts = [DetokOptions(skip_special_tokens=skip)] * len(streams)
        got, _ = stream(detok, streams, opts, rng, max_per_step=1)
        assert got == [tokenizer.decode(ids, skip_special_tokens=skip) for ids in streams]


def test_special_tokens_kept_are_decode_s_text(tokenizer, detok):
    """Special tokens kept: the text is decode()'s, no space set around them (SGLang's and
    vLLM's fast detokenizers; the request's spaces_between_special_tokens changes nothing)."""
    hi = tokenizer.encode("Hi there 😀", add_special_tokens=False)
    streams = [[1] + hi + [2], hi + [2, 1] + hi, [2, 1], hi[:-1] + [2] + hi[-1:]]
    rng = np.random.default_rng(4)
    got, _ = stream(detok, streams, [DetokOptions(skip_special_tokens=False)] * len(streams), rng)
    assert got[0] == "<|im_start|>Hi there 😀<|im_end|>"
    assert got == [tokenizer.decode(ids, skip_special_tokens=False) for ids in streams]
    got, _ = stream(detok, streams, [DetokOptions(skip_special_tokens=True)] * len(streams), rng)
    assert got == [tokenizer.decode(ids, skip_special_tokens=True) for ids in streams]


def test_out_of_vocabulary_ids_and_late_tokens_are_ignored(tokenizer, detok):
    hi = tokenizer.encode("Hello", add_special_tokens=False)
    detok.open(0, DetokOptions())
    out = detok.step(np.array([0, 0, 0]), np.array([-1, hi[0], len(tokenizer) + 5]), np.array([False, False, True]))
    assert out.req.tolist() == [0] and out.delta(0) == b"Hello" and out.finished.tolist() == [True]
    assert len(detok.step(np.array([0]), np.array(hi), np.array([False])).req) == 0, "request is finished"
    assert len(detok.step(np.array([CAPACITY - 1]), np.array(hi), np.array([False])).req) == 0, "never opened"


def stop_case(tokenizer, detok, text, stops):
    """Streams `text` (one token per step) with `stops`; -> (output, stop index)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    got, stop = stream(detok, [ids], [DetokOptions(stop=tuple(stops))], np.random.default_rng(5), max_per_step=1)
    return got[0], stop[0]


def test_stop_string_spanning_three_tokens(tokenizer, detok):
    text = "The answer is forty-two. Then more text follows"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    k = next(k for k in range(len(pieces) - 2) if min(map(len, pieces[k : k + 3])) >= 2)
    stop = pieces[k][1:] + pieces[k + 1] + pieces[k + 2][:-1]  # starts in one token, ends in the third
    start = len("".join(pieces[:k])) + 1
    assert text.find(stop) == start
    assert stop_case(tokenizer, detok, text, [stop]) == (text[:start], 0)


def test_stop_string_partial_then_diverging_is_released(tokenizer, detok):
    text = "one two three two four two five"
    got, stop = stop_case(tokenizer, detok, text, ["two six", "three two fox"])
    assert (got, stop) == (text, -1)


def test_multiple_stop_strings_first_to_end_wins(tokenizer, detok):
    text = "alpha beta gamma delta"
    assert stop_case(tokenizer, detok, text, ["delta", "gamma", "zzz"]) == ("alpha beta ", 1)
    assert stop_case(tokenizer, detok, text, ["beta gamma", "ta g"]) == ("alpha be", 1)


def test_stop_at_the_very_first_token(tokenizer, detok):
    assert stop_case(tokenizer, detok, "Hello world", ["Hello"]) == ("", 0)
    assert stop_case(tokenizer, detok, "Hello world", ["He"]) == ("", 0)


def test_stop_string_with_multibyte_characters(tokenizer, detok):
    text = "weather: ☀️ then 😀 and rain"
    assert stop_case(tokenizer, detok, text, ["😀"]) == ("weather: ☀️ then ", 0)
    assert stop_case(tokenizer, detok, text, ["☀️ th"]) == ("weather: ", 0)


def test_stop_string_trims_text_arriving_with_it(tokenizer, detok):
    """Several tokens in one step: text after the stop string in the same step is dropped."""
    text = "abc STOP def ghi"
    ids = tokenizer.encode(text, add_special_tokens=False)
    got, stop = stream(detok, [ids], [DetokOptions(stop=("STOP",))], np.random.default_rng(6), max_per_step=20)
    assert (got[0], stop[0]) == ("abc ", 0)
    # no_stop_trim: the match stays, what follows it still goes
    got, stop = stream(
        detok, [ids], [DetokOptions(stop=("STOP",), no_stop_trim=True)], np.random.default_rng(6), max_per_step=20
    )
    assert (got[0], stop[0]) == ("abc STOP", 0)


def first_stop(full: bytes, stops: list[bytes], guard: int = 0) -> tuple[bytes, int]:
    """The reference: `full` cut where the stop string that ends first (then the longest)
    starts, among matches that end past full[:guard]; (full, -1) when none does."""
    found = [
        (start + len(stop), start, i)
        for i, stop in enumerate(stops)
        if (start := full.find(stop, max(guard - len(stop) + 1, 0))) >= 0
    ]
    return (full[: min(found)[1]], min(found)[2]) if found else (full, -1)


@pytest.mark.parametrize("with_min_tokens", [False, True])
def test_many_requests_with_and_without_stop_strings(tokenizer, detok, with_min_tokens):
    """Stop strings cut at random places of random texts, mixed with requests without stops;
    with min_tokens, no stop string ends in the text of a request's first min_tokens tokens
    (vLLM's rule: a match may start there and end later), steps crossing it included."""
    rng = np.random.default_rng(8 + with_min_tokens)
    # whole characters a token with min_tokens: its text is then the guard's exactly
    words = (
        "the of and to in is x = 1 ; stop here { } ok\n"
        if with_min_tokens
        else "the of and to in is café 😀 世界 naïve x = 1 ; { } \n"
    ).split(" ")
    streams, opts, want = [], [], []
    for r in range(CAPACITY):
        ids = tokenizer.encode("".join(rng.choice(words, 30).tolist()), add_special_tokens=False)
        full = tokenizer.decode(ids)
        a = int(rng.integers(0, len(full) // 2))
        stops = [full[a : a + int(rng.integers(1, 5))], "stop", "never" + full[:3]][: r % 3 + with_min_tokens]
        min_tokens = int(rng.integers(0, len(ids))) if with_min_tokens else 0
        streams.append(ids)
        opts.append(DetokOptions(stop=tuple(stops), min_tokens=min_tokens))
        text, index = first_stop(
            full.encode(), [x.encode() for x in stops], len(tokenizer.decode(ids[:min_tokens]).encode())
        )
        want.append((text.decode(), index))
    got, stop = stream(detok, streams, opts, rng, max_per_step=4)
    assert list(zip(got, stop)) == want


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="abé😀 ", max_size=6), max_size=12),
    stops=st.lists(st.text(alphabet="abé😀 ", min_size=1, max_size=4), min_size=1, max_size=3),
    protected=st.integers(0, 12),
)
def test_stop_matcher_matches_reference(chunks, stops, protected):
    """Streaming with hold-back == cutting the whole text at the stop string that ends first;
    the first `protected` chunks (a request's first min_tokens tokens) end no match."""
    full = "".join(chunks).encode()
    want = first_stop(full, [x.encode() for x in stops], len("".join(chunks[:protected]).encode()))
    m = StopMatcher(tuple(stops))
    out, hit = b"", -1
    for k, chunk in enumerate(chunks + [""]):
        released, hit = m.feed(chunk.encode(), final=k == len(chunks), protected=k < protected)
        out += released
        if hit >= 0:
            break
    assert (out, hit) == want


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Llama 2 style tokenizer: Metaspace pieces, byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for w in ["▁", "a", "b", "c", "é", "世", "▁a", "▁b", "ab", "▁ab", "▁é"]:
        vocab[w] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "é")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_tokenizer_uses_window_decode(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    det = BatchDetokenizer(tok, 16)
    assert det.table is None and "ByteLevel" in det.fallback_reason
    texts = ["ab a 😀 é世 b", " ab  c", "é😀ab", "世"]
    streams = [tok.encode(t, add_special_tokens=False) for t in texts]
    rng = np.random.default_rng(7)
    streams += [rng.integers(0, len(tok), 30).tolist() for _ in range(8)]
    streams += [[1] + streams[0] + [2], streams[0][:4] + streams[0][6:]]
    for skip in (True, False):
        opts = [DetokOptions(skip_special_tokens=skip)] * len(streams)
        got, _ = stream(det, streams, opts, rng)
        assert got == [tok.decode(ids, skip_special_tokens=skip) for ids in streams]
