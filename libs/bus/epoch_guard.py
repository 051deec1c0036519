"""The epoch guard (C2): refuse stale or mismatched generations where they arrive."""

from __future__ import annotations

from collections.abc import Iterable

from libs.contracts.errors import ErrorCode, NodusError


class EpochGuard:
    """Knows each gang's current (persisted) epoch and judges epoch-scoped messages by it."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}

    def advance(self, gang: str, epoch: int) -> None:
        """Record a persisted epoch; never moves backwards."""
        if epoch > self._current.get(gang, 0):
            self._current[gang] = epoch

    def forget(self, gang: str) -> None:
        self._current.pop(gang, None)

    def current(self, gang: str) -> int | None:
        return self._current.get(gang)

    def check(self, gang: str, epoch: int) -> None:
        """Raise unless `epoch` is the gang's current one."""
        current = self._current.get(gang)
        if current is None:
            raise NodusError(
                ErrorCode.EPOCH_MISMATCH,
                f"gang {gang} has no persisted epoch; refusing epoch {epoch}",
            )
        if epoch < current:
            raise NodusError(
                ErrorCode.STALE_EPOCH,
                f"gang {gang}: message from epoch {epoch} refused, the gang is on epoch {current}",
            )
        if epoch > current:
            raise NodusError(
                ErrorCode.EPOCH_MISMATCH,
                f"gang {gang}: epoch {epoch} is not persisted yet (current {current})",
            )


def check_plan_generations(gang: str, generations: Iterable[tuple[str, int]]) -> int:
    """A plan whose parts name different epochs is refused before anything starts (C2)."""
    seen = {(part, epoch) for part, epoch in generations}
    epochs = {epoch for _, epoch in seen}
    if len(epochs) != 1:
        detail = ", ".join(f"{part}={epoch}" for part, epoch in sorted(seen))
        raise NodusError(
            ErrorCode.EPOCH_MISMATCH, f"gang {gang}: plan generations disagree: {detail}"
        )
    return epochs.pop()
