"""Settling an auditor's accusation: every member checks the evidence itself.

When the auditor of shard k says the reducer returned a wrong aggregate, the other members do not
take either side's word. Each of them already holds, first-hand from the reducer over an
authenticated stream, the shard's result and the digests of the parts the reducer committed to.
It asks the auditor for those parts, one message each, checks every part against the reducer's
digest, recomputes the shard (peer/reduce.py) and compares with the result it holds:

- the recomputation disagrees with the result: the reducer cheated; never grouped with again;
- it agrees: the auditor accused falsely; never grouped with again;
- the auditor does not produce parts matching the commitments: it cannot back its claim; the same.

So a detected cheater is excluded by every member that saw the accusation, and a false accuser
excludes itself. It costs each checking member the n parts of one shard (the int8 size of 1/n of
the vector, times n) and one recomputation, only when there is an accusation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging.api import shard_bounds
from hivetrain.peer.averaging.reduce import WRONG_AGGREGATE, audit_shard, digest

logger = logging.getLogger(__name__)
SETTLE_SHARE = 0.5  # of the all-reduce deadline, for fetching and checking one accusation's evidence


class Disputes:
    """Mixin: the attributes below are set by ``P2PAverager.__init__``."""

    me: str
    spec: Any
    numel: int
    codec: Codec
    max_body: int
    _inbox: dict[tuple[int, str, str, int, str], bytes]
    _commits: dict[tuple[int, str, int], list[str]]
    _claims: dict[tuple[int, str, int], list[str]]
    _verdicts: dict[tuple[int, str, int, str], tuple[bool, str, str]]
    _banned: dict[str, str]
    _round_excluded: dict[str, str]
    _evidence: dict[tuple[int, str, int], list[bytes]]  # (round, group, shard) -> the parts behind our accusation

    def _header(self, kind: str, round_: int, base: str, **fields: Any) -> dict[str, Any]:
        raise NotImplementedError

    async def _request(self, peer: str, header: dict[str, Any], body: bytes, round_: int,
                       deadline: float | None = None, max_reply_body: int = 0) -> tuple[dict[str, Any], bytes]:
        raise NotImplementedError

    async def _settle_accusations(self, round_: int, base: str, gh: str, order: tuple[str, ...]) -> None:
        """Checks every "wrong aggregate" verdict of this round on a shard we neither reduced nor audited."""
        n = len(order)
        for k in range(n):
            reducer, auditor = order[k], order[(k + 1) % n]
            ok, _, why = self._verdicts.get((round_, gh, k, auditor), (True, "", ""))
            if ok or not why.startswith(WRONG_AGGREGATE) or self.me == auditor:
                continue
            if self.me == reducer:  # we computed that shard ourselves: the accusation is false
                guilty, reason = auditor, f"accused us falsely of a wrong aggregate in shard {k}"
            else:
                guilty, reason = await self._settle(round_, base, gh, order, k)
            self._banned[guilty] = f"round {round_}: {reason}"
            self._round_excluded[guilty] = reason
            logger.warning("round %d: shard %d dispute settled against %s: %s", round_, k, guilty, reason)

    async def _settle(self, round_: int, base: str, gh: str, order: tuple[str, ...], k: int) -> tuple[str, str]:
        """Returns (the peer found at fault, why) for the accusation against the reducer of shard k."""
        reducer, auditor = order[k], order[(k + 1) % len(order)]
        commits = self._commits.get((round_, gh, k), [])
        if len(commits) != len(order):
            return reducer, f"its result of shard {k} came without a commitment per member"
        deadline = time.monotonic() + SETTLE_SHARE * self.spec.allreduce_timeout
        received: dict[str, bytes] = {}
        invalid: dict[str, str] = {}
        for i, peer in enumerate(order):
            if commits[i] == "":
                invalid[peer] = "no valid part, per the reducer"
                continue
            header = self._header("evidence_req", round_, base, group=gh, shard=k, index=i)
            try:
                reply, body = await self._request(auditor, header, b"", round_, deadline, max_reply_body=self.max_body)
            except Exception as e:
                return auditor, f"accused {reducer} of a wrong aggregate and did not show the parts ({type(e).__name__})"
            if reply.get("type") != "evidence" or not reply.get("ok") or digest(body) != commits[i]:
                return auditor, f"accused {reducer} of a wrong aggregate; its evidence does not match the commitments"
            received[peer] = body
        start, end = shard_bounds(self.numel, len(order))[k]
        result = self._inbox[(round_, gh, "result", k, reducer)]
        why = await asyncio.get_running_loop().run_in_executor(
            None, audit_shard, result, commits, received, invalid, order, end - start, self.codec, self.spec.aggregation,
            self._claims.get((round_, gh, k), []))
        if why is not None and why.startswith(WRONG_AGGREGATE):
            return reducer, f"shard {k}: {why} (checked ourselves on its auditor's evidence)"[:300]
        return auditor, f"accused {reducer} of a wrong aggregate in shard {k}, which we recomputed: {why or 'correct'}"

    def _keep_evidence(self, round_: int, gh: str, order: tuple[str, ...], shard: int) -> None:
        """Keeps our copies of a shard's parts after accusing its reducer (until the round after next),
        so that members can check them even once we have moved on."""
        self._evidence[(round_, gh, shard)] = [self._inbox.get((round_, gh, "part", shard, p), b"") for p in order]

    def _on_evidence(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """Serves our copy of one part of a shard we audited and accused (empty, ok=False otherwise)."""
        round_, gh, shard, index = header["round"], header["group"], header["shard"], header["index"]
        parts = self._evidence.get((round_, gh, shard), [])
        body = parts[index] if index < len(parts) else b""
        return (self._header("evidence", round_, header["base"], group=gh, shard=shard, index=index, ok=bool(body)),
                body)
