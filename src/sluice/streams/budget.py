"""The event logs' memory budget: what every stream's log holds, per tenant and in all, and
what to evict or trim when a bound is reached.

Bounds (:class:`~sluice.streams.hub.HubSettings`):

- ``log_budget_bytes``: all logs on this server, live and retained;
- ``max_log_bytes_per_tenant``: one tenant's logs, live and retained, so one tenant cannot
  take the whole budget from the others;
- ``max_retained_per_tenant``: finished streams one tenant keeps readable.

Bytes are what the log reports (:meth:`EventLog.num_bytes`, the estimate of
:mod:`sluice.streams.sizing`); the hub reports each stream's after every append.

**Eviction order.** A finished (retained) stream is the only thing ever evicted, and the
oldest goes first: for a stream or a creation that needs room, the retained streams of its
own tenant, oldest first; then, if the server-wide budget still needs room, every tenant's
retained streams, oldest first. A tenant over ``max_retained_per_tenant`` loses its oldest
retained stream; a creation on a server that holds ``max_streams`` streams evicts one
(:meth:`LogBudget.oldest`: its tenant's oldest, else the oldest of all). An evicted stream
is gone as if its retention had ended.

**Live streams** are never evicted. A creation is refused (:meth:`LogBudget.refusal`)
when, even with every stream it may evict gone, live streams would fill a bound: hold
more than nine tenths of it (the last tenth is theirs to grow into). A live stream that
appends while a bound is still exceeded is trimmed (:meth:`LogBudget.trim_target`): it
gives up its oldest records, at least what it is over by and, if it holds more than its
share (the bound over the live streams under it), down to that share, so a stream cannot
grow while the server is full, and a large one makes room for the others.

Pure Python, no I/O: each call is O(1) (ordered dicts of retained streams, counters per
tenant), so nothing scans the streams on an append.
"""

from __future__ import annotations

from collections import OrderedDict

from sluice.streams.sizing import LOG_BYTES

__all__ = ["LOG_MEMORY", "TENANT_LOG_BYTES", "LogBudget", "full_mark"]

# Eviction and refusal reasons (metric labels).
LOG_MEMORY = "log_memory"
TENANT_LOG_BYTES = "tenant_log_bytes"
TENANT_RETAINED = "tenant_retained_streams"


class _Entry:
    __slots__ = ("num_bytes", "retained", "tenant")

    def __init__(self, tenant: str, num_bytes: int) -> None:
        self.tenant = tenant
        self.num_bytes = num_bytes
        self.retained = False


class _Tenant:
    __slots__ = ("num_bytes", "num_live", "retained", "retained_bytes")

    def __init__(self) -> None:
        self.num_bytes = 0
        self.num_live = 0
        self.retained_bytes = 0
        # This tenant's retained streams, oldest first (values unused).
        self.retained: OrderedDict[str, None] = OrderedDict()


class LogBudget:
    """Bytes and counts of every stream the hub holds, and the eviction order."""

    def __init__(
        self, *, budget_bytes: int, max_bytes_per_tenant: int, max_retained_per_tenant: int
    ) -> None:
        self.budget_bytes = budget_bytes
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self.max_retained_per_tenant = max_retained_per_tenant
        self.num_bytes = 0  # all logs
        self.num_live = 0
        self.retained_bytes = 0
        self.num_trims = 0
        self.evictions: dict[str, int] = {}  # by reason
        self._entries: dict[str, _Entry] = {}
        self._tenants: dict[str, _Tenant] = {}
        self._retained: OrderedDict[str, None] = OrderedDict()  # every tenant's, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    def num_live_of(self, tenant: str) -> int:
        record = self._tenants.get(tenant)
        return 0 if record is None else record.num_live

    def bytes_of(self, tenant: str) -> int:
        record = self._tenants.get(tenant)
        return 0 if record is None else record.num_bytes

    def retained_of(self, tenant: str) -> int:
        record = self._tenants.get(tenant)
        return 0 if record is None else len(record.retained)

    # ------------------------------------------------------------------ admission

    def refusal(self, tenant: str) -> str | None:
        """Why a new stream of ``tenant`` cannot get room even if every stream it may evict
        were evicted (``log_memory``, else ``tenant_log_bytes``), or ``None``."""
        if self.num_bytes - self.retained_bytes + LOG_BYTES > full_mark(self.budget_bytes):
            return LOG_MEMORY  # first: with one tenant, its bytes are the server's
        record = self._tenants.get(tenant)
        if record is not None and (
            record.num_bytes - record.retained_bytes + LOG_BYTES
            > full_mark(self.max_bytes_per_tenant)
        ):
            return TENANT_LOG_BYTES
        return None

    def victim(self, tenant: str, extra_bytes: int = 0) -> tuple[str, str] | None:
        """The retained stream to evict next so that ``extra_bytes`` more of ``tenant`` fit,
        with the reason; ``None`` when nothing needs room or nothing can be evicted."""
        record = self._tenants.get(tenant)
        own = record.retained if record is not None else None
        if self.num_bytes + extra_bytes > self.budget_bytes:
            if own:
                return next(iter(own)), LOG_MEMORY
            if self._retained:
                return next(iter(self._retained)), LOG_MEMORY
        if (
            own
            and record is not None
            and (record.num_bytes + extra_bytes > self.max_bytes_per_tenant)
        ):
            return next(iter(own)), TENANT_LOG_BYTES
        return None  # nothing needs room, or only live streams could give it

    def oldest(self, tenant: str) -> str | None:
        """The retained stream a creation of ``tenant`` evicts when the server holds its
        maximum of streams: its own oldest, else the oldest of all."""
        record = self._tenants.get(tenant)
        if record is not None and record.retained:
            return next(iter(record.retained))
        return next(iter(self._retained), None)

    def trim_target(self, stream_id: str) -> int | None:
        """What the live stream's log must shrink to, when a bound is exceeded and nothing
        is left to evict for it; ``None`` when it may keep what it holds."""
        entry = self._entries[stream_id]
        record = self._tenants[entry.tenant]
        target: int | None = None
        over = record.num_bytes - self.max_bytes_per_tenant
        if over > 0:
            share = self.max_bytes_per_tenant // max(1, record.num_live)
            target = _cut(entry.num_bytes, over, share)
        over = self.num_bytes - self.budget_bytes
        if over > 0:
            cut = _cut(entry.num_bytes, over, self.budget_bytes // max(1, self.num_live))
            target = cut if target is None else min(target, cut)
        return target

    # ------------------------------------------------------------------ stream lifecycle

    def opened(self, stream_id: str, tenant: str, num_bytes: int) -> None:
        """A live stream of ``tenant`` exists, its log holding ``num_bytes``."""
        if stream_id in self._entries:
            raise ValueError(f"stream {stream_id!r} is already accounted for")
        record = self._tenants.get(tenant)
        if record is None:
            record = self._tenants[tenant] = _Tenant()
        self._entries[stream_id] = _Entry(tenant, num_bytes)
        record.num_bytes += num_bytes
        record.num_live += 1
        self.num_bytes += num_bytes
        self.num_live += 1

    def resized(self, stream_id: str, num_bytes: int) -> bool:
        """The stream's log holds ``num_bytes`` now; True when a bound is exceeded."""
        entry = self._entries[stream_id]
        grown = num_bytes - entry.num_bytes
        entry.num_bytes = num_bytes
        record = self._tenants[entry.tenant]
        record.num_bytes += grown
        self.num_bytes += grown
        if entry.retained:  # only trims and deletes change a finished stream's log
            record.retained_bytes += grown
            self.retained_bytes += grown
        return self.num_bytes > self.budget_bytes or record.num_bytes > self.max_bytes_per_tenant

    def retain(self, stream_id: str) -> list[tuple[str, str]]:
        """The stream finished: it is retained, and evictable. Returns what its tenant must
        evict now to stay within ``max_retained_per_tenant`` (oldest first)."""
        entry = self._entries[stream_id]
        if entry.retained:
            return []
        entry.retained = True
        record = self._tenants[entry.tenant]
        record.num_live -= 1
        self.num_live -= 1
        record.retained[stream_id] = None
        self._retained[stream_id] = None
        record.retained_bytes += entry.num_bytes
        self.retained_bytes += entry.num_bytes
        over = len(record.retained) - self.max_retained_per_tenant
        if over <= 0:
            return []
        oldest = iter(record.retained)
        return [(next(oldest), TENANT_RETAINED) for _ in range(over)]

    def forget(self, stream_id: str, evicted_for: str | None = None) -> None:
        """The stream is gone: its retention ended, or it was evicted (``evicted_for`` names
        why, for the counts in :attr:`evictions`). Unknown ids are ignored."""
        entry = self._entries.pop(stream_id, None)
        if entry is None:
            return
        record = self._tenants[entry.tenant]
        record.num_bytes -= entry.num_bytes
        self.num_bytes -= entry.num_bytes
        if entry.retained:
            del record.retained[stream_id]
            del self._retained[stream_id]
            record.retained_bytes -= entry.num_bytes
            self.retained_bytes -= entry.num_bytes
        else:
            record.num_live -= 1
            self.num_live -= 1
        if not record.num_live and not record.retained:
            del self._tenants[entry.tenant]
        if evicted_for is not None:
            self.evictions[evicted_for] = self.evictions.get(evicted_for, 0) + 1

    def clear(self) -> None:
        """Forget every stream (the hub stopped); the counts of evictions stay."""
        self._entries.clear()
        self._tenants.clear()
        self._retained.clear()
        self.num_bytes = self.num_live = self.retained_bytes = 0


def full_mark(bound: int) -> int:
    """Where live streams fill ``bound``: its last tenth is kept for them to grow into (a
    trim takes a tenth more than needed, so a full bound hovers in its last tenth)."""
    return bound - bound // 10


def _cut(held: int, over: int, share: int) -> int:
    """What a stream holding ``held`` keeps when its bound is ``over`` by that much: at
    least ``over`` less, at most ``share`` when it holds more, and a tenth less again so
    that the next trim waits for it to grow by a tenth (trimming stays amortised O(1))."""
    target = held - over
    if held > share:
        target = min(target, share)
    return max(0, target - target // 10)
