"""Named choices: :class:`ChoiceEnum`, a string enum whose unknown values list the valid ones, and
:class:`EnumField`, a frozen-dataclass field that holds an enum member and is set from the member
or its value."""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

E = TypeVar("E", bound=enum.Enum)
C = TypeVar("C", bound="ChoiceEnum")


class ChoiceEnum(str, enum.Enum):
    """A string enum whose unknown values raise a ``ValueError`` listing the valid choices."""

    @classmethod
    def _missing_(cls: type[C], value: object) -> C | None:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; choose one of {choices}")


class EnumField(Generic[E]):
    """A dataclass field that reads as a member of its enum and is set from a member or its value.

    The enum's constructor converts what is set, so an unknown value raises its ``ValueError`` when
    the dataclass is built. Type checkers take ``__set__``'s value type for the generated
    ``__init__`` parameter, so ``Spec(form="linear")`` is well-typed while ``spec.form`` is the
    enum member.

    Example:
        >>> from dataclasses import dataclass
        >>> class Form(ChoiceEnum):
        ...     BOUNDED = "bounded"
        ...     LINEAR = "linear"
        >>> @dataclass(frozen=True)
        ... class Spec:
        ...     form: EnumField[Form] = EnumField(Form.BOUNDED)
        >>> Spec(form="linear").form, Spec().form
        (<Form.LINEAR: 'linear'>, <Form.BOUNDED: 'bounded'>)
        >>> Spec(form="round")
        Traceback (most recent call last):
        ...
        ValueError: 'round' is not a valid Form; choose one of 'bounded', 'linear'
    """

    def __init__(self, default: E) -> None:
        self.default = default
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, instance: object | None, owner: type | None = None) -> E:
        # ``dataclasses`` reads the class attribute (instance None) as the field's default.
        if instance is None:
            return self.default
        value: E = instance.__dict__[self._name]
        return value

    def __set__(self, instance: object, value: E | str) -> None:
        # A frozen dataclass's ``__init__`` sets fields with ``object.__setattr__``, which reaches
        # this data descriptor; assignment after construction is refused by the dataclass first.
        instance.__dict__[self._name] = type(self.default)(value)

    def __repr__(self) -> str:
        return f"EnumField({self.default!r})"


__all__ = ["ChoiceEnum", "EnumField"]
