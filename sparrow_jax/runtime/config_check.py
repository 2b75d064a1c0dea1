"""Type checks of gin bindings against the annotations of the configurables they bind.

gin parses `TrainConfig.total_steps = 'ten'` without complaint (it knows no types), and the run
then fails somewhere deep inside with a traceback (`'<' not supported between int and str`).
`check_bindings()` compares every bound value with the parameter's annotation before anything
is built and raises one `TypeError` naming each bad binding:

    TrainConfig.total_steps = 'ten': expected int, got str

Only what is certain is rejected: annotations it does not understand (`Any`, callables, custom
classes), gin references (`@fn`, `@fn()`) and macros (`%NAME`) pass. An int is accepted for a
float, a list for a tuple (gin files write `(1, 2)` and `[1, 2]` alike), and `bool` is *not* an
int (`TrainConfig.total_steps = True` is almost surely a mistake).

A float that is not finite (`LearnerConfig.learning_rate = 1e999` is inf to Python) is refused
too, in any setting: no setting of ours means anything at inf or NaN, and an infinite learning
rate used to be found only as five skipped steps of "non-finite loss" (issue 58).
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import math
import types
import typing
from typing import Any

from gin import config as gin_config

__all__ = ["check_bindings", "type_error", "non_finite"]

_UNKNOWN = object()   # "cannot tell": never an error


def _is_reference(value: Any) -> bool:
    if isinstance(value, gin_config.ConfigurableReference):
        return True
    if isinstance(value, (list, tuple)):
        return any(_is_reference(v) for v in value)
    if isinstance(value, dict):
        return any(_is_reference(v) for v in value.values())
    return False


def _name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _fits(value: Any, tp: Any) -> bool | object:
    """True / False, or _UNKNOWN where the annotation is beyond this checker."""
    if tp is Any or tp is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        answers = [_fits(value, a) for a in args]
        if any(a is True for a in answers):
            return True
        return _UNKNOWN if any(a is _UNKNOWN for a in answers) else False
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in args
    if isinstance(tp, type) and issubclass(tp, enum.Enum):     # a mode (runtime.choices)
        # The type is a string; which strings the config takes it says itself when built,
        # naming the choices, with the run's other problems (train.preflight).
        return isinstance(value, (tp, str))
    if origin in (tuple, list, collections.abc.Sequence):
        if not isinstance(value, (tuple, list)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                return False
            items = zip(value, args)
        else:
            items = ((v, args[0]) for v in value) if args else ()
        answers = [_fits(v, a) for v, a in items]
        if any(a is False for a in answers):
            return False
        return _UNKNOWN if any(a is _UNKNOWN for a in answers) else True
    if origin is dict or tp is dict:
        return isinstance(value, dict) or _UNKNOWN
    if tp in (tuple, list):
        return isinstance(value, (tuple, list))
    return _UNKNOWN


def _hints(fn: Any) -> dict[str, Any]:
    target = fn.__init__ if inspect.isclass(fn) and not _is_dataclass(fn) else fn
    try:
        return typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - an annotation we cannot resolve: check nothing
        return {}


def _is_dataclass(cls: Any) -> bool:
    return hasattr(cls, "__dataclass_fields__")


def type_error(selector: str, param: str, value: Any, hints: dict[str, Any]) -> str | None:
    """The message for one binding whose value does not fit its annotation, else None."""
    if param not in hints or _is_reference(value):
        return None
    tp = hints[param]
    if _fits(value, tp) is not False:
        return None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return (f"{selector}.{param} = {value!r:.80}: expected one of "
                f"{tuple(m.value for m in tp)}")
    return (f"{selector}.{param} = {value!r:.80}: expected {_name(tp)}, got "
            f"{type(value).__name__}")


def non_finite(value: Any) -> bool:
    """Whether `value` is, or holds (in a list, tuple or dict), a float that is inf or NaN."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(non_finite(v) for v in value.values())
    return False


def check_bindings() -> None:
    """Raises TypeError listing every gin binding of a wrong type or with a non-finite float
    (see the module docstring)."""
    errors = []
    for (scope, selector), params in sorted(gin_config._CONFIG.items(),
                                            key=lambda kv: (kv[0][0] or "", kv[0][1])):
        configurable = gin_config._REGISTRY.get_match(selector)
        if configurable is None:
            continue
        hints = _hints(configurable.wrapped)
        shown = f"{scope}/{configurable.name}" if scope else configurable.name
        for param, value in params.items():
            message = type_error(shown, param, value, hints)
            if message:
                errors.append(message)
            elif non_finite(value):
                errors.append(f"{shown}.{param} = {value!r:.80}: not a finite number (every "
                              f"float setting must be finite)")
    if errors:
        raise TypeError("bad gin value: " + "; ".join(errors))

