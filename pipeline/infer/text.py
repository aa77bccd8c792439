"""Generated tokens as text, one token at a time: the byte-level BPE decoded without splitting a multi-byte
character, the end-of-text token and stop strings ending the text, and only text that can no longer change handed
out for printing (what streaming needs).

GPT-2's BPE maps tokens to bytes, and one UTF-8 character can span several tokens (e.g. a CJK character as two or
three byte tokens), so decoding token by token would print replacement characters. Here each token's bytes go through
an incremental UTF-8 decoder, which holds an incomplete character back until its last byte arrives (and, at the
end, decodes leftovers with U+FFFD as ``tiktoken``'s ``decode`` does): the streamed text equals the decode of the
whole token list.

A stop string ends the text before its first occurrence (the stop string itself is cut). While the text ends with
a prefix of a stop string (e.g. one newline of a "\\n\\n" stop), that tail is held back from printing: it is printed
only once the next characters show it is not a stop string.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence


class TokenText:
    """The text of one generated row. ``feed(token)`` after each token; ``ended`` becomes ``"eot"`` or ``"stop"``
    when the row must end; ``take()`` returns the new printable text; ``text`` is the final text after
    ``finish()``."""

    def __init__(self, encoding, stop: Sequence[str] = (), eot_id: int | None = None):
        if any(s == "" for s in stop):
            raise ValueError("an empty stop string would end every generation at once; drop it")
        self.encoding, self.stop, self.eot_id = encoding, tuple(stop), eot_id
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # decoded so far (complete characters), cut at a stop string once found
        self._shown = 0  # characters of _text handed out by take()
        self._longest = max((len(s) for s in self.stop), default=0)
        self.ended: str | None = None
        self.tokens: list[int] = []  # every token fed, including the one that ended the row

    def feed(self, token: int) -> bool:
        """Take the next generated token; True when the row has ended (EOT, or a stop string completed)."""
        if self.ended:
            raise RuntimeError("this row has ended; feed no more tokens")
        self.tokens.append(int(token))
        if token == self.eot_id:
            self.ended = "eot"
            return True
        # a pipeline Tokenizer's token_bytes, or a tiktoken Encoding's own
        token_bytes = getattr(self.encoding, "token_bytes", None) or self.encoding.decode_single_token_bytes
        self._extend(self._decoder.decode(token_bytes(int(token))))
        return self.ended is not None

    def finish(self) -> str:
        """End the row (``ended`` becomes ``"length"`` if nothing else ended it); the rest of the text to print."""
        if self.ended != "stop":  # EOT or length: an incomplete last character decodes as U+FFFD, as tiktoken's
            self._extend(self._decoder.decode(b"", final=True))
        self.ended = self.ended or "length"
        return self.take(final=True)

    def _extend(self, piece: str) -> None:
        if not piece or self.ended == "stop":
            return
        before = len(self._text)
        self._text += piece
        lo = max(0, before - self._longest + 1)  # an occurrence must end in the new piece (none before it)
        hits = [i for i in (self._text.find(s, lo) for s in self.stop) if i >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.ended = "stop"

    def take(self, final: bool = False) -> str:
        """New text that no later token can change or cut."""
        end = len(self._text)
        if not final and self.ended is None:
            end -= self._held_back()
        out = self._text[self._shown:end]
        self._shown = max(self._shown, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is the beginning of a stop string."""
        for n in range(min(self._longest - 1, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    @property
    def text(self) -> str:
        return self._text
