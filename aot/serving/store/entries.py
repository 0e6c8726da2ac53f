"""A store index's task entries, each parsed and checked on its first use: a step that serves a few of 100,000 tasks
parses those few (aot.serving.store.reader.StoreIndex); listing every task parses them all, once."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping


class ParsedEntries:
    """A snapshot of a generation's raw entries, name -> parse(name, raw): a parsed entry (any object) or the
    message (str) of a bad one, computed once per name. A snapshot never changes: a newer generation is a new
    ParsedEntries (`changed`), so a thread reading this one meanwhile sees one generation whole."""

    def __init__(self, raw: dict[str, dict], parse: Callable[[str, dict], object], cache: dict | None = None):
        self.raw, self._parse = raw, parse
        self._cache: dict[str, object] = {} if cache is None else cache

    def result(self, name: str):
        """The parsed entry, its error message, or None when the index has no such task."""
        found = self._cache.get(name)
        if found is None:
            raw = self.raw.get(name)
            if raw is None:
                return None
            found = self._cache[name] = self._parse(name, raw)
        return found

    def changed(self, now: Mapping[str, dict], names: set[str]) -> ParsedEntries:
        """The snapshot with the entries of `names` taken from `now` (the newer state); the others stay parsed."""
        raw = dict(self.raw)
        for name in names:
            entry = now.get(name)
            if entry is None:
                raw.pop(name, None)
            else:
                raw[name] = entry
        cache = dict(self._cache)  # one copy under the GIL: request and audit threads add to it meanwhile
        for name in names:
            cache.pop(name, None)
        return ParsedEntries(raw, self._parse, cache)

    def parsed(self) -> int:
        """How many entries were parsed so far (a test counts what a start-up read)."""
        return len(self._cache)


class EntryView(Mapping):
    """The valid entries (`errors` False: name -> entry) or the bad ones (`errors` True: name -> message) of a
    ParsedEntries. A lookup parses one entry; iterating parses them all."""

    def __init__(self, parsed: ParsedEntries, errors: bool):
        self.parsed, self.errors = parsed, errors

    def __getitem__(self, name: str):
        found = self.parsed.result(name)
        if found is None or isinstance(found, str) != self.errors:
            raise KeyError(name)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter([name for name in self.parsed.raw
                     if isinstance(self.parsed.result(name), str) == self.errors])

    def __len__(self) -> int:
        return sum(1 for _ in self)
