"""The shortest text that completes a JSON object cut anywhere.

``response_format: json_object`` promises a JSON object, and a small model can fill
any ``max_tokens`` with one that never ends (an array repeating its items). When the
tokens a request has left are just enough to close what is open, the engine writes
the closing instead of sampling (:meth:`shared.engine.grammar.Matcher.within_budget`);
this module knows what the closing is: it scans the output byte by byte as tokens
arrive and keeps the stack of open containers and where the scan is inside a value.

What an unfinished piece becomes: a string is closed (a pending escape completed);
a number gets a digit if it ends in ``-``, ``.``, ``e`` or ``+``; a literal is
spelled out; a key without a value gets ``:null``; a value expected after ``:`` or
``,`` is ``null`` (after a ``,`` in an object, ``"":null``); then every open
container closes.
"""

from __future__ import annotations

from enum import Enum

LITERALS = (b"true", b"false", b"null")


class Expect(Enum):
    VALUE = "value"  # after ':' or a ',' in an array
    FIRST_VALUE = "first value"  # after '[': ']' may follow
    FIRST_KEY = "first key"  # after '{': '}' may follow
    KEY = "key"  # after a ',' in an object
    COLON = "colon"  # after a key
    NEXT = "next"  # after a value: ',' or the container's end
    START = "start"  # nothing yet: the object's '{'
    END = "end"  # the object is closed


class JsonCloser:
    """Follows one output; :meth:`closing` at any point. Broken input (not a JSON
    object prefix) makes :meth:`closing` None; the grammar keeps that from happening."""

    def __init__(self) -> None:
        self._stack: list[int] = []  # ord('{') or ord('[')
        self._expect = Expect.START
        self._string: bytes | None = None  # inside a string: b"key" or b"value"
        self._escape = 0  # inside a string: 1 after '\', 2-5 inside '\uXXXX'
        self._number = b""  # inside a number: its text so far
        self._literal = b""  # inside true/false/null: its text so far
        self._broken = False

    def copy(self) -> JsonCloser:
        twin = JsonCloser.__new__(JsonCloser)
        twin.__dict__ = {**self.__dict__, "_stack": list(self._stack)}
        return twin

    def feed(self, data: bytes) -> None:
        for byte in data:
            if not self._broken:
                self._byte(byte)

    def _byte(self, c: int) -> None:
        if self._string is not None:
            self._in_string(c)
        elif self._number:
            if chr(c) in "0123456789.eE+-":
                self._number += bytes([c])
                return
            self._number = b""
            self._expect = Expect.NEXT
            self._byte(c)
        elif self._literal:
            self._literal += bytes([c])
            if self._literal in LITERALS:
                self._literal = b""
                self._expect = Expect.NEXT
            elif not any(lit.startswith(self._literal) for lit in LITERALS):
                self._broken = True
        elif chr(c) in " \t\r\n":
            return
        else:
            self._structural(chr(c))

    def _in_string(self, c: int) -> None:
        if self._escape == 1:
            self._escape = 2 if c == ord("u") else 0
        elif self._escape >= 2:
            self._escape = 0 if self._escape == 5 else self._escape + 1
        elif c == ord("\\"):
            self._escape = 1
        elif c == ord('"'):
            self._expect = Expect.COLON if self._string == b"key" else Expect.NEXT
            self._string = None

    def _structural(self, ch: str) -> None:
        expect = self._expect
        if expect is Expect.START:
            self._open(ch, must="{")
        elif expect in (Expect.FIRST_KEY, Expect.KEY):
            if ch == '"':
                self._string = b"key"
            elif ch == "}" and expect is Expect.FIRST_KEY:
                self._close()
            else:
                self._broken = True
        elif expect is Expect.COLON:
            self._expect = Expect.VALUE if ch == ":" else self._expect
            self._broken = ch != ":"
        elif expect in (Expect.VALUE, Expect.FIRST_VALUE):
            if ch == "]" and expect is Expect.FIRST_VALUE:
                self._close()
            else:
                self._value(ch)
        elif expect is Expect.NEXT:
            if ch == ",":
                self._expect = Expect.KEY if self._stack[-1] == ord("{") else Expect.VALUE
            elif ch in "}]" and self._stack[-1] == ord("{" if ch == "}" else "["):
                self._close()
            else:
                self._broken = True
        else:  # after the end
            self._broken = True

    def _value(self, ch: str) -> None:
        if ch in "{[":
            self._open(ch)
        elif ch == '"':
            self._string = b"value"
        elif ch in "-0123456789":
            self._number = ch.encode()
        elif ch in "tfn":
            self._literal = ch.encode()
        else:
            self._broken = True

    def _open(self, ch: str, must: str | None = None) -> None:
        if ch not in "{[" or (must is not None and ch != must):
            self._broken = True
            return
        self._stack.append(ord(ch))
        self._expect = Expect.FIRST_KEY if ch == "{" else Expect.FIRST_VALUE

    def _close(self) -> None:
        self._stack.pop()
        self._expect = Expect.NEXT if self._stack else Expect.END

    def closing(self) -> str | None:
        """The shortest text after which the output is one whole JSON object; "" when it
        already is; None when the output is not the start of one."""
        if self._broken:
            return None
        if self._expect is Expect.END:
            return ""
        if self._expect is Expect.START:
            return "{}"
        out = ""
        expect = self._expect
        if self._string is not None:
            if self._escape == 1:
                out += "n"
            elif self._escape >= 2:
                out += "0" * (6 - self._escape)
            out += '"'
            expect = Expect.COLON if self._string == b"key" else Expect.NEXT
        elif self._number:
            out += "0" if not self._number[-1:].isdigit() else ""
            expect = Expect.NEXT
        elif self._literal:
            out += next(lit for lit in LITERALS if lit.startswith(self._literal))[
                len(self._literal) :
            ].decode()
            expect = Expect.NEXT
        out += {
            Expect.KEY: '"":null',
            Expect.COLON: ":null",
            Expect.VALUE: "null",
        }.get(expect, "")
        return out + "".join("}" if c == ord("{") else "]" for c in reversed(self._stack))
