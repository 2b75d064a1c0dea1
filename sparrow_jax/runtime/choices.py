"""Settings with a closed set of values (modes, engines, backends) as string enums.

A `Choice` member *is* its string (`RolloutMode.SPARSE == "sparse"`, same hash), so gin files,
JSON records and jit static arguments keep their plain strings, while a wrong value fails when
the config is created - with the setting's name and every allowed value - instead of deep inside
a run. `runtime.config_check` reads the same enums to reject a bad gin binding before anything
is built.
"""

from __future__ import annotations

import enum

__all__ = ["Choice"]


class Choice(enum.StrEnum):
    """Base of the project's mode enums."""

    def __repr__(self) -> str:       # 'sparse', as the plain string reads (configs, messages)
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value: object, setting: str) -> "Choice":
        """`value` as a member of this enum, or ValueError naming `setting` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{setting} must be one of {cls.values()}, got {value!r}") from None
