"""A pickle reader for files from others (DCP's ``.metadata``, a data store's ``.npy``).

``pickle.Unpickler.find_class`` can limit which globals a file names, but not what the file
does with them. Its opcodes call what is on the stack (REDUCE, NEWOBJ, INST, OBJ), set the
state of whatever object is there (BUILD: a class or a function as well as an instance, so a
file naming only allowed classes could still patch one of them for the whole process,
``PosixPath.is_file`` made always true, say), and add items to it through its own methods
(APPEND, SETITEM, ADDITEMS). The C unpickler's opcodes cannot be changed, so this reader is the
pure-Python one with each of those limited: a file may *name* the allowed globals, *call*
only those the caller lists as callable (a class that may be named, as an argument, need not
be callable: numpy's ``ndarray`` over a raw buffer would read file bytes as object pointers),
set the state of instances of the ``buildable`` types only (each then checked), and add items
to lists, dicts and sets only. A few MB of metadata read in well under a second; nothing
larger goes through it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import Any, BinaryIO

_Base: Any = pickle._Unpickler  # the pure-Python unpickler: its opcodes can be replaced


class Refused(pickle.UnpicklingError):
    """The file asks for something this reader does not allow."""


class RestrictedUnpickler(_Base):
    """Names only ``allowed`` globals, calls only ``callables``, BUILDs only instances of
    ``buildable`` types (never a class), which ``check_built`` (if given) then inspects; adds
    items to lists, dicts and sets only; no persistent ids."""

    dispatch = dict(_Base.dispatch)

    def __init__(
        self,
        fp: BinaryIO,
        allowed: Mapping[tuple[str, str], Any],
        callables: Iterable[Any],
        buildable: tuple[type, ...],
        check_built: Callable[[Any], None] | None = None,
    ):
        super().__init__(fp)
        self._allowed = allowed
        self._keep = list(callables)  # alive, so the ids below stay theirs
        self._callables = {id(c) for c in self._keep}
        self._buildable = buildable
        self._check_built = check_built

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise Refused(f"'{module}.{name}' is not allowed") from None

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("a persistent id is not allowed")

    def _may_call(self, fn: Any) -> None:
        if id(fn) not in self._callables:
            raise Refused(f"calling {_describe(fn)} is not allowed")

    def _into(self, kinds: tuple[type, ...], what: str) -> Any:
        target = self.stack[-1]
        if not isinstance(target, kinds):
            raise Refused(f"adding {what} to {_describe(target)} is not allowed")
        return target

    def _load_reduce(self) -> None:
        self._may_call(self.stack[-2])
        _Base.load_reduce(self)

    def _load_newobj(self) -> None:
        self._may_call(self.stack[-2])
        _Base.load_newobj(self)

    def _load_newobj_ex(self) -> None:
        self._may_call(self.stack[-3])
        _Base.load_newobj_ex(self)

    def _instantiate(self, klass: Any, args: list) -> None:  # INST and OBJ
        self._may_call(klass)
        _Base._instantiate(self, klass, args)

    def _load_build(self) -> None:
        inst = self.stack[-2]
        if isinstance(inst, type) or not isinstance(inst, self._buildable):
            raise Refused(f"setting the state of {_describe(inst)} is not allowed")
        _Base.load_build(self)
        if self._check_built is not None:
            self._check_built(inst)

    def _load_append(self) -> None:
        value = self.stack.pop()
        self._into((list,), "items").append(value)

    def _load_appends(self) -> None:
        items = self.pop_mark()
        self._into((list,), "items").extend(items)

    def _load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._into((dict,), "entries")[key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._into((dict,), "entries")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _load_additems(self) -> None:
        items = self.pop_mark()
        self._into((set,), "members").update(items)

    for _op, _fn in (
        (pickle.REDUCE, _load_reduce),
        (pickle.NEWOBJ, _load_newobj),
        (pickle.NEWOBJ_EX, _load_newobj_ex),
        (pickle.BUILD, _load_build),
        (pickle.APPEND, _load_append),
        (pickle.APPENDS, _load_appends),
        (pickle.SETITEM, _load_setitem),
        (pickle.SETITEMS, _load_setitems),
        (pickle.ADDITEMS, _load_additems),
    ):
        dispatch[_op[0]] = _fn
    del _op, _fn


def _describe(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return f"a {type(obj).__name__}"
