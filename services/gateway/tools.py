"""Tool calling for models whose chat template has no tool format of its own.

The tools are described to the model in a system message and calls are written as
Hermes-style blocks, one JSON object per call::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

``tool_choice="required"`` or a named function constrains the output to such blocks
(one, or several when ``parallel_tool_calls``), each's arguments to its function's
JSON schema; ``"auto"`` leaves the output free and parses whatever blocks it has.
:class:`ToolCallStream` turns streamed text into content and ``tool_calls`` deltas as
OpenAI streams them: a call's id, type and name first, then its arguments in pieces.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.engine.constraint import Constraint, canonical_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ToolMode = Literal["auto", "required", "named"]
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# the start of a constrained call, up to where its arguments begin
_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            body["description"] = self.description
        return {"type": "function", "function": body}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's ``tools`` and ``tool_choice`` ask for."""

    functions: tuple[Function, ...]
    mode: ToolMode
    named: str | None = None
    parallel: bool = True

    def system_prompt(self) -> str:
        tools = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in self.functions)
        return (
            "You can call functions to answer. The functions you may call are:\n"
            f"<tools>\n{tools}\n</tools>\n"
            "To call a function, reply with one JSON object per call inside tags:\n"
            '<tool_call>{"name": "<function name>", "arguments": {<the arguments>}}'
            "</tool_call>"
        )

    def constraint(self) -> Constraint | None:
        """The output's grammar: tool-call blocks only (``required``, named); None
        for ``auto``."""
        if self.mode == "auto":
            return None
        chosen = [f for f in self.functions if self.mode == "required" or f.name == self.named]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in chosen
        ]
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        # compact JSON, as the structured outputs' (a small model may pad with newlines)
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        more = ' ("\\n" call)*' if self.parallel else ""
        return Constraint.grammar(
            f"start: call{more}\n"
            f'call: "{OPEN}" body "{CLOSE}"\n'
            f"body: %json {canonical_json(schema)}\n"
        )


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The chat as the template gets it: the tools in a system message, the assistant's
    past calls as blocks and tool results as user turns (the template knows neither)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(
                OPEN
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": _arguments(c)},
                    ensure_ascii=False,
                )
                + CLOSE
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": content + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if plan is None:
        return out
    prompt = plan.system_prompt()
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(call: dict[str, Any]) -> Any:
    raw = call["function"].get("arguments") or "{}"
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Delta:
    """What one piece of text adds: content, and ``tool_calls`` delta entries."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


def _whole_call(block: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a complete call block's body, or None."""
    try:
        body = json.loads(block)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = body.get("arguments", body.get("parameters", {}))
    return body["name"], json.dumps(args, ensure_ascii=False)


class ToolCallStream:
    """Text in, content and tool-call deltas out. ``incremental``: the output is
    constrained to well-formed calls, so a call's arguments stream as they come;
    otherwise (``auto``) a call is emitted once its block closed and parsed, and a
    block that does not parse stays content."""

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet given out: a possible tag's start, or a call's
        self._in_call = False
        self._args_from: int | None = None  # where the current call's arguments begin
        self._args_sent = 0

    def feed(self, text: str) -> Delta:
        self._pending += text
        out = Delta()
        while True:
            if not self._in_call:
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = _partial_tag(self._pending, OPEN)
                    out.content += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    return out
                out.content += self._pending[:at]
                self._pending = self._pending[at + len(OPEN) :]
                self._in_call, self._args_from, self._args_sent = True, None, 0
            end = self._pending.find(CLOSE)
            if end < 0:
                if self.incremental:
                    out.calls += self._stream_arguments(self._pending, closed=False)
                return out
            block, self._pending = self._pending[:end], self._pending[end + len(CLOSE) :]
            self._in_call = False
            if self.incremental and self._args_from is not None:
                out.calls += self._stream_arguments(block, closed=True)
                continue
            parsed = _whole_call(block)
            if parsed is None:  # not a call after all: the model's text
                out.content += OPEN + block + CLOSE
                continue
            call = ToolCall(new_call_id(), *parsed)
            self.calls.append(call)
            index = len(self.calls) - 1
            out.calls.append({"index": index, **call.message()})

    def _stream_arguments(self, block: str, *, closed: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._args_from is None:
            head = _HEAD.match(block)
            if head is None:
                return out
            self._args_from = head.end()
            name = json.loads(f'"{head.group(1)}"')
            self.calls.append(ToolCall(new_call_id(), name, ""))
            call = self.calls[-1]
            out.append(
                {"index": len(self.calls) - 1, "id": call.id, "type": "function",
                 "function": {"name": name, "arguments": ""}}
            )  # fmt: skip
        args = block[self._args_from :]
        if not closed:  # the end may be the start of the closing tag: wait for it
            args = args[: len(args) - _partial_tag(args, CLOSE)]
        # the block ends with the call object's own "}" (a "}" at the end of an open
        # block may be it): hold it, and the spaces before it, back
        ready = args.rstrip()
        if ready.endswith("}"):
            ready = ready[:-1]
        piece = ready[self._args_sent :]
        if piece:
            self._args_sent += len(piece)
            self.calls[-1].arguments += piece
            out.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        return out

    def finish(self) -> Delta:
        """The output ended: text held back is content (an unclosed block included)."""
        out = Delta()
        if self._in_call and not self.incremental:
            out.content = OPEN + self._pending
        elif not self._in_call:
            out.content = self._pending
        self._pending = ""
        return out


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_output(text: str, incremental: bool) -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content or None, tool calls)."""
    stream = ToolCallStream(incremental)
    delta = stream.feed(text)
    content = delta.content + stream.finish().content
    return (content.strip() or None) if stream.calls else content, stream.calls
