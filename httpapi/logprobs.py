"""Log-probabilities of generated tokens and their three JSON formats: OpenAI chat
({"content": [{"token", "logprob", "bytes", "top_logprobs"}]}), OpenAI completions
({"tokens", "token_logprobs", "top_logprobs", "text_offset"}) and SGLang's
([logprob, token_id, text] triples)."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.vocab import AddedTokens, NotByteExact, build_token_table

LOGPROB_FLOOR = -9999.0  # -inf has no JSON form; OpenAI and vLLM report this instead


@dataclass(frozen=True)
class TokenLogprobs:
    """Consecutive generated tokens of one choice (one streamed delta, or the whole choice)."""

    token_ids: np.ndarray  # [T] int
    logprobs: np.ndarray  # [T] float
    top_ids: np.ndarray  # [T, K] int, best first; K is the top_logprobs asked for (may be 0)
    top_logprobs: np.ndarray  # [T, K] float
    # the alternatives are the request's logprob_token_ids (vLLM's), to which each position's own
    # token is added where it is not among them
    pinned: bool = False

    @classmethod
    def of(
        cls, token_ids: Any, logprobs: Any, top_ids: Any = None, top_logprobs: Any = None, pinned: bool = False
    ) -> TokenLogprobs:
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        shape = (len(token_ids), 0)
        top_ids = np.zeros(shape, np.int64) if top_ids is None else np.asarray(top_ids, dtype=np.int64)
        top_logprobs = np.zeros(shape) if top_logprobs is None else np.asarray(top_logprobs, dtype=np.float64)
        logprobs = np.asarray(logprobs, dtype=np.float64).reshape(-1)
        if (
            logprobs.shape != token_ids.shape
            or top_ids.shape != top_logprobs.shape
            or top_ids.shape[0] != len(token_ids)
        ):
            raise ValueError(
                f"TokenLogprobs: shapes disagree: ids {token_ids.shape}, logprobs {logprobs.shape}, "
                f"top ids {top_ids.shape}, top logprobs {top_logprobs.shape}"
            )
        return cls(token_ids, logprobs, top_ids, top_logprobs, pinned)

    @classmethod
    def concat(cls, parts: Sequence[TokenLogprobs]) -> TokenLogprobs:
        """One choice's logprobs from its streamed deltas."""
        ids, lps, top_ids, top_lps = (
            np.concatenate([getattr(p, name) for p in parts])
            for name in ("token_ids", "logprobs", "top_ids", "top_logprobs")
        )
        return cls(ids, lps, top_ids, top_lps, parts[0].pinned)

    def __len__(self) -> int:
        return len(self.token_ids)

    def lists(self) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
        """Python lists, with -inf raised to LOGPROB_FLOOR (pinned: each position's own token
        among its alternatives)."""
        ids, lps = self.token_ids.tolist(), np.maximum(self.logprobs, LOGPROB_FLOOR).tolist()
        top_ids, top_lps = self.top_ids.tolist(), np.maximum(self.top_logprobs, LOGPROB_FLOOR).tolist()
        if self.pinned:
            for t, x, alt_ids, alt_lps in zip(ids, lps, top_ids, top_lps):
                if t not in alt_ids:
                    alt_ids.append(t)
                    alt_lps.append(x)
        return ids, lps, top_ids, top_lps


class LogprobVocab:
    """Each token id's own bytes, display text and character count, for logprobs. A token
    can hold part of a UTF-8 character: its text then shows the bytes escaped ("\\xe2"), as
    OpenAI does, and `bytes` carries them exactly. Made from a tokenizer, the tables are built
    when first used (the first request that asks for logprobs: Gemma 3's 262k tokens take
    about half a CPU second), not at every start."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._pieces: Callable[[], list[bytes]] = functools.partial(list, token_bytes)

    @functools.cached_property
    def bytes(self) -> list[bytes]:
        return self._pieces()

    @functools.cached_property
    def text(self) -> list[str]:
        return [b.decode("utf-8", "backslashreplace") for b in self.bytes]

    @functools.cached_property
    def chars(self) -> list[int]:
        """Characters that start in each token: its bytes that are not UTF-8 continuation bytes."""
        return [sum((c & 0xC0) != 0x80 for c in b) for b in self.bytes]

    @functools.cached_property
    def as_token_ids(self) -> LogprobVocab:
        """vLLM's return_tokens_as_token_ids: each token shown as "token_id:<id>", which names it
        even where its text does not (a part of a UTF-8 character, a token two ids share); its
        bytes and character count stay its own (built here, so that the copy shares them)."""
        self.chars  # noqa: B018
        shown = copy.copy(self)
        shown.text = [f"token_id:{i}" for i in range(len(self.bytes))]
        return shown

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> LogprobVocab:
        """From a Hugging Face tokenizer: the detokenizer's exact byte vocab for byte-level
        BPE (GPT-2, Llama 3, Qwen, SmolLM), else SentencePiece pieces ("\u2581" for a space,
        <0xNN> byte fallback). Ids past the tokenizer (a padded embedding) get no bytes."""
        vocab = cls([])
        vocab._pieces = functools.partial(_tokenizer_bytes, tokenizer, vocab_size)
        return vocab


def _tokenizer_bytes(tokenizer: Any, vocab_size: int | None) -> list[bytes]:
    added = AddedTokens.of(tokenizer)
    try:
        pieces = list(build_token_table(tokenizer, added).pieces[:-1])
    except NotByteExact:
        pieces = _sentencepiece_bytes(tokenizer, added)
    size = len(pieces) if vocab_size is None else vocab_size
    return pieces[:size] + [b""] * (size - len(pieces))


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(tokenizer: Any, added: AddedTokens) -> list[bytes]:
    pieces = []
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token_id in added.text:
            pieces.append(added.text[token_id].encode())
        elif piece is None:
            pieces.append(b"")
        elif match := _BYTE_PIECE.fullmatch(piece):
            pieces.append(bytes([int(match.group(1), 16)]))
        else:
            pieces.append(piece.replace("\u2581", " ").encode())
    return pieces


def chat_logprobs(lp: TokenLogprobs, vocab: LogprobVocab) -> dict:
    """OpenAI chat's choice.logprobs (top_logprobs [] when none were asked for)."""
    ids, lps, top_ids, top_lps = lp.lists()
    text, raw = vocab.text, vocab.bytes
    content = [
        {
            "token": text[t],
            "logprob": x,
            "bytes": list(raw[t]),
            "top_logprobs": [{"token": text[a], "logprob": y, "bytes": list(raw[a])} for a, y in zip(alt_ids, alt_lps)],
        }
        for t, x, alt_ids, alt_lps in zip(ids, lps, top_ids, top_lps)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(lp: TokenLogprobs, vocab: LogprobVocab, text_offset: int) -> tuple[dict, int]:
    """OpenAI completions' choice.logprobs, and where the next token's text starts: each
    token's offset is `text_offset` plus the characters of the tokens before it (by the
    tokens' own texts, whatever text the stream has released so far). A position's
    top_logprobs are its own token and then its alternatives (own_token_first)."""
    ids, lps, top_ids, top_lps = lp.lists()
    text, chars = vocab.text, vocab.chars
    offsets = []
    for t in ids:
        offsets.append(text_offset)
        text_offset += chars[t]
    top = [own_token_first(text, t, x, alt_ids, alt_lps) for t, x, alt_ids, alt_lps in zip(ids, lps, top_ids, top_lps)]
    body = {"tokens": [text[t] for t in ids], "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}
    return body, text_offset


def own_token_first(text: list[str], token: int, logprob: float, alt_ids: list[int], alt_lps: list[float]) -> dict:
    """A completions position's top_logprobs: its own token first, then its alternatives best
    first (its own once): OpenAI returns the chosen token's logprob always, so up to logprobs + 1
    entries, and vLLM puts it first, where a client reading the first key finds it."""
    top = {text[token]: logprob}
    for a, y in zip(alt_ids, alt_lps):
        top.setdefault(text[a], y)
    return top


def sglang_logprobs(lp: TokenLogprobs, vocab: LogprobVocab, with_text: bool) -> tuple[list, list]:
    """SGLang's meta_info output_token_logprobs and output_top_logprobs: [logprob, id, text or None]."""
    ids, lps, top_ids, top_lps = lp.lists()
    text = vocab.text

    def name(t: int) -> str | None:
        return text[t] if with_text else None

    tokens = [[x, t, name(t)] for t, x in zip(ids, lps)]
    top = [[[y, a, name(a)] for a, y in zip(alt_ids, alt_lps)] for alt_ids, alt_lps in zip(top_ids, top_lps)]
    return tokens, top


@dataclass(frozen=True)
class PromptLogprobs:
    """A choice's prompt logprobs: its prompt's positions [first, first + T), each with the prompt
    token there, that token's logprob (NaN at position 0, which no token predicts) and rank in the
    vocabulary, and the top-K alternatives."""

    first: int
    token_ids: np.ndarray  # [T] int
    logprobs: np.ndarray  # [T] float
    ranks: np.ndarray  # [T] int, 1 for the likeliest token
    top_ids: np.ndarray  # [T, K] int, likeliest first
    top_logprobs: np.ndarray  # [T, K] float

    @classmethod
    def concat(cls, parts: Sequence[PromptLogprobs]) -> PromptLogprobs:
        """One choice's prompt logprobs from its records (consecutive, in order)."""
        if len(parts) == 1:
            return parts[0]
        names = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")
        return cls(parts[0].first, *(np.concatenate([getattr(p, name) for p in parts]) for name in names))

    def __len__(self) -> int:
        return len(self.token_ids)

    def positions(self) -> range:
        return range(self.first, self.first + len(self))


def need_vocab(vocab: LogprobVocab | None) -> LogprobVocab:
    """The vocabulary of a response with logprobs: its route passes one whenever they were asked."""
    if vocab is None:
        raise ValueError("logprobs need the vocabulary")
    return vocab


def _floor(values: np.ndarray) -> list[Any]:
    """`values` floored, as Python floats in (nested) lists of `values`' shape."""
    return np.maximum(values, LOGPROB_FLOOR).tolist()


def vllm_prompt_logprobs(plp: PromptLogprobs, vocab: LogprobVocab) -> list[dict | None]:
    """vLLM's prompt_logprobs: one entry per prompt position (None before `first` and at position
    0), each {"<id>": {"logprob", "rank", "decoded_token"}} for the prompt token, then its top-k
    alternatives (ranked 1..k; the prompt token appears once)."""
    text = vocab.text
    out: list[dict | None] = [None] * plp.first
    for j, t, lp, rank, alt_ids, alt_lps in zip(
        plp.positions(),
        plp.token_ids.tolist(),
        _floor(plp.logprobs),
        plp.ranks.tolist(),
        plp.top_ids.tolist(),
        _floor(plp.top_logprobs),
    ):
        if j == 0:
            out.append(None)
            continue
        entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": text[t]}}
        for r, (a, y) in enumerate(zip(alt_ids, alt_lps), 1):
            entry.setdefault(str(a), {"logprob": y, "rank": r, "decoded_token": text[a]})
        out.append(entry)
    return out


def prompt_completion_logprobs(plp: PromptLogprobs, vocab: LogprobVocab) -> tuple[dict, int]:
    """OpenAI completions' logprobs of an echoed prompt (its first token's logprob and top_logprobs
    null), and where the completion's first token's text starts. A position's top_logprobs are
    its own token and then its alternatives (own_token_first)."""
    ids = plp.token_ids.tolist()
    text, chars = vocab.text, vocab.chars
    offsets, offset = [], 0
    for t in ids:
        offsets.append(offset)
        offset += chars[t]
    floored: list[float] = _floor(plp.logprobs)
    lps: list[float | None] = list(floored)
    top: list[dict | None] = [
        own_token_first(text, t, x, alt_ids, alt_lps)
        for t, x, alt_ids, alt_lps in zip(ids, floored, plp.top_ids.tolist(), _floor(plp.top_logprobs))
    ]
    if plp.first == 0 and ids:  # no token predicts the prompt's first
        lps[0] = None
        top[0] = None
    body = {"tokens": [text[t] for t in ids], "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}
    return body, offset


def echoed_logprobs(plp: PromptLogprobs, logprobs: TokenLogprobs | None, vocab: LogprobVocab) -> tuple[dict, int]:
    """Completions' logprobs of an echoed prompt and then (when any) of the completion's first
    tokens, their text offsets continuing; and where the next token's text starts."""
    body, offset = prompt_completion_logprobs(plp, vocab)
    if logprobs is None:
        return body, offset
    rest, offset = completion_logprobs(logprobs, vocab, offset)
    return join_completion_logprobs(body, rest), offset


def join_completion_logprobs(first: dict, second: dict) -> dict:
    """Two consecutive spans' completions logprobs as one (the echoed prompt's, then the completion's)."""
    top = None
    if first["top_logprobs"] is not None or second["top_logprobs"] is not None:
        top = (first["top_logprobs"] or [None] * len(first["tokens"])) + (
            second["top_logprobs"] or [{}] * len(second["tokens"])
        )
    return {
        "tokens": first["tokens"] + second["tokens"],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "top_logprobs": top,
        "text_offset": first["text_offset"] + second["text_offset"],
    }


def sglang_prompt_logprobs(plp: PromptLogprobs, vocab: LogprobVocab, with_text: bool) -> tuple[list, list]:
    """SGLang's meta_info input_token_logprobs and input_top_logprobs from logprob_start_len: as
    SGLang reports them, the first entry's logprob (and its top alternatives) is null."""
    text = vocab.text

    def name(t: int) -> str | None:
        return text[t] if with_text else None

    ids = plp.token_ids.tolist()
    tokens = [[x, t, name(t)] for t, x in zip(ids, _floor(plp.logprobs))]
    top: list = [
        [[y, a, name(a)] for a, y in zip(alt_ids, alt_lps)]
        for alt_ids, alt_lps in zip(plp.top_ids.tolist(), _floor(plp.top_logprobs))
    ]
    if tokens:
        tokens[0][0], top[0] = None, None
    return tokens, top
