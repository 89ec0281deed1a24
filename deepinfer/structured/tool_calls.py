"""The grammar of a forced tool call in DeepSeek-V4's DSML markup (``tool_choice: "required"`` or a named
function): one ``tool_calls`` block of one or more ``invoke``s of the allowed functions, each with its
parameters in schema order (required ones always, optional ones optionally). A ``string`` parameter is raw
text (``string="true"``; an ``enum`` of strings is one of its values); any other is JSON validated against
its own schema (``string="false"``, llguidance's ``%json``). The result parses with
``chat.parsing.parse_assistant_output`` into OpenAI ``tool_calls``.

The DSML marker ``｜DSML｜`` is a special token, so the grammar names it by id (``<[id]>``): a special
token never matches literal text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def _lit(text: str) -> str:
    return json.dumps(text)


def _parameter(rule: str, name: str, schema: dict[str, Any], dsml: str) -> str:
    if schema.get("type") == "string":
        enum = schema.get("enum")
        value = "(" + " | ".join(_lit(str(v)) for v in enum) + ")" if enum else "/[^<]*/"
        head = _lit(f'parameter name="{name}" string="true">')
    else:
        value = "%json " + json.dumps(schema)
        head = _lit(f'parameter name="{name}" string="false">')
    return f'{rule}: "<" {dsml} {head} {value} "</" {dsml} "parameter>" "\\n"'


def tool_call_grammar(functions: Sequence[dict[str, Any]], dsml_token_id: int) -> str:
    """A Lark grammar (llguidance's dialect) for a DSML block calling only ``functions`` (OpenAI function
    specs: ``name``, ``parameters``)."""
    dsml = f"<[{dsml_token_id}]>"
    rules, calls = [], []
    for k, f in enumerate(functions):
        params = f.get("parameters") or {}
        required = set(params.get("required") or ())
        parts = []
        for j, (pname, pschema) in enumerate((params.get("properties") or {}).items()):
            rule = f"p{k}_{j}"
            rules.append(_parameter(rule, pname, pschema if isinstance(pschema, dict) else {}, dsml))
            parts.append(rule if pname in required else rule + "?")
        head = _lit(f'invoke name="{f["name"]}">')
        rules.append(f'c{k}: "<" {dsml} {head} "\\n" {" ".join(parts)} "</" {dsml} "invoke>" "\\n"')
        calls.append(f"c{k}")
    start = f'start: "\\n\\n<" {dsml} "tool_calls>" "\\n" ({" | ".join(calls)})+ "</" {dsml} "tool_calls>"'
    return "\n".join([start, *rules])
