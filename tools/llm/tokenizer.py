"""The GGUF's own tokenizer: GPT-2 style byte-level BPE from `tokenizer.ggml.*`.

Encoding is: split out control tokens (<|im_start|>, <|im_end|>, ...) so that they map to their
ids, pre-tokenize the rest with the regex that `tokenizer.ggml.pre` names, map each piece's
UTF-8 bytes to GPT-2's printable "byte unicode" characters, and merge by the ranks in
`tokenizer.ggml.merges`. Decoding maps back to bytes, so decode(encode(text)) == text for any
text the vocabulary can hold (`Tokenizer.unencodable_bytes`). The `regex` package supplies the
\\p{L} / \\p{N} classes Python's `re` lacks. When this was written, the ids matched llama.cpp's
(on this GGUF) and Hugging Face tokenizers' (built from the same vocabulary and merges) on the
repository's own text and on random Unicode.
"""
from __future__ import annotations

from functools import lru_cache

import regex

from .template import ChatTemplate

# GPT-2's pre-tokenizer, as Hugging Face's ByteLevel(use_regex=True) writes it (llama.cpp lists
# it without the final |\s+, and its hand-written matcher splits whitespace runs the same way).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# tokenizer.ggml.pre -> whether every digit is split off first, and the regex for the rest.
# "smollm" is SmolLM/SmolLM2's tokenizer.json: Digits(individual_digits=True) then ByteLevel,
# which llama.cpp implements as the regexes "\p{N}" then the GPT-2 one (llama-vocab.cpp groups
# it with starcoder, refact, codeshell). Unknown names raise: a wrong regex would tokenize
# fluently and silently differ from the tokenizer the model was trained with.
PRE_TOKENIZERS = {
    "gpt2": (False, GPT2_PATTERN),
    "smollm": (True, GPT2_PATTERN),
    "starcoder": (True, GPT2_PATTERN),
    "refact": (True, GPT2_PATTERN),
}

CONTROL = 3       # llama.cpp's token types: 1 normal, 3 control, 4 user-defined
USER_DEFINED = 4


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to
    themselves and the rest to U+0100 onwards (so a space is 'Ġ' and a newline 'Ċ')."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class Tokenizer:
    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int] | None = None,
                 *, pre: str = "gpt2", bos_id: int | None = None, eos_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None):
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"pre: tokenizer.ggml.pre {pre!r} is not implemented "
                             f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
        if token_types is not None and len(token_types) != len(tokens):
            raise ValueError(f"token_types: {len(token_types)} types for {len(tokens)} tokens")
        self.tokens = list(tokens)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {}
        for rank, merge in enumerate(merges):
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ValueError(f"merges: entry {rank} {merge!r} is not 'left right'")
            self.ranks[(left, right)] = rank
        types = token_types or [1] * len(self.tokens)
        self.special_ids = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)}
        specials = sorted((self.tokens[i] for i in self.special_ids), key=len, reverse=True)
        # Longest first, so that no special token is cut short by another that prefixes it.
        self._special_split = (regex.compile("(" + "|".join(map(regex.escape, specials)) + ")")
                               if specials else None)
        self.split_digits, pattern = PRE_TOKENIZERS[pre]
        self._pattern = regex.compile(pattern)
        self.pre = pre
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.template = ChatTemplate(chat_template) if chat_template else None
        self._byte_chars = bytes_to_unicode()
        self._char_bytes = {c: b for b, c in self._byte_chars.items()}
        # Bytes with no token of their own. SmolLM2's vocabulary lacks six ASCII control bytes
        # (0x04 0x06 0x13 0x14 0x16 0x1d) and the UTF-8 lead bytes 0xc0 0xc1 0xf1 0xf2 0xf5-0xff
        # (the last never occur in UTF-8; 0xf1/0xf2 only start code points U+40000-U+BFFFF,
        # unassigned planes). Hugging Face and llama.cpp drop such bytes from the text, and so
        # do we: decode(encode(text)) == text holds for text without them.
        self.unencodable_bytes = frozenset(b for b, c in self._byte_chars.items()
                                           if c not in self.vocab)
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        from .weights import field

        model = field(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"reader: tokenizer.ggml.model is {model!r}; only byte-level BPE "
                             "('gpt2') is implemented")
        return cls(field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.merges"),
                   field(reader, "tokenizer.ggml.token_type"),
                   pre=field(reader, "tokenizer.ggml.pre", "gpt2"),
                   bos_id=field(reader, "tokenizer.ggml.bos_token_id"),
                   eos_id=field(reader, "tokenizer.ggml.eos_token_id"),
                   add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
                   chat_template=field(reader, "tokenizer.chat_template"))

    def __len__(self) -> int:
        return len(self.tokens)

    def token_id(self, token: str) -> int:
        """The id of one vocabulary entry, written as in the vocabulary ('<|im_end|>', 'Ġthe')."""
        if token not in self.vocab:
            raise KeyError(f"token: {token!r} is not in the vocabulary")
        return self.vocab[token]

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. With `special`, control-token strings in the text become their
        ids (what a chat prompt needs); without, they are spelled out as ordinary text."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        ids = [self.bos_id] if (self.add_bos if add_bos is None else add_bos) else []
        parts = (self._special_split.split(text) if special and self._special_split else [text])
        for k, part in enumerate(parts):
            if k % 2:  # split() with a capture group puts the matches at odd indices
                ids.append(self.vocab[part])
            elif part:
                for piece in self._pretokenize(part):
                    ids.extend(self._bpe(piece))
        return ids

    def decode(self, ids, *, skip_special: bool = False) -> str:
        """The text of `ids`. Bytes of an incomplete UTF-8 sequence (a token boundary inside a
        character) decode as U+FFFD, so streaming callers should decode whole prefixes."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"ids: {i} is outside the vocabulary of {len(self.tokens)}")
            if i in self.special_ids:
                if not skip_special:
                    out += self.tokens[i].encode("utf-8")
                continue
            out += bytes(self._char_bytes[c] for c in self.tokens[i])
        return out.decode("utf-8", errors="replace")

    def render_chat(self, messages, *, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise RuntimeError("this GGUF carries no tokenizer.chat_template")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
        """The prompt's ids: the rendered template with its control tokens as ids."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt),
                           special=True)

    def _pretokenize(self, text: str) -> list[str]:
        if not self.split_digits:
            return self._pattern.findall(text)
        pieces = []
        # Digits first, each on its own; the GPT-2 regex then runs on the text between them, so
        # " 42" is " ", "4", "2" and never " 4" (Hugging Face and llama.cpp agree on this).
        for k, chunk in enumerate(regex.split(r"(\p{N})", text)):
            if k % 2:
                pieces.append(chunk)
            elif chunk:
                pieces.extend(self._pattern.findall(chunk))
        return pieces

    def _bpe(self, piece: str) -> tuple[int, ...]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        # A byte without a token is dropped before merging, so its neighbours may merge across
        # it: Hugging Face's BPE (the tokenizer SmolLM2 was trained with) does this; llama.cpp
        # drops it after merging, which differs only for text holding such bytes.
        parts = [self._byte_chars[b] for b in piece.encode("utf-8")
                 if b not in self.unencodable_bytes]
        while len(parts) > 1:
            # The adjacent pair with the lowest merge rank merges first, everywhere it occurs.
            best = min(range(len(parts) - 1),
                       key=lambda j: self.ranks.get((parts[j], parts[j + 1]), 1 << 62))
            pair = (parts[best], parts[best + 1])
            if pair not in self.ranks:
                break
            merged, j = [], 0
            while j < len(parts):
                if j < len(parts) - 1 and (parts[j], parts[j + 1]) == pair:
                    merged.append(parts[j] + parts[j + 1])
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        ids = tuple(self.vocab[p] for p in parts)
        if len(self._cache) < 1 << 16:
            self._cache[piece] = ids
        return ids

