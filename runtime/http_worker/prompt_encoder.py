"""Prompt text to token ids, as the tokenizer's own encode gives them, faster for ASCII text.

The Rust tokenizer spends most of a chat prompt's encode in its pre-tokenizer, a large share
of what a short request costs the whole server (docs/perf-notes.md). For GPT-2 style
byte-level BPE (SmolLM, GPT-2: a ByteLevel pre-tokenizer with its regex, no normalizer) and
ASCII text, that regex is exactly an ASCII one (ASCII_SPLIT), and the BPE of each piece
("word") can come from a cache filled by the tokenizer's own model. prompt_split.c runs the
split and the lookups in one call (Python's `re` and a loop where there is no compiler: still
several times faster than the tokenizer, several times slower than the C call).
Everything else (non-ASCII text, any other tokenizer) goes to the tokenizer.

Exact by construction where it applies, and checked at start-up: the fast path is used only
if it gives the tokenizer's ids on probe texts (special tokens, contractions, digits, runs of
whitespace and punctuation, with and without add_special_tokens).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, MutableMapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from cbuild import BuildError, build_extension
from protocol.vocab import byte_level_char_map

# GPT-2's split (tokenizers' ByteLevel pre-tokenizer with use_regex) restricted to ASCII: there
# \p{L} is [A-Za-z], \p{N} is [0-9] and \s is [\t\n\v\f\r ] (not \x1c-\x1f, which Python's \s
# includes: the tokenizer splits them as punctuation).
_WS = r"\t\n\x0b\x0c\r "
ASCII_SPLIT = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+"
    rf"|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)
_SPLIT_SOURCE = Path(__file__).with_name("prompt_split.c")
PIECE_CACHE_SIZE = 1 << 16  # pieces (words with their leading space); cleared when full
# ... or when its pieces and ids take this many bytes (the pieces are the clients' text)
PIECE_CACHE_BYTES = 16 << 20
PIECE_ENTRY_BYTES = 32  # what an entry takes besides its piece's characters and its ids (u32 each)
MAX_CACHED_PIECE = 256  # characters: a longer piece (a run of one kind) is rare, and BPE'd each time
PROBES = (
    "<|im_start|>user\nI'm sure it's 42, they'll've  said: \"don't\"!!\t\n\n  x<|im_end|>\n",
    "  leading and trailing  \r\n",
    "a1b22c333 'S 'LL '' ''' ?!.,;  \x0b\x0c \x7f end",
    "+\x1c+ \x1d+\n\x1e\n \x1f ",
    "",
    " ",
    "\n\n",
)


# (text, start, end, pieces, ids) -> None, or the span (i, j) of the first piece not in `pieces`:
# appends the cached ids of text[start:end]'s pieces to `ids` up to that piece (prompt_split.c)
CachedEncode = Callable[[str, int, int, Any, list], "tuple[int, int] | None"]


def _encode_with_regex(
    text: str, start: int, end: int, pieces: dict[str, list[int]], ids: list[int]
) -> tuple[int, int] | None:
    for m in ASCII_SPLIT.finditer(text, start, end):
        piece_ids = pieces.get(m.group())
        if piece_ids is None:
            return m.span()
        ids += piece_ids
    return None


@lru_cache(maxsize=1)
def cached_encoder() -> tuple[CachedEncode, Callable[[], MutableMapping[str, list[int]]]]:
    """(encode, the piece cache it takes): prompt_split.c's split and lookups in its C
    PieceTable (several times faster than the regex and a Python loop, and faster than a
    dict of the pieces of real traffic), or the regex and a dict where it cannot be built."""
    try:
        module = build_extension("runtime.prompt_split", _SPLIT_SOURCE, subdir="runtime")
        return module.encode, module.PieceTable
    except (BuildError, ImportError, OSError) as e:
        warnings.warn(
            f"prompt encoder: the C split is unavailable ({e}); the regex splits", RuntimeWarning, stacklevel=2
        )
        return _encode_with_regex, dict


class PromptEncoder:
    """encode(text, add_special_tokens) -> ids, the same as tokenizer.encode's."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: thread-safe
        self._fast = False
        self._encode_cached, new_cache = cached_encoder()
        self._pieces = new_cache()  # piece -> its ids
        self._pieces_bytes = 0  # what the pieces kept take, about
        if self._backend is not None:
            try:
                self._fast = self._setup(self._backend) and self._probe()
            except Exception:  # a tokenizer layout this module does not know: the tokenizer encodes
                self._fast = False

    @property
    def fast(self) -> bool:
        """Whether ASCII text takes the fast path."""
        return self._fast

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast and text.isascii():
            return self._encode_ascii(text, add_special_tokens)
        return self._slow(text, add_special_tokens)

    def _slow(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._backend is not None:  # the batch call skips the character offsets encode() computes: less work
            return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _setup(self, backend: Any) -> bool:
        # The parts are read as objects: the tokenizer's JSON (to_str) would spell out its whole
        # vocabulary and merges (a second of a start for Gemma 3's 262k tokens) to be thrown away.
        model, pre = backend.model, backend.pre_tokenizer
        if (
            backend.normalizer is not None
            or type(model).__name__ != "BPE"
            or model.dropout
            or model.byte_fallback
            or model.continuing_subword_prefix
            or model.end_of_word_suffix
            or type(pre).__name__ != "ByteLevel"
            or not pre.use_regex
            or pre.add_prefix_space
        ):
            return False
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        if any(a.lstrip or a.rstrip or a.single_word for a in added.values()):
            return False
        # added tokens are cut out of the text first, longest match first, as the tokenizer does
        self._added = {a.content: i for i, a in added.items()}
        contents = sorted(self._added, key=len, reverse=True)
        self._added_split = re.compile("|".join(map(re.escape, contents))) if contents else None
        chars = byte_level_char_map()  # character -> byte; ASCII bytes are their own characters' keys
        self._to_byte_level = str.maketrans({b: c for c, b in chars.items() if b < 128})
        self._bpe = backend.model
        # what add_special_tokens wraps around a text's ids (a BOS, an EOS ...)
        bare = self._slow("a", False)
        full = self._slow("a", True)
        at = full.index(bare[0]) if bare and bare[0] in full else -1
        if at < 0 or full[at : at + len(bare)] != bare:
            return False
        self._prefix, self._suffix = full[:at], full[at + len(bare) :]
        return True

    def _probe(self) -> bool:
        return all(
            self._encode_ascii(text, special) == self._slow(text, special)
            for text in PROBES
            for special in (False, True)
        )

    def _encode_ascii(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._prefix[:] if add_special_tokens else []
        pos = 0
        if self._added_split is not None:
            for m in self._added_split.finditer(text):
                self._encode_span(text, pos, m.start(), ids)
                ids.append(self._added[m.group()])
                pos = m.end()
        self._encode_span(text, pos, len(text), ids)
        return ids + self._suffix if add_special_tokens else ids

    def _encode_span(self, text: str, start: int, end: int, ids: list[int]) -> None:
        cache = self._pieces
        while (miss := self._encode_cached(text, start, end, cache, ids)) is not None:
            start, end_of_piece = miss
            if len(cache) >= PIECE_CACHE_SIZE or self._pieces_bytes >= PIECE_CACHE_BYTES:
                cache.clear()
                self._pieces_bytes = 0
            piece = text[start:end_of_piece]
            piece_ids = [t.id for t in self._bpe.tokenize(piece.translate(self._to_byte_level))]
            if len(piece) <= MAX_CACHED_PIECE:
                cache[piece] = piece_ids
                self._pieces_bytes += len(piece) + 4 * len(piece_ids) + PIECE_ENTRY_BYTES
            ids += piece_ids
            start = end_of_piece
