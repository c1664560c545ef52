"""Settling an auditor's accusation: every member checks the evidence itself.

When the auditor of shard k says the reducer returned a wrong aggregate, the other members take
neither side's word. Each already holds, first-hand and signed by the reducer, the shard's result
and the digests of the parts the reducer committed to. It asks the auditor for those parts, one
message each, checks every part against the reducer's digest, recomputes the shard
(peer/averaging/reduce.py) and compares with the result it holds:

- the recomputation disagrees with the result: the reducer cheated;
- it agrees: the auditor accused falsely;
- the auditor does not produce parts matching the commitments: it cannot back its claim;
- the auditor cannot be reached, or says it holds no evidence: a strike, not a ban (an honest
  auditor that crashed after its verdict does exactly that: search seed 3,000,501 banned one); a
  strike in a later round bans it (``Bans.strike``), so a liar that hides from every check lies once.

Only if the verdict names the result we hold: an auditor that judged another result (the reducer
sent it a different one, or it names one it never got) is not judged here on our copy, which would
clear a reducer that signed two results and ban its honest auditor. The agreement after the round
(peer/averaging/agreement.py) settles that case on signatures: the reducer if the auditor holds a
second result the reducer signed, the auditor if it signed a verdict on a result it does not hold;
and the round is void either way (``_gather``: our result is not the one its auditor checked).

Whoever is at fault is banned by every member that saw the accusation. It costs each checking
member the n parts of one shard and one recomputation, only when there is an accusation.
"""

from __future__ import annotations

import asyncio
import logging

from hivetrain.dht import clock
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.reduce import FindingKind, ShardInputs, audit_shard, digest
from hivetrain.peer.averaging.session import RoundSession
from hivetrain.peer.net.link import request
from hivetrain.peer.net.wire import reason

logger = logging.getLogger(__name__)
SETTLE_SHARE = 0.5  # of the all-reduce deadline, for fetching and checking one accusation's evidence
WRONG_AGGREGATE = 1  # Verdict.finding of a wrong-aggregate accusation (allreduce.FINDING_CODES)


async def settle_accusations(ctx: PeerContext, s: RoundSession) -> dict[str, str]:
    """Checks every "wrong aggregate" verdict of the round on a shard we did not audit; returns
    {peer found at fault: why}."""
    guilty: dict[str, str] = {}
    for k, shard in enumerate(s.shards):
        auditor = s.auditor(k)
        verdict = shard.verdict
        if verdict is None or verdict.ok or verdict.finding != WRONG_AGGREGATE or auditor in (None, ctx.me):
            continue
        if verdict.result_hash != shard.result_hash:  # it judged another result than ours: the agreement settles it
            continue
        if ctx.me == s.reducer(k):  # we computed that shard ourselves: the accusation is false
            guilty[auditor] = f"accused us falsely of a wrong aggregate in shard {k}"
            continue
        peer, why, certain = await _settle(ctx, s, k)
        if certain or ctx.bans.strike(peer, why, s.round):
            guilty[peer] = why
        else:
            logger.warning("round %d: %s; a first strike, not a ban (it may have crashed)", s.round, why)
    return guilty


async def _settle(ctx: PeerContext, s: RoundSession, k: int) -> tuple[str, str, bool]:
    """(the peer at fault, why, certain) for the accusation against the reducer of shard k: not
    certain when the auditor could not be reached or holds no evidence (module doc)."""
    reducer, auditor = s.reducer(k), s.auditor(k)
    assert auditor is not None
    shard = s.shards[k]
    assert shard.result is not None
    deadline = clock.now() + SETTLE_SHARE * ctx.spec.allreduce_timeout
    received: dict[str, bytes] = {}
    invalid: dict[str, str] = {}
    for i, peer in enumerate(s.order):
        if shard.commits[i] == "":
            invalid[peer] = "no valid part, per the reducer"
            continue
        header = ctx.header("evidence_req", s.round, s.base, group=s.group, shard=k, index=i)
        try:
            reply, body = await request(ctx.link, auditor, ctx.protocol, header, b"",
                                        max(0.1, deadline - clock.now()), max_reply_body=s.shard_nbytes(k),
                                        traffic=ctx.traffic)
        except Exception as e:
            return auditor, f"accused {reducer} of a wrong aggregate and did not show the parts ({type(e).__name__})", False
        if reply.get("type") != "evidence" or not reply.get("ok"):
            return auditor, f"accused {reducer} of a wrong aggregate and holds no evidence of it", False
        if digest(body) != shard.commits[i]:
            return auditor, f"accused {reducer} of a wrong aggregate; its evidence does not match the commitments", True
        received[peer] = body
    start, end = s.bounds[k]
    inputs = ShardInputs(received, invalid, s.order, end - start, ctx.codec, ctx.spec.aggregation)
    finding = await asyncio.to_thread(audit_shard, shard.result, shard.commits, inputs, shard.claims)
    if finding is not None and finding.kind is FindingKind.WRONG_AGGREGATE:
        return reducer, reason(f"shard {k}: {finding.reason} (checked ourselves on its auditor's evidence)"), True
    what = "correct" if finding is None else finding.reason
    return auditor, reason(f"accused {reducer} of a wrong aggregate in shard {k}, which we recomputed: {what}"), True

