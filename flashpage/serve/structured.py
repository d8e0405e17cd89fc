"""Structured outputs and tool calls in the OpenAI server: ``response_format``, ``structured_outputs``, ``tools``.

A request's constraint becomes ``SamplingParams.structured_outputs`` (see
:mod:`flashpage.engine.structured`); the app compiles it on a worker thread before queueing
(``LLM.prepare_structured_outputs``), so a bad schema is a 400 naming the field (:func:`constraint_param`)
and neither the event loop nor the engine thread parses a schema. Tool calls follow vLLM:

- ``tools`` are given to the chat template (``apply_chat_template(..., tools=...)``);
- ``tool_choice={"type": "function", "function": {"name": N}}``: the output is forced to N's
  ``parameters`` schema and returned as one tool call (``content`` empty, ``finish_reason`` as generated);
- ``tool_choice="required"``: the output is forced to a JSON array of ``{"name", "parameters"}``
  objects, one of the tools each (at most one with ``parallel_tool_calls=false``), returned as
  ``tool_calls`` with ``finish_reason="tool_calls"``;
- ``"none"``: plain text; ``"auto"`` (the default with tools): plain text, returned as tool calls
  when the whole output is a JSON tool call (``{"name", "parameters" | "arguments"}`` or a list of
  them) naming a given tool. vLLM answers 400 to "auto" unless started with a model-specific
  ``--tool-call-parser``; flashpage has this one generic JSON parser instead.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from flashpage.engine.structured import StructuredOutputsParams
from flashpage.serve.protocol import APIError

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class ToolPlan:
    """How a chat request uses its tools. ``mode``: none | auto | required | named."""

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)  # the request's function definitions
    name: str | None = None  # the forced function (mode "named")
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["name"] for t in self.tools]

    @property
    def buffered(self) -> bool:
        """A stream that must hold the text back until the end (it may turn into tool calls)."""
        return self.mode in ("required", "auto") and bool(self.tools)


# --------------------------------------------------------------------------------------- requests
_GUIDED = ("json", "regex", "choice", "grammar")


def request_structured(req: Any) -> StructuredOutputsParams | None:
    """The constraint of a completions / chat request: ``response_format``, ``structured_outputs``, or
    vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``."""
    fields = req.structured_outputs
    guided = {k: getattr(req, f"guided_{k}") for k in _GUIDED if getattr(req, f"guided_{k}", None) is not None}
    if guided:
        if fields is not None:
            raise APIError("give 'structured_outputs' or the older 'guided_*' fields, not both",
                           param="structured_outputs")
        fields = guided
    return structured_from(req.response_format, fields)


def structured_from(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                    ) -> StructuredOutputsParams | None:
    """The constraint a request asks for with ``response_format`` (OpenAI) or ``structured_outputs`` (vLLM)."""
    spec = None
    if structured_outputs is not None:
        spec = _structured_outputs(structured_outputs)
    fmt = _response_format(response_format) if response_format is not None else None
    if spec is not None and fmt is not None:
        raise APIError("give 'response_format' or 'structured_outputs', not both", param="response_format")
    return spec or fmt


def constraint_param(req: Any, plan: ToolPlan | None = None) -> str:
    """The request field a constraint came from (named in a 400 when it cannot be compiled)."""
    if plan is not None and plan.mode in ("named", "required"):
        return "tool_choice" if plan.mode == "named" else "tools"
    guided = any(getattr(req, f"guided_{k}", None) is not None for k in _GUIDED)
    return "structured_outputs" if req.structured_outputs is not None or guided else "response_format"


def _structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams:
    known = set(StructuredOutputsParams.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise APIError(f"'structured_outputs' has unknown field(s) {unknown}; known: {sorted(known)}",
                       param="structured_outputs")
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(str(exc), param=_param(str(exc), "structured_outputs")) from None


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise APIError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                       param="response_format.type")
    body = fmt.get("json_schema")
    if not isinstance(body, dict):
        raise APIError("response_format type 'json_schema' needs a 'json_schema' object "
                       "({'name': ..., 'schema': {...}, 'strict': true})", param="response_format.json_schema")
    schema = body.get("schema")
    if not isinstance(schema, dict):
        raise APIError("'response_format.json_schema.schema' must be a JSON schema object",
                       param="response_format.json_schema.schema")
    if "strict" in body and not isinstance(body["strict"], bool) and body["strict"] is not None:
        raise APIError("'response_format.json_schema.strict' must be true or false",
                       param="response_format.json_schema.strict")
    if "name" in body and not (isinstance(body["name"], str) and _NAME.match(body["name"])):
        raise APIError("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                       param="response_format.json_schema.name")
    return StructuredOutputsParams(json=schema)  # strict or not, the schema is enforced (as vLLM does)


def _param(message: str, default: str) -> str:
    m = re.match(r"structured_outputs\.(\w+)", message)
    return f"structured_outputs.{m.group(1)}" if m else default


# ------------------------------------------------------------------------------------------ tools
def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice``; a 400 naming the field when they make no sense."""
    defs = [_function(t, i) for i, t in enumerate(tools or [])]
    if len(set(d["name"] for d in defs)) != len(defs):
        raise APIError("'tools' has two functions of the same name", param="tools")
    plan = ToolPlan(tools=defs, parallel=parallel_tool_calls is not False)
    if tool_choice is None:
        plan.mode = "auto" if defs else "none"
    elif tool_choice in ("none", "auto", "required"):
        plan.mode = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        plan.mode, plan.name = "named", tool_choice["function"]["name"]
        if plan.name not in plan.names:
            raise APIError(f"tool_choice names function {plan.name!r}, which is not in 'tools' "
                           f"({', '.join(plan.names) or 'none given'})", param="tool_choice")
    else:
        raise APIError("'tool_choice' must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if plan.mode in ("required", "named") and not defs:
        raise APIError(f"tool_choice {plan.mode!r} needs 'tools'", param="tool_choice")
    return plan


def _function(tool: dict[str, Any], i: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise APIError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}",
                       param=f"tools.{i}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError("a function name must be 1-64 letters, digits, '_' or '-'", param=f"tools.{i}.function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise APIError("'parameters' must be a JSON schema object", param=f"tools.{i}.function.parameters")
    return {**fn, "parameters": params or {"type": "object", "properties": {}}}


def tool_constraint(plan: ToolPlan) -> StructuredOutputsParams | None:
    """The schema that forces the output: the named function's parameters, or (required) an array of calls."""
    if plan.mode == "named":
        fn = next(t for t in plan.tools if t["name"] == plan.name)
        spec = StructuredOutputsParams(json=fn["parameters"])
    elif plan.mode == "required":
        items = {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t["name"]]}, "parameters": t["parameters"]},
             "required": ["name", "parameters"], "additionalProperties": False} for t in plan.tools]}
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
        if not plan.parallel:
            schema["maxItems"] = 1
        spec = StructuredOutputsParams(json=schema)
    else:
        return None
    return spec


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages for a HuggingFace chat template: tool calls' arguments as objects (HF's convention)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


# --------------------------------------------------------------------------------------- responses
def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]] | None:
    """Tool calls in ``text`` (a JSON call or list of calls naming given tools), or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in plan.names:
            return None
        args = item.get("parameters", item.get("arguments", {}))
        if not isinstance(args, dict):
            return None
        calls.append(_call(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def tool_message(text: str, finish_reason: str | None, plan: ToolPlan) -> tuple[dict[str, Any], str | None]:
    """The assistant message (and finish reason) of one sample under ``plan``."""
    if plan.mode == "named" and plan.name is not None:
        return {"role": "assistant", "content": "", "tool_calls": [_call(plan.name, text)]}, finish_reason
    if plan.mode in ("required", "auto") and plan.tools:
        calls = parse_calls(text, plan) if finish_reason == "stop" else None
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason


@dataclass
class ToolStream:
    """Stream deltas of one sample under a tool plan: a named call's arguments as they come; under
    "required" / "auto" the text is held back and sent whole at the end (as tool calls if it is one)."""

    plan: ToolPlan
    sent_header: bool = False
    call_id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    held: str = ""

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None] | None:
        """(delta body, finish reason) to send, or None to send nothing yet."""
        if self.plan.mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self.sent_header:
                call.update(id=self.call_id, type="function")
                call["function"] = {"name": self.plan.name, "arguments": text}
                self.sent_header = True
            elif not text:
                return ({}, finish_reason) if finish_reason is not None else None
            return {"tool_calls": [call]}, finish_reason
        self.held += text
        if finish_reason is None:
            return None
        message, reason = tool_message(self.held, finish_reason, self.plan)
        if message.get("tool_calls"):
            return {"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]}, reason
        return {"content": self.held}, reason
