"""A pickle reader for files from others (DCP's ``.metadata``, a data store's ``.npy``).

``pickle.Unpickler.find_class`` can limit which globals a file names, but not what the file
does with them: its BUILD opcode sets attributes on whatever object is on the stack, a class
or a function as well as an instance, so a file naming only allowed classes could still patch
one of them for the whole process (``PosixPath.is_file`` made always true, say). The C
unpickler's opcodes cannot be changed, so this reader is the pure-Python one with BUILD
restricted to instances of the types the caller names, each checked after it is built.
A few MB of metadata read in well under a second; nothing larger goes through it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO


class Refused(pickle.UnpicklingError):
    """The file asks for something this reader does not allow."""


class RestrictedUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be replaced
    """Loads only the named globals; BUILD only on instances of ``buildable`` types (never on a
    class), which ``check_built`` (if given) then inspects; no persistent ids."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(
        self,
        fp: BinaryIO,
        allowed: Mapping[tuple[str, str], Any],
        buildable: tuple[type, ...],
        check_built: Callable[[Any], None] | None = None,
    ):
        super().__init__(fp)
        self._allowed = allowed
        self._buildable = buildable
        self._check_built = check_built

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise Refused(f"'{module}.{name}' is not allowed") from None

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("a persistent id is not allowed")

    def _load_build(self) -> None:
        inst = self.stack[-2]  # type: ignore[attr-defined]  # set by load(), under the state
        if isinstance(inst, type) or not isinstance(inst, self._buildable):
            raise Refused(f"setting the state of {_describe(inst)} is not allowed")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]
        if self._check_built is not None:
            self._check_built(inst)

    dispatch[pickle.BUILD[0]] = _load_build  # type: ignore[assignment]


def _describe(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return f"a {type(obj).__name__}"
