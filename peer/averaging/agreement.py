"""After the round: what a member holds, signed, about every shard, and who signed two different
things. Pure: the runner (peer/averaging/allreduce.py) does the sending."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from hivetrain.peer.averaging.session import RoundSession
from hivetrain.peer.averaging.statements import (
    APPROVED,
    NO_AUDIT,
    REJECTED,
    Statement,
    commitment,
    result_message,
    valid,
    verdict_message,
)


def held_statements(s: RoundSession) -> list[Statement]:
    """Per shard: the reducer's signed result and the auditor's signed verdict, as we received them
    (our own where the role is ours)."""
    out = []
    for shard in s.shards:
        verdict = shard.verdict
        state = NO_AUDIT if verdict is None else APPROVED if verdict.ok else REJECTED
        out.append(Statement(
            bytes.fromhex(shard.result_hash), commitment(shard.commits, shard.claims, shard.excluded),
            shard.result_sig, state, bytes.fromhex(verdict.result_hash) if verdict else bytes(32),
            verdict.sig if verdict else bytes(64)))
    return out


def equivocators(s: RoundSession, member: str, ours: Sequence[Statement],
                 theirs: Sequence[Statement]) -> Iterator[tuple[str, str]]:
    """(culprit, why) for every statement ``member`` holds that differs from ours: the reducer or
    auditor that signed both, or ``member`` itself if the one it forwarded was never signed."""
    for k, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        if t.result_sig != bytes(64) and (t.result_hash, t.commit) != (o.result_hash, o.commit):
            if valid(s.reducer(k), t.result_sig, result_message(s.where(k), t.result_hash, t.commit)):
                yield s.reducer(k), f"signed two different results of shard {k} (equivocation)"
            else:
                yield member, f"forwarded a result of shard {k} its reducer never signed"
        auditor = s.auditor(k)
        if auditor is not None and t.verdict != NO_AUDIT and (t.verdict, t.verdict_hash) != (o.verdict, o.verdict_hash):
            if valid(auditor, t.verdict_sig, verdict_message(s.where(k), t.verdict == APPROVED, t.verdict_hash)):
                yield auditor, f"signed two different verdicts on shard {k} (equivocation)"
            else:
                yield member, f"forwarded a verdict on shard {k} its auditor never signed"
        elif (member == auditor and t.verdict != NO_AUDIT and t.verdict_hash != t.result_hash
              and valid(auditor, t.verdict_sig, verdict_message(s.where(k), t.verdict == APPROVED, t.verdict_hash))):
            # an auditor judges the result it holds: its own statements show it judged another one
            yield auditor, f"signed a verdict on shard {k} about a result it does not hold"
