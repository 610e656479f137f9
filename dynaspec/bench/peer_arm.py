"""What every peer arm (bench/peers.py, bench/peer_vllm.py) shares: the error that says a peer
cannot run here, the arm's model, and the empty record a run fills."""

from __future__ import annotations

from dynaspec.bench.compare import RunRecord


class PeerUnavailable(RuntimeError):
    """This peer cannot run here; the message says why and what would fix it."""


def model_path(opts: dict) -> tuple[str, str]:
    """(path, kind) of an arm's ``model=``; a model that cannot be found makes the peer
    unavailable rather than the comparison fail."""
    from dynaspec.models.loader import resolve_model_path
    try:
        return resolve_model_path(opts.get("model", "default"))
    except ValueError as exc:
        raise PeerUnavailable(str(exc)) from None


def new_record(tag: str) -> RunRecord:
    """An empty record for one run of a peer arm (its arm named by the tag's first part)."""
    return RunRecord(tag.split("-")[0], -1, 0, 0.0)
