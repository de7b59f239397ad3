"""vLLM's `pythonic` format (Llama 3.2 and 4 with their pythonic templates, ToolACE): the whole
output is one Python list of calls with keyword arguments,

    [get_weather(city="Paris", days=3), search(query='x', tags=["a", "b"], exact=true)]

read with `ast` and never evaluated: an argument must be a literal (str, number, True/False/
None and JSON's true/false/null, lists, tuples and sets as lists, dicts with literal keys,
+/- numbers, f-strings without placeholders), as vLLM's `get_parameter_value` accepts.

Unlike vLLM: whitespace around the list is allowed (vLLM wants `[` first and `ast.parse` fails
on a leading space); a positional or `**` argument makes the output content where vLLM drops
the argument silently; a dotted name (`a.b.c(...)`) stays dotted, as in vLLM.
"""

from __future__ import annotations

import ast
import math

from webapp.parsers.base import Scan, ToolCall, ToolParser, arguments_json

_JSON_NAMES = {"true": True, "false": False, "null": None}


class NotLiteral(ValueError):
    pass


def literal(node: ast.expr) -> object:
    """The JSON value of a literal node, else NotLiteral."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, int)) or (isinstance(value, float) and math.isfinite(value)):
            return value
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        if all(isinstance(k, ast.Constant) and isinstance(k.value, (str, int, float, bool)) for k in node.keys):
            return {k.value: literal(v) for k, v in zip(node.keys, node.values)}
    elif isinstance(node, ast.JoinedStr) and all(isinstance(part, ast.Constant) for part in node.values):
        return "".join(str(part.value) for part in node.values)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise NotLiteral(ast.dump(node))


def dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
        return None
    name = dotted(node.func)
    if name is None:
        return None
    try:
        arguments = arguments_json({kw.arg: literal(kw.value) for kw in node.keywords})
    except (NotLiteral, ValueError):
        return None
    return None if arguments is None else ToolCall(name, arguments)


class PythonicParser(ToolParser):
    """An output that begins with `[` (after whitespace) is calls if it parses, else content."""

    name = "pythonic"

    def _extract(self, text):
        source = text.strip()
        if not source.startswith("["):
            return text or None, []
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return text, []
        calls = [call(node) for node in tree.body.elts]
        if None in calls:
            return text, []
        return None, calls

    def scan(self, text: str, sent: int) -> tuple[int, Scan]:
        rest = text.lstrip()
        if not rest:
            return 0, "open"
        return (0, "tools") if rest.startswith("[") else (len(text), "text")
