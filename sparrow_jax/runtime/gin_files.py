"""Gin files: parsing a command's files + overrides, and reading one binding of a saved config.

`parse_gin` binds what the files say; the configurables they name must be registered first,
i.e. the modules that declare them imported (the `sparrow` command imports all of them:
sparrow_jax.cli.CONFIGURABLE_MODULES; a library entry point imports those its files bind).
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

import gin
from gin import config_parser

# A binding's value that is a bare word or path (an unquoted string), not a gin literal.
_BARE = re.compile(r"(?!(True|False|None)$)[A-Za-z_./~][\w./~:-]*")


def parse_gin(config_files: Sequence[str], params: Sequence[str]) -> None:
    """Parses gin files + overrides; a bad file, unknown key or bad value exits with its message."""
    for f in config_files:
        if not os.path.exists(f):
            raise SystemExit(f"sparrow: gin file {f!r} does not exist")
    gin.clear_config()  # a fresh configuration per command, also when called twice in-process
    try:
        gin.parse_config_files_and_bindings(list(config_files), list(params))
    except (ValueError, KeyError, SyntaxError, TypeError) as e:
        # Python's literal parser names a bare word only as `<ast.Name object at 0x...>`.
        text = " ".join(re.sub(r"malformed node or string on line \d+: <ast\.\w+ object at "
                               r"0x[0-9a-f]+>", "not a value:", str(e)).split())
        hint = "".join(f"; {b.strip()!r}: a string needs quotes ({k.strip()} = '{v.strip()}')"
                       for b in params for k, _, v in [b.partition("=")]
                       if _BARE.fullmatch(v.strip()))
        raise SystemExit(f"sparrow: bad gin configuration: {text}{hint}") from None


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
