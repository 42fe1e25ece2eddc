"""The ids of consumed and dropped prompt groups, in memory that stays flat over a long run."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSet


class ConsumedIds(MutableSet):
    """A set of group ids kept as `floor` (every id below it is a member) plus the members above it.

    The trainer's consumed set (TRL reads it with `in` and `len` only). A run of a million groups would otherwise
    hold a million ints; RolloutProgress.fold moves the settled prefix into `floor`.
    """

    def __init__(self, ids: Iterable[int] = ()):
        self.floor = 0
        self.above: set[int] = set()
        self.update(ids)

    def __contains__(self, group_id: object) -> bool:
        return (isinstance(group_id, int) and 0 <= group_id < self.floor) or group_id in self.above

    def __len__(self) -> int:
        return self.floor + len(self.above)

    def __iter__(self) -> Iterator[int]:
        yield from range(self.floor)
        yield from self.above

    def __repr__(self) -> str:
        return f"ConsumedIds(floor={self.floor}, above={sorted(self.above)})"

    def add(self, group_id: int) -> None:
        if group_id >= self.floor:
            self.above.add(group_id)

    def update(self, ids: Iterable[int]) -> None:
        for group_id in ids:
            self.add(group_id)

    def discard(self, group_id: int) -> None:
        if group_id < self.floor:  # unfold (rare: a discarded accumulation window)
            self.above.update(range(group_id + 1, self.floor))
            self.floor = group_id
        else:
            self.above.discard(group_id)

    def clear(self) -> None:
        self.floor = 0
        self.above.clear()

    def fold(self, limit: int) -> None:
        while self.floor < limit and self.floor in self.above:
            self.above.remove(self.floor)
            self.floor += 1

    def count_below(self, limit: int) -> int:
        return min(self.floor, limit) + sum(1 for group_id in self.above if group_id < limit)


class DropRuns:
    """Maximal runs of consecutive dropped group ids, each kept by its two ends: a drop joins its neighbours in O(1).

    A streak open before a resume is a run ending at id -1 (`prefix` ids long), so a resumed run continues it
    exactly. Walking the whole streak on every drop made one pass of 100,000 dropped groups take 234 s.
    """

    def __init__(self, prefix: int = 0):
        self.end_of: dict[int, int] = {}  # run start -> run end
        self.start_of: dict[int, int] = {}  # run end -> run start
        if prefix > 0:
            self.end_of[-prefix], self.start_of[-1] = -1, -prefix

    def join(self, group_id: int) -> tuple[int, int]:
        """Add a dropped id; returns its run (low, high)."""
        low = self.start_of.pop(group_id - 1, group_id)
        if low != group_id:
            del self.end_of[low]
        high = self.end_of.pop(group_id + 1, group_id)
        if high != group_id:
            del self.start_of[high]
        self.end_of[low], self.start_of[high] = high, low
        return low, high

    def run_of(self, group_id: int) -> tuple[int, int]:
        """The run holding a dropped id; walks to its end (only after a drop was undone, which is rare)."""
        high = group_id
        while high not in self.start_of:
            high += 1
        return self.start_of[high], high

    def leave(self, group_id: int) -> None:
        """Remove a dropped id that trained after all."""
        low, high = self.run_of(group_id)
        del self.start_of[high], self.end_of[low]
        for piece_low, piece_high in ((low, group_id - 1), (group_id + 1, high)):
            if piece_low <= piece_high:
                self.end_of[piece_low], self.start_of[piece_high] = piece_high, piece_low

    def length_ending_at(self, group_id: int) -> int:
        low = self.start_of.get(group_id)
        return 0 if low is None else group_id - low + 1

    def forget(self, start: int, stop: int) -> None:
        """Drop the runs that end in [start, stop): settled, they can neither grow nor shrink."""
        for end in range(start, stop):
            low = self.start_of.pop(end, None)
            if low is not None:
                del self.end_of[low]
