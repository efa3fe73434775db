"""What the detokenizer needs to know about a tokenizer's vocabulary: which ids are added
(special) tokens, and, for byte-level BPE tokenizers, the fixed UTF-8 bytes of every token
id as one numpy blob, so a batch's bytes are gathered with numpy instead of calling decode.

The byte table is exact only when decode(ids) == lossy_utf8(concat(bytes of each id)):
true for the GPT-2 style ByteLevel decoder (Llama 3, Qwen2, SmolLM, GPT-2), which maps
each character of a token back to one byte and falls back to the token's own UTF-8 when
a character is outside that map, then decodes the joined bytes with replacement. This is
checked at start-up against the tokenizer itself; anything else uses the window decode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

REPLACEMENT = "\ufffd"


class NotByteExact(Exception):
    """The tokenizer's decode is not a plain byte concatenation; the message says why."""


@dataclass(frozen=True)
class AddedTokens:
    """Added-vocabulary tokens (`<|im_end|>` ...): decode skips the special ones when asked."""

    special: frozenset[int]
    text: dict[int, str]  # id -> what decode([id]) returns

    @classmethod
    def of(cls, tokenizer) -> AddedTokens:
        decoder = tokenizer.added_tokens_decoder  # id -> AddedToken
        return cls(
            special=frozenset(i for i, tok in decoder.items() if tok.special),
            text={i: tokenizer.decode([i]) for i in decoder},
        )


@dataclass(frozen=True)
class TokenTable:
    """Bytes of every token id; index `size` is an empty entry for ids outside the vocabulary."""

    size: int  # vocabulary size; valid ids are [0, size)
    blob: np.ndarray  # uint8 [total]: every token's bytes, back to back
    offset: np.ndarray  # int64 [size + 1]: where each id's bytes start in blob
    length: np.ndarray  # int64 [size + 1]
    plain: np.ndarray  # bool [size + 1]: not an added token and valid UTF-8 on its own
    byte_bits: np.ndarray  # uint64 [size + 1, 4]: bitmap of the byte values in each token
    pieces: tuple[bytes, ...]  # [size + 1]: the same bytes as Python objects, for the per-request path


def byte_level_char_map() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def build_token_table(tokenizer, added: AddedTokens, probes: int = 64, seed: int = 0) -> TokenTable:
    """Raises NotByteExact unless the tokenizer's decode is exactly lossy UTF-8 of the joined
    bytes: its decoder must be ByteLevel, every single id must decode to its table bytes, and
    `probes` random id sequences (special tokens included) must decode to their joined bytes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise NotByteExact(f"{type(tokenizer).__name__} has no Rust tokenizers backend")
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    if decoder.get("type") != "ByteLevel":
        raise NotByteExact(f"decoder is {decoder.get('type')}, not ByteLevel")

    char_map = byte_level_char_map()
    to_latin1 = str.maketrans({c: chr(b) for c, b in char_map.items()})
    size = len(tokenizer)
    pieces: list[bytes] = []
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None:
            pieces.append(b"")
        elif char_map.keys() >= set(token):
            pieces.append(token.translate(to_latin1).encode("latin-1"))
        else:
            pieces.append(token.encode())
    pieces.append(b"")

    singles = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    for i, text in enumerate(singles):
        if text != pieces[i].decode("utf-8", "replace"):
            raise NotByteExact(f"token {i} decodes to {text!r}, not its bytes {pieces[i]!r}")
    rng = np.random.default_rng(seed)
    special = sorted(added.text)
    for _ in range(probes):
        ids = rng.integers(0, size, 48).tolist() + special[: rng.integers(0, len(special) + 1)]
        rng.shuffle(ids)
        joined = b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
        if tokenizer.decode(ids, skip_special_tokens=False) != joined:
            raise NotByteExact(f"decode({ids}) is not the concatenation of its tokens' bytes")

    length = np.fromiter((len(p) for p in pieces), np.int64, size + 1)
    offset = np.zeros(size + 1, np.int64)
    np.cumsum(length[:-1], out=offset[1:])
    plain = np.fromiter((_valid_utf8(p) for p in pieces), bool, size + 1)
    plain[list(added.text)] = False
    blob = np.frombuffer(b"".join(pieces), np.uint8)
    has_byte = np.zeros((size + 1, 256), bool)
    has_byte[np.repeat(np.arange(size + 1), length), blob] = True
    byte_bits = np.packbits(has_byte, axis=1, bitorder="little").view(np.uint64)
    return TokenTable(
        size=size, blob=blob, offset=offset, length=length, plain=plain, byte_bits=byte_bits, pieces=tuple(pieces)
    )


def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """The `<0xXX>` tokens of a ByteFallback decoder (SentencePiece style), else empty.
    decode() turns a run of them into text only when the whole run is valid UTF-8 (otherwise
    one U+FFFD per byte), so a run's text is not known until a token outside the run comes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None or b'"ByteFallback"' not in backend.decoder.__getstate__():
        return frozenset()
    vocab = backend.get_vocab(with_added_tokens=False)
    return frozenset(vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab)


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
