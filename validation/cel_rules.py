"""CEL rules (`x-kubernetes-validations`) evaluated with the `cel` package (common-expression-language).

What differs from the API server and why: the Kubernetes CEL extension libraries are not part of
the `cel` package, so the few string functions these CRDs use are added here; rules using
`oldSelf` (transition rules) need a previous object and are skipped; a rule that this engine cannot
compile or evaluate is counted and reported as skipped instead of being reported as a violation.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

import cel

# Kubernetes escapes these property names in CEL (KEP-2876), e.g. `namespace` -> `__namespace__`.
_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
             "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}

stats: Counter = Counter()
skipped: dict[str, str] = {}   # rule -> reason, for the summary


def escape(name: str) -> str:
    if name in _RESERVED:
        return f"__{name}__"
    if any(c in name for c in "_.-/"):
        name = (name.replace("__", "__underscores__").replace(".", "__dot__")
                .replace("-", "__dash__").replace("/", "__slash__"))
    return name


def to_cel(value, schema: dict):
    """The value as CEL sees it: object properties escaped, maps (additionalProperties) not."""
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is not None:
            return {escape(k): to_cel(v, props.get(k, {})) for k, v in value.items()}
        extra = schema.get("additionalProperties")
        sub = extra if isinstance(extra, dict) else {}
        return {k: to_cel(v, sub) for k, v in value.items()}
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return [to_cel(v, items) for v in value]
    return value


def _split(s, sep, limit=None):
    if limit is None or limit < 0:
        return s.split(sep)
    if limit == 0:
        return []
    return s.split(sep, limit - 1)


_FUNCTIONS = {
    "lowerAscii": lambda s: s.lower(),
    "upperAscii": lambda s: s.upper(),
    "trim": lambda s: s.strip(),
    "split": _split,
}


@lru_cache(maxsize=None)
def _compile(rule: str):
    return cel.compile(rule)


def _context(self_value) -> "cel.Context":
    ctx = cel.Context()
    for name, fn in _FUNCTIONS.items():
        ctx.add_function(name, fn)
    ctx.add_variable("self", self_value)
    return ctx


def evaluate(rule: dict, value, schema: dict) -> str | None:
    """None when the rule holds (or cannot be evaluated here), else the violation message."""
    expression = rule.get("rule", "")
    if "oldSelf" in expression:
        stats["transition rules skipped"] += 1
        return None
    try:
        program = _compile(expression)
    except Exception as err:  # the cel binding raises ValueError/RuntimeError on unsupported syntax
        stats["skipped (cannot compile)"] += 1
        skipped.setdefault(expression, str(err).splitlines()[0])
        return None
    try:
        ok = program.execute(_context(to_cel(value, schema)))
    except Exception as err:
        stats["skipped (evaluation error)"] += 1
        skipped.setdefault(expression, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return None
    stats["evaluated"] += 1
    if ok is False:
        return rule.get("message") or f"failed rule: {expression}"
    return None
