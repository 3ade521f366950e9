"""Coordinator election on etcd, and the fenced writes of the elected coordinator."""

from __future__ import annotations

from collections.abc import Sequence

from lumend.cluster.keys import Keys
from lumend.cluster.models import CoordinatorRecord, encode_value
from lumend.cluster.store import CreateRevisionIs, Delete, Op, Put, Store


class Election:
    """Campaign, fenced writes and resignation for one node.

    The fencing rule, enforced by the transactions below and nowhere else:
      * campaign: create the coordinator key only if it does not exist
        (create_revision == 0), attached to the node's lease;
      * the key's create revision is the coordinator's epoch; it grows with every new
        term because etcd revisions only grow;
      * every write the coordinator makes is a transaction whose compare is
        create_revision(coordinator) == epoch, so a deposed coordinator (its lease expired,
        the key deleted and re-created by another node) cannot write anything, however late
        its request arrives;
      * resign deletes the key under the same compare.
    """

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._key = keys.coordinator

    async def campaign(self, record: CoordinatorRecord, lease: int) -> int | None:
        """Try to become coordinator; returns the epoch won, or None if another node holds it."""
        result = await self._store.txn(
            [CreateRevisionIs(self._key, 0)],
            [Put(self._key, encode_value(record), lease)],
            read_on_failure=[self._key],
        )
        if result.succeeded:
            return result.revision
        existing = result.read.get(self._key)
        if existing is not None and existing.lease == lease:
            # Our own earlier attempt went through but its answer was lost (a retry).
            return existing.create_revision
        return None

    async def guarded(self, epoch: int, ops: Sequence[Op]) -> bool:
        """Apply `ops` only while `epoch` is still the current term."""
        result = await self._store.txn([CreateRevisionIs(self._key, epoch)], ops)
        return result.succeeded

    async def resign(self, epoch: int, also: Sequence[Op] = ()) -> bool:
        return await self.guarded(epoch, [Delete(self._key), *also])

