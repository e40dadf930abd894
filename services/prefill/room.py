"""PrefillRoom: what a prefill worker keeps for one request in its room table
(services/worker/rooms.py), and what it remembers of it once done."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.prefill.writes import RoomWrites
from services.worker.rooms import Room, Stage


@dataclass(eq=False)
class PrefillRoom(Room):
    """A prefill room: its KV writes into decode's pages (from the handshake on), and once done,
    the checksums of the writes it issued (`checksums`), which an Abort that comes after the end
    learns: they tell decode what may still be landing."""

    writes: RoomWrites | None = None
    done_checksums: list[int] = field(default_factory=list)

    @property
    def checksums(self) -> list[int]:
        """Of the writes issued so far (a live room) or in all (a done one), in dst_page_ids order."""
        return list(self.writes.checksums) if self.writes is not None else self.done_checksums

    def remembered(self) -> PrefillRoom | None:
        """Remembered when an Abort named it (a later Prefill of it is refused) or it issued writes."""
        checksums = self.checksums
        if not (self.aborted or checksums):
            return None
        return PrefillRoom(self.id, Stage.DONE, aborted=self.aborted, done_checksums=checksums)
