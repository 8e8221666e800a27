"""Checks on values that come from outside: JSON files of a checkpoint, numbers from callers,
the MT_* environment variables.

A checkpoint is data someone else wrote, so every value read from it is checked for its type,
finiteness and range before anything is computed or allocated from it, and a failure names the
file and the field. Python's ``json`` accepts ``NaN`` and ``Infinity`` and maps a number to
``int`` or ``float`` by how it is spelled, so "is it a number" needs saying precisely here once,
not guessed at in each reader. Callers' numbers may be NumPy scalars (``np.float32(0.7)``,
``np.int64(8)``): ``numbers.Real`` / ``numbers.Integral`` accept them; ``bool`` (an int to
Python) is refused wherever a number is meant. A JSON object from a client is read through
``FieldsRead``, which remembers which keys were looked at: a key never read was not acted on,
and is refused rather than dropped (the server's request bodies, a chat template's messages).

    >>> is_integer(np.int64(3)), is_integer(True), is_integer(2.0)
    (True, False, False)
    >>> is_real(np.float32(0.5)), is_real(float("nan")), is_real("1")
    (True, True, False)
"""
import json
import math
import os
from collections import Counter
from numbers import Integral, Real
from pathlib import Path
from typing import TypeGuard

import numpy as np

from minitransformer.errors import CheckpointError, SettingError


def is_integer(x) -> TypeGuard[int | np.integer]:
    """An int or a NumPy integer, not a bool."""
    return isinstance(x, Integral) and not isinstance(x, (bool, np.bool_))


def is_real(x) -> bool:
    """An int, float or NumPy number, not a bool (NaN and inf included: check them apart)."""
    return isinstance(x, Real) and not isinstance(x, (bool, np.bool_))


def duplicate_keys(pairs) -> list:
    """The keys a JSON object lists more than once (``json`` would keep only the last), in
    order; linear in the number of keys, so a header of a million names is still quick.

    >>> duplicate_keys([("a", 1), ("b", 2), ("a", 3)])
    ['a']
    """
    counts = Counter(key for key, _ in pairs)
    return sorted(key for key, n in counts.items() if n > 1)


def no_duplicates(refuse):
    """An ``object_pairs_hook`` for ``json.loads``: each object as a dict, or the exception
    refuse(the keys it lists twice) raised, where ``json`` would silently keep the last."""
    def hook(pairs):
        twice = duplicate_keys(pairs)
        if twice:
            raise refuse(twice)
        return dict(pairs)
    return hook


class FieldsRead(dict):
    """A JSON object that remembers which of its keys were looked at (by key, by ``in``, or
    all at once by iterating it), so that those never read can be refused, not dropped.

    >>> body = FieldsRead({"role": "user", "content": "hi", "name": "Ada"})
    >>> body["role"], body.get("content"), body.unread()
    ('user', 'hi', ['name'])
    """

    def __init__(self, body):
        super().__init__(body)
        self.read = set()

    def get(self, field, default=None):
        self.read.add(field)
        return super().get(field, default)

    def __getitem__(self, field):
        self.read.add(field)
        return super().__getitem__(field)

    def __contains__(self, field):
        self.read.add(field)
        return super().__contains__(field)

    def __iter__(self):         # a template's {% for k, v in m.items() %}, its tojson: all read
        self.read.update(dict.keys(self))
        return super().__iter__()

    def keys(self):
        self.read.update(dict.keys(self))
        return super().keys()

    def values(self):
        self.read.update(dict.keys(self))
        return super().values()

    def items(self):
        self.read.update(dict.keys(self))
        return super().items()

    def unread(self) -> list:
        """The keys never looked at, in the object's order (this look marks none read)."""
        return [field for field in dict.keys(self) if field not in self.read]


def read_json_object(file: Path, what: str = "a JSON object") -> dict:
    """A JSON file that must hold one object -> dict, or a CheckpointError naming the file.

    Duplicate keys are refused: ``json`` would silently keep the last one."""
    unique = no_duplicates(lambda twice: CheckpointError(
        f"{file}: duplicate key(s) {', '.join(map(repr, twice))}"))
    try:
        text = Path(file).read_bytes().decode("utf-8")
        value = json.loads(text, object_pairs_hook=unique)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected {what}, got a JSON {type(value).__name__}")
    return value


def integer_field(source, name: str, value, low: int = 0, high: int | None = None) -> int:
    """A JSON integer in [low, high] -> int. ``2.0`` and ``2.7`` are refused alike: an id or a
    size written as a float is a broken file, and rounding it would hide that."""
    if not is_integer(value):
        raise CheckpointError(f"{source}: field {name!r} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise CheckpointError(f"{source}: field {name!r} must be {bound}, got {value}")
    return int(value)


def positive_number_field(source, name: str, value) -> float:
    """A finite JSON number > 0 -> float (``NaN`` / ``Infinity`` are valid JSON, not valid here)."""
    if not is_real(value):
        raise CheckpointError(f"{source}: field {name!r} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{source}: field {name!r} must be a finite number > 0, "
                              f"got {value!r}")
    return float(value)


def flag_field(source, name: str, value) -> bool:
    """A JSON true or false -> bool (``1`` and ``"true"`` are refused: not booleans)."""
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: field {name!r} must be true or false, "
                              f"got {value!r:.100}")
    return value


def token_ids_field(source, name: str, value) -> tuple[int, ...]:
    """An id or a list of ids (eos_token_id, ...) -> tuple of ints >= 0."""
    values = value if isinstance(value, list) else [value]
    return tuple(integer_field(source, name, v) for v in values)


def check_missing(source, expected, found) -> None:
    """Every expected tensor name is among those found, or an error naming the first few."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def check_finite(file: Path | str, name: str, w: np.ndarray) -> np.ndarray:
    """A NaN or inf weight makes every logit NaN, and argmax of NaNs is token 0: refuse it.

    One sum is the cheap test (NaN and inf survive a sum); only when it is not finite, which
    an overflow of huge finite values could also cause, is every element looked at."""
    if np.isfinite(w.sum()) or np.isfinite(w).all():
        return w
    where = np.unravel_index(np.flatnonzero(~np.isfinite(w))[0], w.shape)
    raise CheckpointError(f"{file}: tensor {name!r} holds a non-finite value "
                          f"({w[where]} at index {tuple(int(i) for i in where)})")


def environment_choice(name: str, allowed: tuple, what: str, unset: str):
    """The environment variable `name`, stripped and lower-cased: one of `allowed`, or None
    when unset or empty; any other value a SettingError naming the variable, the value and
    the values allowed. what: what a value is ("a backend"); unset: what leaving it unset
    does ("to measure").

    >>> os.environ["MT_EXAMPLE"] = " Flat "
    >>> environment_choice("MT_EXAMPLE", ("flat", "rows"), "a route", "to measure")
    'flat'
    >>> os.environ["MT_EXAMPLE"] = "fastest"
    >>> try:
    ...     environment_choice("MT_EXAMPLE", ("flat", "rows"), "a route", "to measure")
    ... except SettingError as e:
    ...     print(e)
    MT_EXAMPLE='fastest' is not a route: use one of flat, rows, or leave it unset to measure
    >>> del os.environ["MT_EXAMPLE"]
    """
    value = os.environ.get(name, "").strip().lower() or None
    if value is not None and value not in allowed:
        raise SettingError(f"{name}={value!r} is not {what}: use one of {', '.join(allowed)}, "
                           f"or leave it unset {unset}")
    return value
