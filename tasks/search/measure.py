"""The search's measurements on real engines: the `Measurer` the course (driver.py) asks, over built variants.

Runtimes are loaded on demand through `load` and kept for the few most recently used (`keep_loaded`: the baseline,
the leader and the candidate being raced stay; a round walks the candidates in order). A speed pair is one short
greedy decode of each of the two, back to back, the order alternating from pair to pair (the machine's load moves
both alike; which runs first does not favour either); each runtime decodes once untimed at its first use. Windows
are scored once per (variant, split) and kept, so a later round reads only its new windows. The proxy windows'
reference (the baseline's log-probabilities) is computed once. With a `journal` (journal.py) every measurement is
kept on disk as it is made and handed back instead of measured again: a search killed midway resumes there."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from tasks.failpoints import failpoint
from tasks.search.driver import Split
from tasks.search.journal import Journal
from tasks.search.proxies import Proxy, log_probs, proxy, timed_decode


class EngineMeasurer:
    """`windows`: token windows per split ("proxy", "search", "confirm"); `sizes`: each variant's stored bytes;
    `prompt`: the decode prompt's tokens; `new_tokens`: per timed decode (its rate after the first token, as
    the benchmark reads decode speed)."""

    def __init__(
        self,
        load: Callable[[str], Any],
        sizes: dict[str, int],
        windows: dict[str, list[list[int]]],
        prompt: list[int],
        new_tokens: int = 32,
        baseline: str = "baseline",
        keep_loaded: int = 3,
        loaded: dict[str, Any] | None = None,
        journal: Journal | None = None,
        identities: dict[str, str] | None = None,
    ) -> None:
        if new_tokens < 2:
            raise ValueError("a timed decode needs at least 2 new tokens")
        self._load, self._sizes, self._windows = load, sizes, windows
        self._prompt, self._new_tokens, self._baseline = prompt, new_tokens, baseline
        self._loaded: OrderedDict[str, Any] = OrderedDict(loaded or {})  # runtimes the caller loaded already
        self._keep = keep_loaded
        self._warm: set[str] = set()
        self._journal = journal or Journal(None)  # None: kept in memory, every measurement made afresh
        self._reference: list[Any] | None = None
        # pairs asked per (candidate, leader): the journal answers the first ones
        self._asked: dict[str, int] = {}
        # name -> its bytes' hash: what the journal keeps measurements under
        self._identity = identities or {}
        self.pairs = 0

    def runtime(self, name: str) -> Any:
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return self._loaded[name]
        runtime = self._load(name)
        self._loaded[name] = runtime
        while len(self._loaded) > self._keep:
            evicted, gone = self._loaded.popitem(last=False)
            self._warm.discard(evicted)  # loaded again, it decodes once untimed again
            getattr(gone, "close", lambda: None)()
        return runtime

    def close(self) -> None:
        """Let every loaded runtime go (a process of its own ends)."""
        while self._loaded:
            _, gone = self._loaded.popitem(last=False)
            getattr(gone, "close", lambda: None)()

    def proxy(self, name: str) -> Proxy:
        if self._id(name) in self._journal.proxies:
            held = self._journal.proxies[self._id(name)]
            return Proxy(**{**held, "candidate": name, "kl_windows": tuple(held["kl_windows"])})
        if self._reference is None:
            self._reference = log_probs(self.runtime(self._baseline), self._windows["proxy"])
        runtime, windows = self.runtime(name), self._windows["proxy"]
        self._warm.add(name)  # the proxy's decode warmed it
        found = proxy(
            name, self._sizes[name], runtime, self._reference, windows, self._prompt, self._new_tokens
        )
        self._journal.proxies[self._id(name)] = asdict(found)
        self._journal.save()
        return found

    def pair(self, name: str, leader: str) -> tuple[float, float]:
        self.pairs += 1
        key = f"{self._id(name)}|{self._id(leader)}"
        index, held = self._asked.get(key, 0), self._journal.pairs.setdefault(key, [])
        self._asked[key] = index + 1
        if index < len(held):
            return held[index][0], held[index][1]
        order = (name, leader) if self.pairs % 2 else (leader, name)
        speeds = {who: self._timed_decode(who) for who in order}
        held.append([speeds[name], speeds[leader]])
        self._journal.save()
        failpoint("search-pair")  # tests: killed with a pair measured and kept
        return speeds[name], speeds[leader]

    def window_nll(self, name: str, split: Split, start: int, stop: int) -> list[float]:
        windows = self._windows[split]
        if stop > len(windows):
            raise ValueError(f"the {split} split has {len(windows)} windows, {stop} asked for")
        done = self._journal.nll.setdefault(f"{self._id(name)}|{split}", [])
        if len(done) < stop:
            done.extend(nll for nll, _ in self.runtime(name).score(windows[len(done) : stop]))
            self._journal.save()
        return done[start:stop]

    def window_tokens(self, split: Split, start: int, stop: int) -> list[int]:
        return [len(window) - 1 for window in self._windows[split][start:stop]]  # tokens predicted

    def _id(self, name: str) -> str:
        return self._identity.get(name, name)

    def _timed_decode(self, name: str) -> float:
        runtime = self.runtime(name)
        if name not in self._warm:
            runtime.generate([self._prompt], self._new_tokens, stop_at_eos=False)
            self._warm.add(name)
        return timed_decode(runtime, self._prompt, self._new_tokens)
