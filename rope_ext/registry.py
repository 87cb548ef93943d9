"""A name -> object registry whose lookup errors list the valid names (used for methods and families)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, valid: str) -> None:
        self.kind = kind  # "method"
        self.valid = valid  # "valid methods"
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        self.get(name)  # raises naming the valid ones
        del self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; {self.valid}: {', '.join(self.names())}") from None

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())
