"""Gin files: parsing a command's files + overrides, and reading one binding of a saved config.

`parse_gin` binds what the files say; the configurables they name must be registered first,
i.e. the modules that declare them imported (the `sparrow` command imports all of them:
sparrow_jax.cli.CONFIGURABLE_MODULES; a library entry point imports those its files bind).
"""

from __future__ import annotations

import ast
import operator
import os
import re
from typing import Any, Sequence

import gin
from gin import config_parser

# A binding's value that is a bare word or path (an unquoted string), not a gin literal.
_BARE = re.compile(r"(?!(True|False|None|inf|nan)$)[A-Za-z_./~][\w./~:-]*")
# Python arithmetic or a call in a binding's value (`[48]*10`, `2**20`, `float('inf')`).
_EXPRESSION = re.compile(r"[\])\d]\s*[*+/-]|\w\(")


def parse_gin(config_files: Sequence[str], params: Sequence[str]) -> None:
    """Parses gin files + overrides; a bad file, unknown key or bad value exits with its message."""
    for f in config_files:
        if not os.path.exists(f):
            raise SystemExit(f"sparrow: gin file {f!r} does not exist")
    gin.clear_config()  # a fresh configuration per command, also when called twice in-process
    try:
        gin.parse_config_files_and_bindings(list(config_files), list(params))
    except (ValueError, KeyError, SyntaxError, TypeError) as e:
        raise SystemExit(f"sparrow: bad gin configuration: {parse_error(e, params)}") from None


def _evaluated(value: str) -> Any:
    """A Python expression of literals (`[48] * 10`, `2 ** 20`) evaluated, or None."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Pow: operator.pow}

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [ev(e) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (not isinstance(right, int) or right > 64):
                raise ValueError(value)
            if isinstance(node.op, ast.Mult) and isinstance(right, int) and right > 10_000:
                raise ValueError(value)
            return ops[type(node.op)](left, right)
        raise ValueError(value)
    try:
        return ev(ast.parse(value, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, OverflowError):
        return None


def _value_hint(binding: str) -> str:
    """What is wrong with the value of one `Name.field = value` line, and what to write; ""
    when it is not clear."""
    key, _, value = (part.strip() for part in binding.partition("="))
    if value in ("inf", "-inf", "nan"):
        return "gin has no inf or nan, and every float setting must be finite"
    if _EXPRESSION.search(value):
        result = _evaluated(value)
        instead = (f": write {key} = {result!r}" if result is not None and len(repr(result)) < 300
                   else ": write the value out")
        return (f"gin reads literal values only (numbers, strings, lists, tuples, dicts), not "
                f"Python expressions{instead}")
    if _BARE.fullmatch(value):
        return f"a string needs quotes ({key} = '{value}')"
    return ""


def parse_error(error: BaseException, params: Sequence[str]) -> str:
    """One line for a gin parse error: gin's message, the file and line (or the --gin_param)
    of the binding it is in, and what to write instead where that is clear (issue 58: `[48]*10`
    said only "Expected newline")."""
    # Python's literal parser names a bare word only as `<ast.Name object at 0x...>`.
    raw = error.args[0] if isinstance(error, SyntaxError) and error.args else error
    text = " ".join(re.sub(r"malformed node or string on line \d+: <ast\.\w+ object at "
                           r"0x[0-9a-f]+>", "not a value:", str(raw)).split())
    line = (getattr(error, "text", None) or "").strip() if isinstance(error, SyntaxError) else ""
    if line:
        where = (f"{error.filename}:{error.lineno}" if getattr(error, "filename", None)
                 else "--gin_param")
        hint = _value_hint(line)
        return f"{where}: {line!r}: {text}{'; ' + hint if hint else ''}"
    return text + "".join(f"; {b.strip()!r}: {h}" for b in params for h in [_value_hint(b)]
                          if h)


class _Placeholder(config_parser.ParserDelegate):
    """Parses any gin file without the configurables being registered: references and macros
    become inert strings, which is enough to read one literal binding."""

    def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> str:
        return "@" + scoped_configurable_name + ("()" if evaluate else "")

    def macro(self, macro_name: str) -> str:
        return "%" + macro_name


def gin_binding(config_text: str, selector: str, arg_name: str) -> Any:
    """The literal value bound to `selector.arg_name` (unscoped) in a gin config, or None.

    gin's own parser (not a regex): operative configs wrap long values onto continuation lines,
    and a module-qualified selector (`sparrow_jax.train.config.TrainConfig`) names the same binding.
    """
    value = None
    for stmt in config_parser.ConfigParser(config_text, _Placeholder()):
        if (isinstance(stmt, config_parser.BindingStatement) and not stmt.scope
                and stmt.arg_name == arg_name
                and (stmt.selector == selector or stmt.selector.endswith("." + selector))):
            value = stmt.value  # the last binding wins, as in gin
    return value


def bound_configurables(config_file: str) -> set[str]:
    """The configurables a gin file (and the files it includes) binds, by their short name
    (`TrainConfig` for `sparrow_jax.train.config.TrainConfig` too); nothing is registered or
    bound."""
    found: set[str] = set()
    pending, seen = [config_file], set()
    while pending:
        path = pending.pop()
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        with open(path) as f:
            for stmt in config_parser.ConfigParser(f, _Placeholder()):
                if isinstance(stmt, config_parser.BindingStatement):
                    found.add(stmt.selector.rsplit(".", 1)[-1])
                elif isinstance(stmt, config_parser.IncludeStatement):
                    pending.append(os.path.join(os.path.dirname(path), stmt.filename)
                                   if not os.path.isabs(stmt.filename) else stmt.filename)
    return found
