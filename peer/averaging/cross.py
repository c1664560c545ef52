"""The cross-group stage: one state per round for the whole run, however many groups it has.

Groups reduce their members' parts as before (robust, audited). With ``spec.cross_groups`` every
round's vector is cut into the same U shards in every group (``units``: a full group's layout,
dealt among any group's reducers by their claims), and shard k is cut again into S sub-pieces
(``Plan.subs``). Each sub-piece (k, j) has a *designee*: the peer that averages it across groups.

Designees are derived, never chosen: every peer reads the round's ready board once it has settled
(``read_plan``). The round's *anchor* is the k-th earliest ready record at our base, k = a third of
the bucket's expected peers + 1 (``anchor_rank``: from the base state's population, the same for
every peer at it; in round 0, whose population nobody knows, ``expected_peers`` or else the
target group size): identities that publish their ready records before anyone trained (or claim
any earlier time) are fewer than k, so they set neither the round's clock nor its designees. The
peers ready at our base within DESIGNATE_WINDOW seconds of the anchor, either side, that can be
dialed, are the round's
designees; the designee of (k, j) is the first of them
by weighted rendezvous hashing of (round, base, k, j) (weights: their uplink claims, so a slow peer
is designated less), the second and third take over when it cannot be reached. S is chosen so that
the U x S sub-pieces are about as many as the designees: each designee averages about one, and a
designee's cost is about one vector's bytes in and out, whatever the run's size.

1. The reducer of shard k in each group, once its auditor approved the result (or rejected it:
   then the group's weight is 0), sends each sub-piece of its result with the group's members and
   weight (members whose parts it used) to the sub-piece's designee (a ``cross`` request), and
   the members' own signatures of the parts they sent it (``vouch``): the designee counts in the
   weight only members that vouched, that it saw ready on its board, each in one group. At level
   0 it sends the same to a second designee, the designee's *witness* (the first two of the
   sub-piece's ranked designees that take it: the pair), and tells both which is the witness.
2. The designee (``Desk``) waits until the groups it received cover every peer in the round: ready
   at our base by the round's *cutoff* (the anchor + ``matchmaking_timeout``, the
   grace any straggler gets), less the peers whose round failed (they publish their ready record
   again with ``out`` and their group: a peer two of them name is out too). It waits at most
   LONG_WAIT x ``allreduce_timeout`` past the first arrival (a group that died), then computes the
   weighted mean of the groups' sub-pieces in a fixed order (by group hash; with robust aggregation
   the weighted robust mean, aggregation.py: a group without an honest majority pulls it a bounded
   way) and encodes it once:
   one set of bytes, signed, sent back to every reducer that sent it (``cross_out``). A group that
   arrives later gets that mean, without its values, like a late bucket (``_late``): one state, its
   work lost for that sub-piece; so does one that comes to the witness once it countersigned (a
   designee asked only as witness held no mean of its own, and averaged a late group alone: search
   seed 6,100,708, a joiner grouped with two late attackers, 1.2e3 x the honest deviation).
   At level 0 the designee first sends its mean to the witness with the groups and the weights
   it used (``cross_check``); the witness, which holds the same groups' sub-pieces and the other
   members' words on them, checks that it could have given each weight, recomputes the mean and
   signs the same statement (``check``), or refuses. It also measures the mean against its own
   mean of the groups it holds (``_far``): two honest designees see the round a little differently
   (their boards, bans and newcomer brakes), but a mean further than CHOICE_SPREAD x the groups'
   spread from ours left the round's groups out (a designee that named only a group of one it
   made up of itself was the mean), and it signs no mean in which groups whose every vouched member
   it caught breaking the protocol hold a third of the weight or more (where the robust mean does
   not bound them). A mean counts only with both signatures: a designee that
   writes what it averages (the update reversed, within MEAN_BOUND), or chooses whom it averages,
   is refused by an honest witness, and its sub-piece's groups ask the next pair; two colluding
   designees drawn as one pair are the residue.
3. In a round of at most PROOF_GROUPS full groups (``proves``), a reducer first asks the designee
   that signed a mean for its proof (``prove``): every group it held, with its reducer's signature
   of the values (``sub_message``: reducers sign what they send, attesters their word), the
   members' vouches and the weight each counted with. It recomputes the mean (``proven``) and
   refuses one the groups' own values do not give: a designee and a witness that collude (both
   drawn by chance, about (f/d)^2 of sub-pieces) can then choose which groups count, up to what their
   words allow, but write no values. A larger round keeps the witness alone (G x a sub-piece's
   bytes per reducer would grow with the run). A member whose reducer also signed the mean it
   forwards (as its designee or witness) checks the proof itself: that reducer's check is worth
   nothing to it.
   Each reducer then forwards the signed sub-pieces of its shards to its members. Every member checks the
   signatures against the designees it derived itself and applies exactly those bytes, so every
   peer that completes the round holds the same state. A member that misses one voids the round
   (and re-syncs at the next boundary, like any void round); a sub-piece no group contributed to is
   void everywhere (its values and momentum keep their values).

With buckets (level > 0, ready.py) the stage has two tiers, so that a peer reads two buckets of the
board, not all of them (``read_plan``): the designees above are drawn per bucket from its own early
peers and average its groups (steps 1-2, unsigned); each sends its bucket's mean and weight up to
the sub-piece's designee in the round's top bucket (``top_bucket``, drawn from the base), which
waits for every bucket with a peer in the round, signs the mean of the buckets' means and sends it
back; the bucket's designee passes it on to its reducers (step 3: members check the top's
signature). A bucket whose mean comes after the top's was computed (its designee was replaced)
gets the top's mean without its values: one state, its work lost for that sub-piece.

Every reducer and member bounds a designee's mean before applying it (``off``, ``MEAN_BOUND``):
one past the bound is refused (the reducer asks the next designee, a member voids).

Known limits (SECURITY.md): with buckets (level > 0) the means are bounded, not witnessed, a
group's bytes are its
reducer's (checked by one other member), and an attacker that stores a backdated ready record late can
make honest peers derive different designees (their rounds then fork; fork choice resolves it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from hivetrain.dht import clock
from hivetrain.dht.records import bucket_of
from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging import rates
from hivetrain.peer.averaging.aggregation import weighted_median, weighted_robust_mean
from hivetrain.peer.averaging.api import pieces_per_member, shard_bounds
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.delivery import RETRY_PAUSE, deliver, send_all
from hivetrain.peer.averaging.ready import Ready, ReadyBoard
from hivetrain.peer.averaging.statements import Where, part_message, valid
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.link import request
from hivetrain.peer.net.wire import MAX_GROUP, MAX_PIECES, VOUCH_LEN, ZERO, Code

logger = logging.getLogger(__name__)
DESIGNATE_WINDOW = 1.0  # s either side of the anchor: peers ready then are the round's designees ...
SETTLE = 1.0  # s more before the designees are read (a record stored by then is on every reader's board)
# (each at most a quarter of the run's matchmaking_timeout: ``windows``)
MAX_SUBS = 64  # sub-pieces per shard
MIN_SUB_VALUES = 1024  # values per sub-piece, at least (below, the messages cost more than they carry)
RANKS = 4  # designees per sub-piece: the first two (the designee and its witness), and who takes over when one cannot be reached
MAX_DESIGNEES = 4096  # ready records a plan reads
MAX_CROSS_GROUPS = 256  # group results one sub-piece takes (one per group)
MAX_EARLY_WORDS = 2 * MAX_CROSS_GROUPS  # words held per sub-piece before their groups' sub-pieces arrive
POLL = 0.5  # s between board reads while a designee waits for groups
LONG_WAIT = 0.25  # x allreduce_timeout past a sub-piece's first group: the most its designee waits for the others
DESIGNEE_MARGIN = 3.0  # s past a designee's own wait for groups before the next designee is asked
MEAN_BOUND = 2.0  # ``off``: a mean further than this from our own pseudo-gradient is refused (see there)
_CROSS = b"hivetrain-cross-v1\0"
VOID = "0" * 64  # the result hash of a sub-piece no group contributed to
MAX_VOUCH_MEMO = 4096  # (group, shard, vouch) whose checked members a desk keeps
CHOICE_SPREAD = 2.0  # x the groups' spread: how far a designee's mean may lie from its witness's own (``_far``;
# 1.0 refused honest means whose designee and witness had banned differently)
WITNESS_SLACK = 64  # a witness's mean may differ from the designee's by one int8 step in one value in this many
ETA_SKEW = 5.0  # s: a ready record claiming to have been ready later than this past our clock is not read
CAUGHT_SHARE = 3  # a witness refuses a mean where groups of peers it caught hold 1/CAUGHT_SHARE of the weight or more
PROOF_GROUPS = 4  # a round whose board holds at most this many full groups' peers: every reducer checks its means (``proven``)
MAX_PROOF = 32  # groups one proof carries (a designee that held more sends none: its reducers ask the next pair)
PROOF_SERVED = 2  # times one peer is sent the proof of one mean (each holds every group's sub-piece)
_SUB = b"hivetrain-sub-v1\0"


def vouch(members: Sequence[str], words: dict[str, tuple[str, bytes]]) -> bytes:
    """A group's ``vouch`` field: for each member, in ``members`` order, the digest of its part of the
    shard and its signature of it (``statements.part_message``), or zeros where we hold none."""
    out = bytearray(VOUCH_LEN * len(members))
    for i, m in enumerate(members):
        word = words.get(m)
        if word is not None:
            out[i * VOUCH_LEN:(i + 1) * VOUCH_LEN] = bytes.fromhex(word[0]) + word[1]
    return bytes(out)


def vouched(run: str, round_: int, group: str, k: int, members: Sequence[str], blob: bytes) -> frozenset[str]:
    """The members whose own signature in ``blob`` says they sent a part of shard ``k`` to ``group``:
    the only ones a designee counts in the group's weight, and the only ones whose groups it counts
    as arrived. (A group's weight was its own claim, at most its size: two identities naming 64
    ready peers as their group outweighed every honest group of a small run.)"""
    if len(blob) != VOUCH_LEN * len(members):
        return frozenset()
    where = Where(run, round_, group, k)
    out = set()
    for i, m in enumerate(members):
        word = blob[i * VOUCH_LEN:(i + 1) * VOUCH_LEN]
        if any(word) and valid(m, word[16:], part_message(where, word[:16].hex())):
            out.add(m)
    return frozenset(out)


def off(mean: torch.Tensor, own: torch.Tensor, group: torch.Tensor | None = None) -> float:
    """How far a designee's mean of a sub-piece lies from our own pseudo-gradient there, in norms:
    ||mean - own|| / max(||own||, ||group||), ``group`` being our group's audited values of it
    (when we have them; a zero pseudo-gradient of ours is then not a zero scale). NaN is inf.

    A designee's mean is not audited (nobody else holds every group's sub-piece), so every reducer
    and member bounds it before applying it: an average of honest groups lies within about one
    scale of any honest member's own values (its noise and the mean's; measured in the simulator's
    and real runs, docs/BENCHMARKS.md), and the weighted robust mean clips every group to the median
    norm. A mean past MEAN_BOUND is refused: the reducer asks the sub-piece's next designee (and
    at last applies its group's own values), a member voids. What a lying designee can still do is
    bounded: a shift of at most MEAN_BOUND norms (SECURITY.md)."""
    scale = float(torch.linalg.vector_norm(own))
    if group is not None:
        scale = max(scale, float(torch.linalg.vector_norm(group)))
    dist = float(torch.linalg.vector_norm(mean - own))
    if not math.isfinite(dist):
        return math.inf
    if scale == 0.0:
        return 0.0 if dist == 0.0 else math.inf
    return dist / scale


def groups_spread(rows: Sequence[torch.Tensor], weights: Sequence[float]) -> float:
    """How far groups' sub-pieces (``rows``, with ``weights``) lie apart, for a witness's check of a
    designee's choice (``Desk._far``): the smaller of two weighted medians, of each row's distance
    to their weighted robust mean (a row far off with less than half the weight moves that mean a
    bounded way) and of each row's distance to its nearest other (a row far off is nobody's nearest;
    one made up to copy another can only shrink that distance). One row, or one with most of the
    weight: 0."""
    if len(rows) < 2:
        return 0.0
    x, share = torch.stack(list(rows)), torch.tensor([float(w) for w in weights]) / float(sum(weights))
    around = torch.linalg.vector_norm(x - weighted_robust_mean(rows, weights), dim=1)
    apart = torch.cdist(x[None], x[None])[0]
    apart.fill_diagonal_(math.inf)
    nearest = apart.min(dim=1).values
    return min(float(weighted_median(around[:, None], share)[0]), float(weighted_median(nearest[:, None], share)[0]))


def units(numel: int, target: int, piece_values: int) -> int:
    """Shards of a round with the cross-group stage: a full group's layout, the same in every group."""
    return min(MAX_PIECES, target * pieces_per_member(numel, target, piece_values))


def windows(matchmaking_timeout: float) -> tuple[float, float]:
    """(designate window, settle) seconds for a run."""
    return min(DESIGNATE_WINDOW, matchmaking_timeout / 4), min(SETTLE, matchmaking_timeout / 4)


def round_id(run: str, round_: int, base: str) -> str:
    """What stands for the group in the applied digest when every group applies the same means."""
    return hashlib.sha256(f"cross/{run}/{round_}/{base}".encode()).hexdigest()


def cross_codec(codec: Codec) -> Codec:
    """How a designee encodes its mean: the codec reducers use for the largest group."""
    return codec.for_results(MAX_GROUP)


@dataclass(frozen=True)
class Plan:
    """Round r's designees, as one peer derived them from its board."""

    round: int
    base: str
    designees: tuple[str, ...]  # sorted
    weights: dict[str, float]
    units: int  # shards of the round (U)
    numel: int
    t0: float = 0.0  # unix time of the anchor (``anchor``) at the base: the round's cutoff counts from it
    ready: frozenset[str] = frozenset()  # every peer ready at the base when the plan was read (the buckets read)
    width: int = 0  # designees the sub-pieces are cut for: the top bucket's (0: ours)
    witnessed: bool = False  # a designee's mean needs its witness's signature too (level 0: ``needs_witness``)
    closed: bool = False  # every designee is closed (nobody can dial them: each is its own group's designee)

    @property
    def subs(self) -> int:
        """Sub-pieces per shard: the U x S sub-pieces about as many as the (top bucket's) designees."""
        shard = -(-self.numel // self.units)
        most = max(1, min(MAX_SUBS, shard // MIN_SUB_VALUES))
        return max(1, min(most, -(-(self.width or len(self.designees)) // self.units)))

    def ranked(self, k: int, j: int) -> list[str]:
        """The designees of sub-piece (k, j), in order (weighted rendezvous hashing)."""
        def score(p: str) -> float:
            h = hashlib.sha256(f"cross/{self.round}/{self.base}/{k}/{j}/{p}".encode()).digest()
            u = (int.from_bytes(h[:8], "big") + 1) / 2.0**64  # (0, 1]
            return -math.log(u) / self.weights[p]

        return sorted(self.designees, key=lambda p: (score(p), p))[:RANKS]

    def needs_witness(self, k: int, j: int) -> bool:
        """Whether a mean of sub-piece (k, j) counts only with a second designee's signature: at
        level 0, whenever it has two designees or more that can be dialed (one alone has nobody to
        check it; closed ones cannot reach each other)."""
        return self.witnessed and not self.closed and len(self.ranked(k, j)) >= 2

    def sub_bounds(self, start: int, end: int) -> list[tuple[int, int]]:
        """[start, end) of each sub-piece of the shard [start, end)."""
        return [(start + a, start + b) for a, b in shard_bounds(end - start, self.subs)]


def anchor_rank(population: int, level: int = 0) -> int:
    """Which ready record anchors a bucket's round (``anchor``): the k-th earliest, k = a third of
    the bucket's expected peers + 1 (the base state's population, the same for every peer at it),
    so that fewer identities than a third of the bucket cannot set the round's clock, whatever
    times they claim. The caller gives round 0 (no population yet) ``expected_peers`` or the target
    group size: counting the records read instead made peers that read at different times derive
    different plans."""
    return (population >> level) // 3 + 1


def believable(records: Sequence[Ready], now: float) -> list[Ready]:
    """The records a plan reads: a ready record (``done``) whose ``eta`` lies past ``now`` (unix
    time) by more than ETA_SKEW claims to be ready in the future, which nobody is; it would be the
    anchor whenever the anchor rank exceeds the records read (a run smaller than its population, or a
    base whose rounds voided: ``Averager.anchor_rank``), and its plan would have the round wait for it
    and name only peers that claimed the same time. Announcements (not ``done``) are kept."""
    return [r for r in records if not r.done or r.eta <= now + ETA_SKEW]


def anchor(records: Sequence[Ready], rank: int = 1) -> float | None:
    """The round's anchor time from the bucket's ready records at our base: the ``rank``-th earliest
    ``eta`` (the latest when fewer are ready: a run smaller than its state's population); None if
    none is ready."""
    etas = sorted(r.eta for r in records)
    return etas[min(rank, len(etas)) - 1] if etas else None


def derive(records: Sequence[Ready], round_: int, base: str, run: str, units_: int, numel: int,
           window: float = DESIGNATE_WINDOW, rank: int = 1) -> Plan:
    """The plan from a board's records (pure): see the module doc."""
    ready = [r for r in records if r.done and r.base == base and r.spec == run and r.round == round_]
    t0 = anchor(ready, rank)
    if t0 is None:
        return Plan(round_, base, (), {}, units_, numel, 0.0)
    early = [r for r in ready if t0 - window <= r.eta <= t0 + window]  # (rank 1: t0 is the earliest)
    # nobody dials a closed peer; if every early peer is closed, each can still be its own designee
    chosen = {r.peer_id: r.up for r in early if not r.closed}
    closed = not chosen
    chosen = chosen or {r.peer_id: r.up for r in early}
    weights = rates.weights(sorted(chosen), chosen)  # (unknown: the median; at most 4x it)
    return Plan(round_, base, tuple(sorted(chosen)[:MAX_DESIGNEES]), weights, units_, numel, t0,
                frozenset(sorted({r.peer_id for r in ready})[:MAX_DESIGNEES]), closed=closed)


def top_bucket(round_: int, base: str, level: int) -> int:
    """The bucket whose designees average across buckets (and sign every mean) in round ``round_``
    at ``base``: drawn from the base, so nobody knows it before the previous round has ended."""
    if level == 0:
        return 0
    return int.from_bytes(hashlib.sha256(f"hivetrain-top/{round_}/{base}".encode()).digest()[:8], "big") >> (64 - level)


def bucket_label(run: str, round_: int, base: str, bucket: int) -> str:
    """What stands for a bucket's mean where a group hash stands for a group's (the ``group`` field)."""
    return hashlib.sha256(f"cross-bucket/{run}/{round_}/{base}/{bucket}".encode()).hexdigest()


async def read_plan(board: ReadyBoard, round_: int, base: str, run: str, units_: int, numel: int,
                    own: Ready | None = None, timing: tuple[float, float] = (DESIGNATE_WINDOW, SETTLE),
                    level: int = 0, me: str = "", grace: float = 0.0, rank: int = 1) -> tuple[Plan, Plan]:
    """(ours, top): the designees of our bucket (they average our bucket's groups) and of the round's
    top bucket (they average the buckets' means and sign what everyone applies); one plan, both, at
    level 0. Two buckets are read, whatever the run's size: ours and the top one (the first bucket
    from ``top_bucket`` on with a ready record at our base). Each is read until it has settled for
    the designees (SETTLE past the window of its anchor). ``own``: our record,
    first-hand (it may not be stored yet); ``grace``: the run's matchmaking_timeout; ``rank``:
    ``anchor_rank`` of a bucket. RoundFailed if nobody is on the board."""
    ours = bucket_of(round_, me, level) if me else 0
    top = top_bucket(round_, base, level)
    for _ in range(100):
        wanted = sorted({ours, top})
        records = [r for r in believable(await board.read(round_, level, wanted), clock.wall())
                   if own is None or r.peer_id != own.peer_id]
        records += [own] if own is not None else []
        by_bucket: dict[int, list[Ready]] = {b: [] for b in wanted}
        for r in records:
            by_bucket.setdefault(bucket_of(round_, r.peer_id, level), []).append(r)
        ready = {b: [r for r in rs if r.done and r.base == base and r.spec == run] for b, rs in by_bucket.items()}
        if not ready.get(top):
            # a top bucket still empty when the round's stragglers are late (our bucket's cutoff): the
            # next one is the top (every reader moves on alike; records come in seconds, not a cutoff)
            t0 = anchor(ready.get(ours, []), rank)
            if top != ours and t0 is not None and clock.wall() >= t0 + grace + timing[1]:
                top = (top + 1) % (1 << level)
                continue
            await asyncio.sleep(POLL)
            continue
        settled = max(t + timing[0] + timing[1] for rs in ready.values() if (t := anchor(rs, rank)) is not None)
        if clock.wall() < settled:
            await asyncio.sleep(min(settled - clock.wall() + 0.01, 30.0))
            continue
        up = derive(by_bucket[top], round_, base, run, units_, numel, timing[0], rank)
        mine = derive(by_bucket.get(ours, []), round_, base, run, units_, numel, timing[0], rank)
        if up.designees:
            everyone = frozenset(sorted(up.ready | mine.ready)[:MAX_DESIGNEES])
            up = dataclasses.replace(up, ready=everyone, witnessed=level == 0)
            return dataclasses.replace(mine, width=len(up.designees), ready=everyone, witnessed=level == 0), up
    raise RoundFailed(f"no designees of round {round_} on the board")


def fallen_back(ctx: PeerContext, round_: int, base: str, k: int, j: int, body: bytes, weight: int,
                enc: int) -> tuple[dict[str, Any], bytes]:
    """Our group's own sub-piece, signed by us, its reducer: what the group applies when none of
    the sub-piece's designees took it (they cannot be reached: left, or not peers at all). The
    group then ends the round on its own state for those values, as before the cross stage; fork
    choice settles it at the next boundary."""
    result = hashlib.sha256(body).hexdigest() if body else VOID
    sig = ctx.identity.sign(message(ctx.run, round_, base, k, j, result, weight, 1, enc))
    return ctx.header("cross_out", round_, base, group=ZERO, shard=k, sub=j, result=result, weight=weight, groups=1,
                      enc=enc, signer=ctx.me, sig=sig.hex(), witness="", wsig=""), body


def message(run: str, round_: int, base: str, k: int, j: int, result: str, weight: int, groups: int,
            enc: int) -> bytes:
    return _CROSS + f"{run}/{round_}/{base}/{k}/{j}/{result}/{weight}/{groups}/{enc}".encode()


def sub_message(run: str, round_: int, base: str, group: str, k: int, j: int, members: Sequence[str], weight: int,
                result: str, enc: int, vouch_blob: bytes, attest: bool, ok: bool) -> bytes:
    """What a reducer signs of its group's sub-piece (k, j) in a ``cross`` request (``attest`` false),
    and what another member signs of it in its word (``attest`` true, ``ok`` its verdict): a designee
    can then pass both on to every reducer of the sub-piece (``proof``), which checks that the mean
    is the mean of the groups' own values (``proven``)."""
    return _SUB + msgpack.packb([run, round_, base, group, k, j, list(members), weight, result, enc,
                                 hashlib.sha256(vouch_blob).digest(), attest, ok])


def proves(plan: Plan, target: int) -> bool:
    """Whether every reducer checks a designee's means of this round against the groups' values
    (``proven``): at level 0 with a witness, when the board held at most PROOF_GROUPS full groups'
    peers. Two colluding designees drawn as one sub-piece's pair sign any mean its witness would; the
    reducers of a small round can check it themselves for at most PROOF_GROUPS x their sub-pieces'
    bytes (a larger round keeps the witness alone: the pair is the residue, SECURITY.md)."""
    return plan.witnessed and not plan.closed and 0 < len(plan.ready) <= PROOF_GROUPS * target


def combine(rows: Sequence[torch.Tensor], weights: Sequence[int], aggregation: str, numel: int) -> torch.Tensor:
    """The weighted mean of groups' sub-pieces (robust: a group without an honest majority pulls it a
    bounded way), in the order given."""
    if aggregation == "robust":
        return weighted_robust_mean(list(rows), list(weights))
    values = torch.zeros(numel, dtype=torch.float32)
    for row, weight in zip(rows, weights, strict=True):
        values.add_(row * float(weight))
    return values.div_(float(sum(weights)))


def same_mean(codec: Codec, numel: int, ours: bytes, theirs: bytes) -> bool:
    """Whether two encodings of a sub-piece's mean are the same values: the same bytes, or (two
    machines' floating point can round a sum otherwise) at most one int8 step apart in at most one
    value in WITNESS_SLACK."""
    if ours == theirs or not ours or not theirs:
        return ours == theirs
    try:
        a, b = codec.decode(ours, numel), codec.decode(theirs, numel)
    except CodecError:
        return False
    diff = (a - b).abs()
    step = float(a.abs().max()) / 127.0
    return bool(diff.max() <= 1.5 * step) and int((diff > 0).sum()) <= numel // WITNESS_SLACK


def proof_nbytes(codec: Codec, numel: int) -> int:
    """The most bytes a proof of a sub-piece of ``numel`` values can take."""
    per_group = max(codec.for_results(n).encoded_nbytes(numel) for n in (1, MAX_GROUP))
    return MAX_PROOF * (per_group + MAX_GROUP * (VOUCH_LEN + 64) + 512)


def proven(run: str, round_: int, base: str, k: int, j: int, header: dict[str, Any], body: bytes, proof: bytes,
           codec: Codec, aggregation: str, numel: int, own: tuple[str, str] | None = None) -> str:
    """Why a designee's signed mean of sub-piece (k, j) (``header``, ``body``) is not the mean of the
    groups in its ``proof`` ("" if it is; worker thread). The proof lists every group the designee
    held, each with its reducer's signature of its values (``sub_message``), the members' vouches,
    another member's signed word that the values are what the group approved, and the weight the
    designee gave it. We check every signature, that no group weighs more than its members' words
    allow (vouched members, each in one group: what a witness checks), that our own group
    (``own``: its hash and the hash of the sub-piece our reducer sent, "" if we only know the group)
    is among them, and that the
    mean of the groups with those weights is the designee's. A designee and a witness that collude
    can then choose which groups count (each at most its words' weight), never write values."""
    try:
        items = msgpack.unpackb(proof, raw=False, strict_map_key=True, use_list=True, max_str_len=4096,
                                max_bin_len=max(VOUCH_LEN * MAX_GROUP, len(proof)),
                                max_array_len=max(MAX_GROUP, MAX_PROOF, 14), max_map_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises a zoo of types for malformed input
        return f"its proof does not decode ({type(e).__name__})"
    if not isinstance(items, list) or len(items) > MAX_PROOF or not all(isinstance(i, list) and len(i) == 14 for i in items):
        return "its proof is not a list of groups"
    groups: dict[str, tuple[str, int, int, int, bytes, frozenset[str]]] = {}  # group -> (result, weight, counted, enc, values, vouched)
    for item in items:
        g, holder, members, weight, counted, enc, blob, sig, attester, w_ok, w_weight, w_enc, w_sig, values = item
        if not (isinstance(g, bytes) and len(g) == 32 and isinstance(holder, str) and isinstance(members, list)
                and all(isinstance(m, str) for m in members) and 0 < len(members) <= MAX_GROUP
                and len(set(members)) == len(members) and all(isinstance(x, int) and not isinstance(x, bool) and
                                                             0 <= x <= 1 << 20 for x in (weight, counted, enc, w_weight, w_enc))
                and 1 <= enc <= MAX_GROUP and isinstance(blob, bytes) and isinstance(sig, bytes)
                and isinstance(attester, str) and isinstance(w_ok, bool) and isinstance(w_sig, bytes)
                and isinstance(values, bytes)):
            return "a group of its proof is malformed"
        group = g.hex()
        if group in groups:
            return f"its proof names group {group[:12]} twice"
        result = hashlib.sha256(values).hexdigest() if values else VOID
        if holder not in members or not valid(holder, sig, sub_message(run, round_, base, group, k, j, members, weight,
                                                                       result, enc, blob, False, True)):
            return f"group {group[:12]}'s values in its proof are not signed by a member of that group"
        if counted > 0:
            if len(values) != codec.for_results(enc).encoded_nbytes(numel) or counted > weight:
                return f"group {group[:12]} counts in it with values of the wrong size, or more than its own weight"
            if len(members) > 1 and (attester == holder or attester not in members or not w_ok or not valid(
                    attester, w_sig, sub_message(run, round_, base, group, k, j, members, w_weight, result, w_enc,
                                                 b"", True, True))):
                return f"group {group[:12]} counts in it without another member's signed word that its values are approved"
        groups[group] = (result, weight, counted, enc, values, vouched(run, round_, group, k, members, blob))
    if own is not None and (own[0] not in groups or own[1] and groups[own[0]][0] != own[1]):
        return "our group's sub-piece is not in it as our reducer sent it"
    times = Counter(m for _, _, counted, _, _, v in groups.values() if counted > 0 for m in v)
    used = sorted((g, t) for g, t in groups.items() if t[2] > 0)
    for g, (_, _, counted, _, _, v) in used:
        if counted > len({m for m in v if times[m] == 1}):
            return f"group {g[:12]} weighs {counted} in it: more than its members' words allow"
    if len(used) == 1:
        _, (_, _, counted, enc, values, _) = used[0]
        ours, weight, enc_ = values, counted, enc
    elif used:
        try:
            rows = [codec.for_results(t[3]).decode(t[4], numel) for _, t in used]
        except CodecError as e:
            return f"a group's values in its proof do not decode: {e}"
        ours = cross_codec(codec).encode(combine(rows, [t[2] for _, t in used], aggregation, numel))
        weight, enc_ = sum(t[2] for _, t in used), MAX_GROUP
    else:
        ours, weight, enc_ = b"", 0, MAX_GROUP
    if (weight, len(used), enc_) != (header["weight"], header["groups"], header["enc"]) or \
            not same_mean(codec.for_results(enc_), numel, bytes(ours), body):
        return (f"the mean of the groups in its proof is another (weight {weight}, {len(used)} groups; it says "
                f"{header['weight']}, {header['groups']})")
    return ""


def designated(header: dict[str, Any], plan: Plan, fallback: str = "") -> bool:
    """Whether a ``cross_out``'s signer is, by our plan, one of its sub-piece's designees (or our
    reducer of the shard signing its own result: ``fallback``). Plans come from boards, and two
    honest peers' boards can differ: a signer outside ours is refused, but proves nothing against
    the member that forwarded it."""
    k, j = header["shard"], header["sub"]
    return header["signer"] in plan.ranked(k, j) or (header["signer"] == fallback and header["groups"] <= 1)


def checked(header: dict[str, Any], body: bytes, plan: Plan, fallback: str = "") -> str:
    """Why a ``cross_out`` is not a designee's signed sub-piece ("" if it is). ``fallback``: our
    reducer of the shard, who signs its own result when no designee took it (``fallen_back``)."""
    k, j = header["shard"], header["sub"]
    if k >= plan.units or j >= plan.subs:
        return f"sub-piece ({k}, {j}) does not exist"
    if not designated(header, plan, fallback):
        return f"{header['signer']} is not a designee of sub-piece ({k}, {j})"
    result = hashlib.sha256(body).hexdigest() if body else VOID
    if result != header["result"]:
        return "the sub-piece does not match its hash"
    signed = message(header["run"], header["round"], header["base"], k, j, header["result"], header["weight"],
                     header["groups"], header["enc"])
    if not valid(header["signer"], bytes.fromhex(header["sig"]), signed):
        return "the designee's signature does not verify"
    if header["signer"] in plan.ranked(k, j) and plan.needs_witness(k, j):
        witness = header["witness"]
        if witness == header["signer"] or witness not in plan.ranked(k, j):
            return f"the mean of sub-piece ({k}, {j}) has no witness among its designees"
        if not header["wsig"] or not valid(witness, bytes.fromhex(header["wsig"]), signed):
            return "the witness's signature does not verify"
    return ""


@dataclass
class _Entry:
    holder: str  # who sent it and gets the mean back: a group's reducer (tier 0) or a bucket's designee (tier 1)
    group: str  # the group's hash, or the bucket's label
    members: frozenset[str]
    weight: int
    body: bytes
    enc: int  # encoded with ``codec.for_results(enc)``
    result: str
    attested: bool | None = None  # another member's word on the same bytes (None: not yet)
    attester: str = ""
    bucket: int = -1  # a bucket's mean (tier 1): which bucket
    groups: int = 1  # the groups in it
    vouched: frozenset[str] = frozenset()  # members whose own signature says they are in the group (tier 0)
    witness: str = ""  # the designee its reducer named to check our mean of it (us: we are that witness)
    banned: bool = False  # we caught its reducer misbehaving: its group gets the means, without its values
    sig: bytes = b""  # its reducer's signature of it (``sub_message``; tier 0)
    order: tuple[str, ...] = ()  # ``members`` in the order its reducer named (and signed) them
    vouch: bytes = b""  # its ``vouch`` field as it came
    word: tuple[bool, int, int, bytes] | None = None  # the attester's word as it signed it: (ok, weight, enc, sig)

    def covers(self, on_board: Collection[str]) -> frozenset[str]:
        """The peers whose group this is, for the wait: every member it names when most of them vouched
        and are on our board (a member that died before sending its parts is named, not vouched), else
        those alone."""
        vouched = self.vouched & frozenset(on_board)
        return self.members if 2 * len(vouched) > len(self.members) else vouched

    def heard(self) -> bool:
        """Whether it needs no more words: another member's came, or none is needed (one member, no weight)."""
        return self.attested is not None or len(self.members) == 1 or self.weight == 0 or self.banned

    def counts(self) -> bool:
        """Whether its values go into the mean: a bucket's mean, a group of one, or another member
        approved these bytes."""
        return self.weight > 0 and bool(self.body) and not self.banned and (
            self.bucket >= 0 or len(self.members) == 1 or self.attested is True)


@dataclass
class _Unit:
    entries: dict[str, _Entry] = field(default_factory=dict)  # group hash (bucket label) -> its sub-piece
    first: float = 0.0
    out: tuple[dict[str, Any], bytes] | None = None  # the signed mean, once computed (or back from the top)
    closed: bool = False
    task: asyncio.Task[None] | None = None
    early: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (group, sender) -> a word
    # that came before its group's sub-piece (the reducer's upload is still on its way): taken when it comes
    sent: tuple[str, bytes] | None = None  # our bucket's mean as we sent it up: (its hash, its bytes)
    late: list[tuple[str, str]] = field(default_factory=list)  # (designee, bucket label) of buckets that came
    # after the mean was computed: they get it without their values (tier 1)
    told: int = 0  # how many of ``late`` were sent the mean
    back: asyncio.Future[tuple[dict[str, Any], bytes]] | None = None  # the top designee's signed mean of it
    used: list[tuple[_Entry, int]] | None = None  # (tier 0) every group we held for our mean, with the weight it
    # counted with there (0: not in it): what ``prove`` shows the reducers
    proof: bytes | None = None  # ``used``, packed (once asked for)
    served: Counter[str] = field(default_factory=Counter)  # who was sent ``proof``, how often (PROOF_SERVED each)
    handed: Counter[str] = field(default_factory=Counter)  # who was sent ``out`` on request, how often (``hand``)


class Desk:
    """A designee's side of one round: takes ``cross`` requests, averages, sends the means back.

    At level 0 (one bucket) a designee averages the groups and signs the mean. With buckets, the
    stage has two tiers: the designees of each bucket (tier 0, ``local``) average their bucket's
    groups and send the bucket's mean up, unsigned, to the sub-piece's designee in the round's top
    bucket (tier 1, ``plan``), which averages the buckets' means, signs, and sends the mean back down;
    each bucket's designee passes the signed bytes on to its groups' reducers. Every member checks
    the signature against the top bucket's designees, so two buckets are all a member reads."""

    def __init__(self, ctx: PeerContext, board: ReadyBoard, round_: int, base: str,
                 local: Callable[[dict[str, Any], bytes], None], own: Callable[[], Ready | None], level: int = 0,
                 silent: Callable[[str], bool] = lambda peer: False, rank: int = 1):
        self.ctx, self.board, self.round, self.base = ctx, board, round_, base
        self.rank = rank  # which ready record of a bucket anchors the round (``anchor_rank``)
        self.silent = silent  # a peer that showed us no sign of life in the round: in no group of ours, weighs nothing
        self.level = level  # the round's ready records are in 2^level buckets (ready.py)
        self.local = local  # delivers a mean to ourselves (we reduced that shard in our own group)
        self.own = own  # our ready record of the round (None: we are not ready for it)
        self.bucket = bucket_of(round_, ctx.me, level)
        self.label = bucket_label(ctx.run, round_, base, self.bucket)
        self.units_ = units(ctx.numel, ctx.spec.target_group_size, ctx.spec.piece_values)
        self.timing = windows(ctx.spec.matchmaking_timeout)
        self.plan: Plan | None = None  # the top bucket's designees: they sign the means (ours too at level 0)
        self.mine: Plan | None = None  # our bucket's designees: they average our bucket's groups
        self._planning: asyncio.Future[tuple[Plan, Plan]] | None = None
        self.buckets: dict[int, Plan] = {}  # as a top designee: each bucket's designees (read once, when needed)
        self._reading: asyncio.Future[dict[int, Plan]] | None = None
        self._read_at = 0.0  # when the last read of every bucket began
        self.work: dict[tuple[int, int, int], _Unit] = {}  # (tier, shard, sub)
        self.waiting: set[str] | None = None  # our bucket's peers whose groups our means wait for (None: not read)
        self.waiting_buckets: set[int] | None = None  # as a top designee: the buckets whose means we wait for
        self.changed = asyncio.Event()  # set when a group or a word arrives, or ``waiting`` is read anew
        self._poller: asyncio.Task[None] | None = None
        self._late_sends: set[asyncio.Future[None]] = set()  # means sent to late buckets (kept from the GC)
        self._poke = asyncio.Event()  # read the board now (not at the next poll): a top mean waits for it
        self.on_board: set[str] = set()  # peers of our bucket seen ready at our base: the only ones a group's weight counts
        self._vouched: dict[tuple[str, int, bytes], frozenset[str]] = {}  # (group, shard, vouch) -> its vouched members
        self.countersigned: dict[tuple[int, int], tuple[str, str]] = {}  # as a witness: (shard, sub) -> (result, our sig)
        self.refused: dict[tuple[int, int], tuple[str, str]] = {}  # as a witness: (shard, sub) -> (designee, why) we refused
        self.witnessed: dict[tuple[int, int], tuple[dict[str, Any], bytes]] = {}  # as a witness: (shard, sub) -> the
        # mean we countersigned, with both signatures (a ``cross_out``): what a group that comes later gets

    def sub_nbytes(self, k: int, j: int, codec: Codec) -> int:
        return codec.encoded_nbytes(self._sub_numel(k, j))

    def _sub_numel(self, k: int, j: int) -> int:
        assert self.plan is not None
        start, end = shard_bounds(self.ctx.numel, self.plan.units)[k]
        a, b = self.plan.sub_bounds(start, end)[j]
        return b - a

    async def get_plan(self) -> Plan:
        """The top bucket's plan (what members check the means against); ``mine`` is set with it."""
        if self.plan is not None:
            return self.plan
        if self._planning is None:
            self._planning = asyncio.ensure_future(read_plan(
                self.board, self.round, self.base, self.ctx.run, self.units_, self.ctx.numel, self.own(), self.timing,
                self.level, self.ctx.me, self.ctx.spec.matchmaking_timeout, self.rank))
        mine, plan = await asyncio.shield(self._planning)
        self.mine, self.plan = mine, plan
        self._seen(mine.ready)
        return plan

    async def bucket_plans(self, again: bool = False) -> dict[int, Plan]:
        """Every bucket's designees, from one read of every bucket (a top designee's cost: it checks
        that a bucket's mean comes from one of that bucket's designees, and weighs no more than
        the bucket's ready peers); ``again``: read anew if the last read is older than POLL."""
        if again and self._reading is not None and self._reading.done() and clock.now() - self._read_at >= POLL:
            self._reading = None
        if self._reading is None:
            self._read_at = clock.now()
            self._reading = asyncio.ensure_future(self._read_buckets())
        try:
            return await asyncio.shield(self._reading)
        except Exception as e:  # (a failed read is tried again by the next bucket's mean)
            self._reading = None
            logger.info("round %d: reading every bucket failed: %r", self.round, e)
            return {}

    async def _read_buckets(self) -> dict[int, Plan]:
        assert self.plan is not None
        by_bucket: dict[int, list[Ready]] = {}
        for r in believable(await self.board.read(self.round, self.level), clock.wall()):
            by_bucket.setdefault(bucket_of(self.round, r.peer_id, self.level), []).append(r)
        return {b: dataclasses.replace(derive(rs, self.round, self.base, self.ctx.run, self.units_, self.ctx.numel,
                                              self.timing[0], self.rank), width=len(self.plan.designees))
                for b, rs in by_bucket.items()}

    async def accept(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[Code, str]:
        """One group's sub-piece from its reducer, another member's word on it, or (tier 1) a
        bucket's mean from one of its designees (a ``cross`` request, its body read)."""
        try:
            plan = await asyncio.wait_for(self.get_plan(), sum(self.timing) + 5.0)
        except (TimeoutError, RoundFailed) as e:
            return Code.NOT_READY, f"no plan for round {self.round}: {e}"
        mine = self.mine or plan  # (one plan at level 0)
        k, j, tier = header["shard"], header["sub"], header["tier"]
        if k >= plan.units or j >= plan.subs:
            return Code.MALFORMED, f"sub-piece ({k}, {j}) does not exist"
        if tier == 1:
            return await self._accept_bucket(sender, header, body, plan)
        if self.ctx.me not in mine.ranked(k, j):
            return Code.WRONG_ROLE, f"we are not a designee of sub-piece ({k}, {j}) in our bucket"
        if bucket_of(self.round, sender, self.level) != self.bucket:
            return Code.WRONG_ROLE, "a group's sub-piece goes to the designees of its own bucket"
        members = frozenset(header["members"])
        if sender not in members or header["weight"] > len(members) or not 1 <= header["enc"] <= MAX_GROUP:
            return Code.MALFORMED, "the sender is not in the group it names, or the weight exceeds it"
        witness = header["witness"] if mine.needs_witness(k, j) and self.level == 0 else ""
        if not header["attest"] and mine.needs_witness(k, j) and self.level == 0 and \
                witness not in mine.ranked(k, j):
            return Code.MALFORMED, f"a sub-piece of ({k}, {j}) names its witness among the sub-piece's other designees"
        sig = bytes.fromhex(header["sig"])
        if not valid(sender, sig, sub_message(self.ctx.run, self.round, self.base, header["group"], k, j,
                                              header["members"], header["weight"], header["result"], header["enc"],
                                              header["vouch"], header["attest"], header["ok"])):
            return Code.MALFORMED, "a group's sub-piece, or a word on it, is not signed by its sender"
        unit = self.work.setdefault((0, k, j), _Unit())
        written = self._written(sender, header, body, k, j, unit, witness, sig)
        if written is not None:
            return written
        group = header["group"]
        entry = unit.entries.get(group)
        if header["attest"]:
            if body:
                return Code.WRONG_SIZE, "an attestation has no body"
            if entry is None:  # held until the sub-piece comes (a bounded number; past it, asked again)
                if (group, sender) in unit.early:
                    return Code.DUPLICATE, ""
                if len(unit.early) >= MAX_EARLY_WORDS:
                    return Code.NOT_READY, "its reducer's sub-piece has not arrived yet"
                unit.early[(group, sender)] = header
                return Code.OK, ""
            if sender == entry.holder or sender not in entry.members:
                return Code.WRONG_ROLE, "an attestation comes from another member of the group"
            if entry.attested is not None:
                return (Code.DUPLICATE, "") if entry.attester == sender else (Code.DUPLICATE, "attested already")
            self._attest(entry, sender, header)
            return Code.OK, ""
        why = self._body_error(k, j, header, body)
        if why:
            return Code.WRONG_SIZE if why.startswith("sub-piece") else Code.MALFORMED, why
        members_vouched = await self._vouched_of(group, k, header)
        written = self._written(sender, header, body, k, j, unit, witness, sig)  # (meanwhile)
        if written is not None:
            return written
        entry = unit.entries.get(group)
        if entry is not None:
            same = entry.body == body and entry.holder == sender
            if same and entry.witness != witness:  # its reducer moved on to another pair (one did not take it)
                entry.witness = witness
                self._start(0, k, j, unit) if witness != self.ctx.me else self.changed.set()
                return Code.OK, ""
            return (Code.DUPLICATE, "") if same else (Code.EQUIVOCATION, "another sub-piece for that group")
        if len(unit.entries) >= MAX_CROSS_GROUPS:
            return Code.BUSY, "too many groups for one sub-piece"
        # (a group whose reducer we banned gets the means, without its values; we keep them all the same: as a
        # witness we check another designee's mean, whose bans are its own)
        entry = unit.entries[group] = _Entry(sender, group, members, header["weight"], body, header["enc"],
                                             header["result"], vouched=members_vouched, witness=witness,
                                             banned=sender in self.ctx.bans, sig=sig, vouch=header["vouch"],
                                             order=tuple(header["members"]))
        for (g, attester), word in list(unit.early.items()):  # the first word held for it from another member
            if g == group:
                del unit.early[(g, attester)]
                if entry.attested is None and attester != sender and attester in members:
                    self._attest(entry, attester, word)
        if witness == self.ctx.me:  # we check another designee's mean of it (``check``), we compute none
            self.changed.set()
        else:
            self._start(0, k, j, unit)
        return Code.OK, ""

    def _written(self, sender: str, header: dict[str, Any], body: bytes, k: int, j: int, unit: _Unit, witness: str,
                 sig: bytes) -> tuple[Code, str] | None:
        """Our answer to a group's sub-piece (or word) once the mean of (k, j) is written or being
        computed; None while it is open."""
        settled = self._settled(k, j, unit)
        if settled is None and not unit.closed:
            return None
        if settled is None and unit.task is not None and not unit.task.done():
            return Code.BUSY, "we are computing the mean of that sub-piece"
        if settled is None or header["attest"]:  # (a word is moot once the mean is written)
            return Code.NOT_MEMBER, "the mean of that sub-piece is computed: too late for this round"
        return self._late(sender, header, body, k, j, unit, settled, witness, sig)

    def _settled(self, k: int, j: int, unit: _Unit) -> tuple[dict[str, Any], bytes] | None:
        """The round's signed mean of tier-0 sub-piece (k, j) that we hold: ours, or (as a witness with
        no group of our own to average there) the one we countersigned; None while there is none."""
        if unit.out is not None:
            return unit.out
        witnessed = self.witnessed.get((k, j))
        return witnessed if witnessed is not None and not self._ours(unit) else None

    def _late(self, sender: str, header: dict[str, Any], body: bytes, k: int, j: int, unit: _Unit,
              settled: tuple[dict[str, Any], bytes], witness: str, sig: bytes) -> tuple[Code, str]:
        """A group's sub-piece that came after the mean of (k, j) was written (``settled``): its group
        gets that mean, without its values (one state for the round; its work is lost there), as a
        late bucket does. Its sub-piece joins our proof with weight 0, so that its reducer's check
        (``proven``) finds its group among those we held. Sent once per group."""
        group = header["group"]
        entry = unit.entries.get(group)
        if entry is not None and (entry.body != body or entry.holder != sender):
            return Code.EQUIVOCATION, "another sub-piece for that group"
        if (sender, group) in unit.late:
            return Code.DUPLICATE, ""
        if any(holder == sender for holder, _ in unit.late):  # (a reducer reduces for one group: no more means
            return Code.EQUIVOCATION, "another late sub-piece of yours"  # sent for headers that cost nothing)
        if len(unit.late) >= MAX_CROSS_GROUPS:
            return Code.BUSY, "too many late groups for one sub-piece"
        why = self._body_error(k, j, header, body)
        if why:
            return Code.WRONG_SIZE if why.startswith("sub-piece") else Code.MALFORMED, why
        if entry is None and len(unit.entries) < MAX_CROSS_GROUPS:
            entry = unit.entries[group] = _Entry(sender, group, frozenset(header["members"]), header["weight"], body,
                                                 header["enc"], header["result"], witness=witness, sig=sig,
                                                 vouch=header["vouch"], order=tuple(header["members"]))
            if unit.used is not None:
                unit.used.append((entry, 0))
                unit.proof = None  # (packed anew when asked: it names the late group too)
        unit.late.append((sender, group))
        logger.info("round %d: group %s came after the mean of sub-piece (%d, %d) was written: it gets the mean "
                    "without its values", self.round, group[:12], k, j)
        out, mean = settled
        if sender == self.ctx.me:
            self.local(dict(out, group=group), mean)
        else:
            self._send_soon([(sender, dict(out, group=group), mean)])
        return Code.OK, ""

    async def _accept_bucket(self, sender: str, header: dict[str, Any], body: bytes, plan: Plan) -> tuple[Code, str]:
        """A bucket's mean of sub-piece (k, j), for us as the sub-piece's top designee."""
        k, j, b = header["shard"], header["sub"], header["bucket"]
        if self.level == 0 or b >= 1 << self.level:
            return Code.MALFORMED, "no such bucket in this round"
        if self.ctx.me not in plan.ranked(k, j):
            return Code.WRONG_ROLE, f"we are not a top designee of sub-piece ({k}, {j})"
        if header["attest"] or header["group"] != bucket_label(self.ctx.run, self.round, self.base, b) or \
                not 1 <= header["enc"] <= MAX_GROUP:
            return Code.MALFORMED, "a bucket's mean names its bucket, and nobody attests it"
        def fits(bucket: Plan | None) -> bool:
            return bucket is not None and sender in bucket.ranked(k, j) and header["weight"] <= max(1, len(bucket.ready))

        read_at = self._read_at
        bucket = (await self.bucket_plans()).get(b)
        if not fits(bucket):  # (our read may be older than the bucket's last ready records: read again)
            bucket = (await self.bucket_plans(again=True)).get(b)
            if not fits(bucket) and self._read_at == read_at:  # (read moments ago: ask the sender to come again)
                return Code.NOT_READY, "our board is behind the bucket's"
        if bucket is None or sender not in bucket.ranked(k, j):
            return Code.WRONG_ROLE, f"{sender} is not a designee of sub-piece ({k}, {j}) in bucket {b}"
        weight = min(header["weight"], max(1, len(bucket.ready)))  # (more than the bucket's ready peers we
        # read: counted as those; refusing it would make the bucket's designee ask the next top designee)
        if weight < header["weight"]:
            logger.info("round %d: bucket %d's mean of sub-piece (%d, %d) weighs %d; it has %d ready peers on our board",
                        self.round, b, k, j, header["weight"], len(bucket.ready))
        why = self._body_error(k, j, header, body)
        if why:
            return Code.WRONG_SIZE if why.startswith("sub-piece") else Code.MALFORMED, why
        unit = self.work.setdefault((1, k, j), _Unit())
        if unit.out is not None or unit.closed:
            # a bucket whose designee was replaced (it died with the sub-piece) comes late: its values are
            # not in the mean, but it gets the mean everyone applies (one state; without this the next
            # top designee signed a mean of that bucket alone, and the run forked there)
            if header["group"] not in {label for _, label in unit.late} and len(unit.late) < MAX_CROSS_GROUPS:
                unit.late.append((sender, header["group"]))
                if unit.out is not None:
                    self._send_late(unit)
            return Code.OK, ""
        entry = unit.entries.get(header["group"])
        if entry is not None:
            return (Code.DUPLICATE, "") if entry.body == body else (Code.EQUIVOCATION, "another mean for that bucket")
        unit.entries[header["group"]] = _Entry(sender, header["group"], frozenset({sender}), weight, body,
                                               header["enc"], header["result"], bucket=b, groups=header["groups"])
        self._start(1, k, j, unit)
        return Code.OK, ""

    def _body_error(self, k: int, j: int, header: dict[str, Any], body: bytes) -> str:
        codec = self.ctx.codec.for_results(header["enc"])
        if body and len(body) != self.sub_nbytes(k, j, codec):
            return f"sub-piece ({k}, {j}) has {len(body)} bytes"
        if (header["weight"] > 0) != bool(body) or (hashlib.sha256(body).hexdigest() if body else VOID) != header["result"]:
            return "a weight without values, or values that do not match their hash"
        return ""

    def _start(self, tier: int, k: int, j: int, unit: _Unit) -> None:
        if unit.task is None:
            unit.first = clock.now()
            unit.task = asyncio.ensure_future(self._finish(tier, k, j, unit))
            if tier == 1 and self.waiting_buckets is None:
                self._poke.set()
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())
        self.changed.set()

    def _attest(self, entry: _Entry, sender: str, header: dict[str, Any]) -> None:
        """Another member's word on ``entry``: approved if it names the same bytes, group and weight."""
        same = (header["result"], frozenset(header["members"])) == (entry.result, entry.members) and \
            (header["weight"] == entry.weight or entry.weight == 0)
        entry.attested, entry.attester = bool(header["ok"]) and same, sender
        if entry.attested:
            entry.word = (True, header["weight"], header["enc"], bytes.fromhex(header["sig"]))
        self.changed.set()

    def returned(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[Code, str]:
        """The top designee's signed mean of our bucket's sub-piece (a ``cross_out`` to our label)."""
        if self.plan is None:
            return Code.NOT_READY, "no plan yet"
        k, j = header["shard"], header["sub"]
        unit = self.work.get((0, k, j))
        if unit is None or unit.back is None or unit.sent is None:
            return Code.NOT_MEMBER, f"we sent no mean of sub-piece ({k}, {j}) up"
        if not body and header["result"] == unit.sent[0]:  # the top's mean is our bytes: sent back without them
            body = unit.sent[1]
        why = checked(header, body, self.plan)
        if why:
            return Code.MALFORMED, why
        if unit.back.done():
            return Code.DUPLICATE, ""
        unit.back.set_result((header, body))
        return Code.OK, ""

    async def _poll(self) -> None:
        """Who is on the round's board: the peers (the buckets, as a top designee) our means should
        wait for. Our bucket is read (every bucket, while a top mean waits: until the cutoff has
        settled, then only the buckets whose means have yet to arrive)."""
        held: dict[int, list[Ready]] = {}  # bucket -> its records, as last read
        whole = False  # whether every bucket was read once
        while any(u.task is not None and u.out is None and not u.closed for u in self.work.values()):
            top = [u for (tier, _, _), u in self.work.items() if tier == 1 and u.out is None and not u.closed]
            buckets: list[int] | None = [self.bucket] if not top else None
            if top and held and self.waiting_buckets is not None and self.plan is not None and \
                    clock.wall() >= self.plan.t0 + self.ctx.spec.matchmaking_timeout + self.timing[1]:
                arrived = set.intersection(*({e.bucket for e in u.entries.values()} for u in top))
                buckets = sorted((self.waiting_buckets - arrived) | {self.bucket})
            try:
                records = await self.board.read(self.round, self.level, buckets)
            except Exception as e:
                logger.debug("round %d: board read failed: %r", self.round, e)
                records = []
            fresh: dict[int, list[Ready]] = {}
            for r in records:
                fresh.setdefault(bucket_of(self.round, r.peer_id, self.level), []).append(r)
            held.update(fresh)  # (a bucket whose read failed keeps what we had)
            whole = whole or (buckets is None and bool(records))
            if self.bucket in held and self.plan is not None:
                self.waiting = self.waited(held[self.bucket], self.mine or self.plan)
                self._seen(r.peer_id for r in held[self.bucket] if r.done and r.base == self.base and r.spec == self.ctx.run)
            if top and self.plan is not None and whole:
                everyone = self.waited([r for rs in held.values() for r in rs], self.plan)
                self.waiting_buckets = {bucket_of(self.round, p, self.level) for p in everyone}
            self.changed.set()
            with contextlib.suppress(TimeoutError):  # (or at once when a top mean starts waiting)
                await asyncio.wait_for(self._poke.wait(), POLL)
            self._poke.clear()

    def waited(self, records: Sequence[Ready], plan: Plan | None = None) -> set[str]:
        """The peers in the round, from the board: ready at our base by the round's cutoff (the
        anchor + ``matchmaking_timeout``, the grace any straggler gets) and, until
        the cutoff has settled, those that announced it and are not ready elsewhere; less those
        whose round failed (``out``: they said so, and named their group). A peer ready later is
        late: a group of late peers that arrives before the means are computed is in them, the
        means never wait for one. ``plan``: whose earliest record the cutoff counts from (the top's)."""
        plan = plan or self.plan
        assert plan is not None
        cutoff = plan.t0 + self.ctx.spec.matchmaking_timeout
        records = [r for r in records if r.spec == self.ctx.run][:MAX_DESIGNEES]
        elsewhere = {r.peer_id for r in records if r.done and r.base != self.base}
        failed = [r for r in records if r.out and r.base == self.base]
        named = Counter(p for r in failed for p in set(r.group[:MAX_GROUP]) - {r.peer_id})
        # (a peer that died in a failed group says nothing; its group says it for it: two of them, so that
        # one identity cannot name honest peers to hurry the means past their groups)
        out = {r.peer_id for r in failed} | {p for p, n in named.items() if n >= 2}
        waited = {r.peer_id for r in records if r.done and r.base == self.base and r.eta <= cutoff}
        if clock.wall() < cutoff + self.timing[1]:
            waited |= {r.peer_id for r in records
                       if not r.done and r.base in (self.base, ZERO) and r.peer_id not in elsewhere}
        return waited - out

    def _complete(self, tier: int, unit: _Unit) -> bool:
        """Whether every group (bucket) the mean waits for has arrived, and been vouched for."""
        if tier == 1:
            return self.waiting_buckets is not None and self.waiting_buckets <= {e.bucket for e in unit.entries.values()}
        ours = self._ours(unit)
        covered = set().union(*(e.covers(self.on_board) for e in ours))
        attested = all(e.heard() for e in ours)
        return self.waiting is not None and self.waiting <= covered and attested

    async def _finish(self, tier: int, k: int, j: int, unit: _Unit) -> None:
        """Computes the sub-piece's mean once the groups of every peer in the round (``waited``; as a
        top designee, the buckets of every peer) arrived and were vouched for, or LONG_WAIT x
        ``allreduce_timeout`` past the first arrival (a group that died in the cross stage: the
        others go on without it). A bucket's designee (with buckets) sends its mean up and passes
        on the signed mean that comes back; a top designee (or any at level 0) signs it."""
        patience = LONG_WAIT * self.ctx.spec.allreduce_timeout
        try:
            while unit.first + patience - clock.now() > clock.EPSILON:
                if self._complete(tier, unit):
                    break
                self.changed.clear()  # (every unit's task clears it: each then looks again within POLL / 2)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(),
                                           min(POLL / 2, max(0.0, unit.first + patience - clock.now())))
            unit.closed = True
            entries = list(unit.entries.values()) if tier == 1 else self._weighed(k, j, self._ours(unit))
            if tier == 0:
                entries = self.ctx.behaviour.averaged(self.round, self.base, k, j, entries, self._sub_numel(k, j),
                                                      self.ctx.codec)
            if tier == 0 and len(entries) > 1 and self._minority(entries):
                entries = []
            averaged: list[_Entry] = []
            body, weight, groups, enc = await asyncio.to_thread(self._mean, k, j, entries, averaged)
            if tier == 0 and self.level == 0:
                counted = {e.group: e.weight for e in averaged}
                held = {e.group: e for e in entries} | {e.group: e for e in self._ours(unit)}  # (as they came)
                unit.used = [(e, counted.get(g, 0)) for g, e in sorted(held.items())]
            if body:
                body = self.ctx.behaviour.mean_for(self.round, k, j, body, self._sub_numel(k, j),
                                                   self.ctx.codec.for_results(enc))
            if tier == 0 and self.level > 0:
                mean = await self._up(k, j, unit, body, weight, groups, enc)
                if mean is None:
                    return
                header, body = mean
            else:
                header, body = self._signed(k, j, body, weight, groups, enc)
                mine = self.mine or self.plan
                if tier == 0 and mine is not None and mine.needs_witness(k, j):
                    named = Counter(e.witness for e in self._ours(unit) if e.witness)
                    witness = named.most_common(1)[0][0] if named else ""
                    manifest = [(e.group, e.weight if e.counts() else 0) for e in entries]
                    wsig = await self._countersigned(k, j, header, body, entries, manifest, witness)
                    if wsig is None:  # our mean without a witness: its reducers ask the next pair at once
                        await self._unwitnessed(header, body, self._ours(unit))
                        return
                    header = dict(header, witness=witness, wsig=wsig)
            unit.out = (header, body)
            if tier == 1:
                self._send_late(unit)
            sends = []
            for e in (unit.entries.values() if tier == 1 else self._ours(unit)):
                if e.holder == self.ctx.me:
                    if tier == 1:  # our own bucket's mean: back to our tier-0 side
                        self.returned(self.ctx.me, dict(header, group=e.group), body)
                    else:
                        self.local(header, body)
                else:  # (a mean that is the holder's own bytes goes back without them: it has them)
                    sends.append((e.holder, dict(header, group=e.group), b"" if body and body == e.body else body))
            deadline = clock.now() + self.ctx.spec.allreduce_timeout
            await send_all(self.ctx, self.round, deadline, sends, strict=False)
        except Exception as e:  # a background task: say what went wrong, never raise unseen
            logger.warning("round %d: the mean of sub-piece (%d, %d) failed: %r", self.round, k, j, e)

    def _ours(self, unit: _Unit) -> list[_Entry]:
        """A tier-0 unit's groups whose mean we compute: all but those whose reducers named us their witness."""
        return [e for e in unit.entries.values() if e.witness != self.ctx.me]

    async def _unwitnessed(self, header: dict[str, Any], body: bytes, entries: list[_Entry]) -> None:
        """Our mean, signed by us alone, to the groups' reducers: nobody applies it (it has no
        witness), and they ask the sub-piece's next pair at once, not after waiting for a mean."""
        sends = []
        for e in entries:
            if e.holder == self.ctx.me:
                self.local(header, body)
            else:
                sends.append((e.holder, dict(header, group=e.group), body))
        await send_all(self.ctx, self.round, clock.now() + DESIGNEE_MARGIN, sends, strict=False)

    async def _countersigned(self, k: int, j: int, header: dict[str, Any], body: bytes, entries: list[_Entry],
                             manifest: list[tuple[str, int]], witness: str) -> str | None:
        """The witness's signature of our mean of sub-piece (k, j) (``check`` on its side), or None
        if it refused it or could not be reached (then nobody applies our mean: said loudly)."""
        ask = self.ctx.header("cross_check", self.round, self.base, group=ZERO, shard=k, sub=j, result=header["result"],
                              weight=header["weight"], groups=header["groups"], enc=header["enc"], sig=header["sig"],
                              manifest=[[bytes.fromhex(g), w] for g, w in sorted(manifest)[:MAX_CROSS_GROUPS]])
        why, pause = "", RETRY_PAUSE[0]
        deadline = clock.now() + LONG_WAIT * self.ctx.spec.allreduce_timeout + DESIGNEE_MARGIN
        # (a mean that is one group's own bytes goes without them: the witness holds that group's sub-piece)
        sent = b"" if body and any(e.body == body for e in entries) else body
        while True:  # (asked again while it lacks a group's sub-piece or word, or is busy)
            try:
                reply, _ = await request(self.ctx.link, witness, self.ctx.protocol, ask, sent,
                                         max(0.1, deadline - clock.now()), traffic=self.ctx.traffic)
            except Exception as e:  # (unreachable, or too slow)
                reply, why = {}, repr(e)
            code = reply.get("code")
            if code not in (Code.NOT_READY, Code.BUSY) or clock.now() + pause >= deadline:
                break
            await asyncio.sleep(pause)
            pause = min(RETRY_PAUSE[1], 2 * pause)
        if reply.get("type") == "cross_sig" and reply["code"] == Code.OK and (k, j) == (reply["shard"], reply["sub"]):
            signed = message(self.ctx.run, self.round, self.base, k, j, header["result"], header["weight"],
                             header["groups"], header["enc"])
            if reply["sig"] and valid(witness, bytes.fromhex(reply["sig"]), signed):
                return str(reply["sig"])
            why = "its signature does not verify"
        why = why or f"{reply.get('code')} {reply.get('reason', '')}"
        logger.warning("round %d: witness %s did not countersign our mean of sub-piece (%d, %d): %s", self.round,
                       witness, k, j, why)
        return None

    async def check(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[Code, str, str]:
        """As a witness: another designee's mean of sub-piece (k, j), with the groups it averaged and
        their weights (``manifest``). We hold the same groups' sub-pieces (their reducers sent them
        to both of us) and the other members' words on them: each weight must be one we could give
        (at most the members that vouched for the group, each in one group; a group counts only with
        another member's word), and our mean of those sub-pieces with those weights must be its
        mean (up to one int8 step where floating point rounds otherwise). Then we sign the same
        statement it signed (code, why, our signature); one mean per sub-piece."""
        try:
            plan = await asyncio.wait_for(self.get_plan(), sum(self.timing) + 5.0)
        except (TimeoutError, RoundFailed) as e:
            return Code.NOT_READY, f"no plan for round {self.round}: {e}", ""
        mine = self.mine or plan
        k, j = header["shard"], header["sub"]
        if self.level > 0 or k >= plan.units or j >= plan.subs:
            return Code.MALFORMED, f"no witnessed sub-piece ({k}, {j}) in this round", ""
        ranked = mine.ranked(k, j)
        if self.ctx.me not in ranked or sender not in ranked or sender == self.ctx.me:
            return Code.WRONG_ROLE, f"a witness and the designee it checks are two designees of sub-piece ({k}, {j})", ""
        if not body and header["result"] != VOID:  # one group's own bytes, sent without them: ours of that group
            held = self.work.get((0, k, j))
            body = next((e.body for e in held.entries.values() if e.result == header["result"] and e.body), b"") \
                if held is not None else b""
            if not body:
                return Code.NOT_READY, "we hold no sub-piece with that mean's hash yet", ""
        if (hashlib.sha256(body).hexdigest() if body else VOID) != header["result"]:
            return Code.MALFORMED, "the mean does not match its hash", ""
        if body and len(body) != self.sub_nbytes(k, j, self.ctx.codec.for_results(header["enc"])):
            return Code.WRONG_SIZE, f"sub-piece ({k}, {j}) has {len(body)} bytes", ""
        signed = message(self.ctx.run, self.round, self.base, k, j, header["result"], header["weight"],
                         header["groups"], header["enc"])
        if self.ctx.behaviour.countersigns(self.round, k, j, sender):  # (a colluding witness: the simulator's attacks)
            return Code.OK, "", self.ctx.identity.sign(signed).hex()
        if not valid(sender, bytes.fromhex(header["sig"]), signed):  # (we hand the mean on: cross_out needs both)
            return Code.MALFORMED, "the designee's signature of its mean does not verify", ""
        done = self.countersigned.get((k, j))
        if done is not None:
            return (Code.OK, "", done[1]) if done[0] == header["result"] else \
                (Code.EQUIVOCATION, "we countersigned another mean of that sub-piece", "")
        manifest = {bytes(g).hex(): w for g, w in header["manifest"]}
        if len(manifest) != len(header["manifest"]):
            return Code.MALFORMED, "a group named twice", ""
        unit = self.work.setdefault((0, k, j), _Unit())
        # (its groups' sub-pieces and words reach us about when they reached it: it asks again; waiting
        # here held the stream that the words it waited for needed, until the designee's deadline)
        missing = [g for g, w in manifest.items() if w > 0 and (g not in unit.entries or not unit.entries[g].heard())]
        if missing:
            return Code.NOT_READY, f"we hold no checked sub-piece of {len(missing)} of its groups yet", ""
        # (view-free: a group we banned, or left out of the weight for a peer we did not see, may be in its mean)
        chosen = [dataclasses.replace(unit.entries[g], weight=w, banned=False) for g, w in manifest.items() if w > 0]
        # (one view of ours does count: values that only peers we caught breaking the protocol vouch for
        # are not averaged into what we sign. An honest peer that restarted, alone at its state with the
        # equivocator it had convicted, countersigned the equivocator's mean of both their groups of one:
        # search seed 5,000,467. An honest designee that did not catch it is refused too, and the next pair
        # asked. A group with other members still counts, whoever reduced it: its members' words approve
        # its values, and refusing it cost honest groups their rounds, seeds 5,000,034 and 5,000,052. And
        # only at a third of the weight or more: below, the robust mean bounds such a group as any other,
        # and refusing every mean that held an attacker's group of one cost rounds in 5,000,129: 1.0 -> 0.57)
        bans = self.ctx.bans
        caught = [c for c in chosen if c.vouched and all(m in bans for m in c.vouched)]
        if CAUGHT_SHARE * sum(c.weight for c in caught) >= sum(c.weight for c in chosen) > 0:
            why = (f"it counts group {caught[0].group[:12]}, whose values are those of a peer we caught breaking "
                   "the protocol, with weight the robust mean does not bound")
            self.refused.setdefault((k, j), (sender, why))
            return Code.MALFORMED, why, ""
        times = Counter(m for c in chosen for m in c.vouched)
        for c in chosen:
            if not c.counts():
                return Code.MALFORMED, f"group {c.group[:12]} has no other member's word that its values are approved", ""
            if c.weight > min(unit.entries[c.group].weight, len({m for m in c.vouched if times[m] == 1})):
                return Code.MALFORMED, f"group {c.group[:12]} weighs {c.weight}: more than its members' words allow", ""
        # (which groups it counts, and with what weight up to the bound above, is its own view: the newcomer
        # brake, its bans and its board make an honest designee give groups less, or nothing; a rule that its
        # groups be most of ours refused honest means in round 1 of test_sim.py's unverifiable_parts runs)
        ours, weight, groups, enc = await asyncio.to_thread(self._mean, k, j, chosen)
        if (weight, groups, enc) != (header["weight"], header["groups"], header["enc"]) or \
                not await asyncio.to_thread(self._same_mean, k, j, ours, body, enc):
            why = (f"our mean of those groups with those weights is another (weight {weight}, {groups} groups, "
                   f"enc {enc}; it says {header['weight']}, {header['groups']}, {header['enc']})")
            self.refused.setdefault((k, j), (sender, why))
            logger.warning("round %d: we refused to countersign %s's mean of sub-piece (%d, %d): %s", self.round,
                           sender, k, j, why)
            return Code.MALFORMED, why, ""
        # (the mean is right for the groups it names; whether they are the round's is the next question: a
        # designee that named only a group of one it made up of itself was the whole mean, search attack
        # partisan_designee, 1.83x)
        why = "" if self._all_counted(unit, manifest) else await asyncio.to_thread(self._far, k, j, unit, body, enc)
        if why:
            self.refused.setdefault((k, j), (sender, why))
            logger.warning("round %d: we refused to countersign %s's mean of sub-piece (%d, %d): %s", self.round,
                           sender, k, j, why)
            return Code.MALFORMED, why, ""
        if (k, j) in self.countersigned:  # (meanwhile)
            return Code.EQUIVOCATION, "we countersigned another mean of that sub-piece", ""
        sig = self.ctx.identity.sign(signed).hex()
        self.countersigned[(k, j)] = (header["result"], sig)
        self.witnessed[(k, j)] = (self.ctx.header(
            "cross_out", self.round, self.base, group=ZERO, shard=k, sub=j, result=header["result"],
            weight=header["weight"], groups=header["groups"], enc=header["enc"], signer=sender, sig=header["sig"],
            witness=self.ctx.me, wsig=sig), body)
        # (we can show the reducers its proof too, from the same groups: a designee that died after it sent
        # its mean cost its sub-piece the round, search seed 5,000,110)
        unit.used = [(e, manifest.get(g, 0)) for g, e in sorted(unit.entries.items())]
        return Code.OK, "", sig

    def _same_mean(self, k: int, j: int, ours: bytes, theirs: bytes, enc: int) -> bool:
        return same_mean(self.ctx.codec.for_results(enc), self._sub_numel(k, j), ours, theirs)

    @staticmethod
    def _words(unit: _Unit) -> list[tuple[_Entry, int]]:
        """The groups we hold whose values count, whatever our bans, each with the weight its members'
        words allow (vouched members, each counted in one group only): the same for every witness."""
        counting = [e for e in (dataclasses.replace(e, banned=False) for e in unit.entries.values()) if e.counts()]
        times = Counter(v for e in counting for v in e.vouched)
        return [(e, min(e.weight, len({v for v in e.vouched if times[v] == 1}))) for e in counting]

    @classmethod
    def _all_counted(cls, unit: _Unit, manifest: dict[str, int]) -> bool:
        """Whether a designee's groups are every group we hold whose values count, each with all the
        weight its members' words allow: then it chose nobody out (``_far`` has nothing to measure)."""
        return all(manifest.get(e.group, 0) >= weight for e, weight in cls._words(unit))

    def _far(self, k: int, j: int, unit: _Unit, theirs: bytes, enc: int) -> str:
        """Why a designee's mean of sub-piece (k, j) (the right mean of the groups it names: ``check``)
        lies too far from our own mean of the groups we hold to be a mean of the round's groups (''
        if it does not; worker thread). Ours is the mean we would compute as its designee (our
        weights: our board, bans and newcomer brake), or, where that is void, the mean with the
        weights the groups' words allow (the same for every witness). Two honest designees see the
        round a little differently (their boards, bans, whom each completed a round with, a group
        that came late to one, their bans: search seed 5,000,405 under unverifiable_parts, 1.4 to
        1.5 spreads), so their means differ by a part of the groups' spread; a designee that named
        only a group of one it made up of itself (partisan_designee) is further. Near is within
        CHOICE_SPREAD x the groups' spread plus the codec's rounding: edging_designee, a mean just
        inside that, kept I1 in the simulator (tests/protocol/test_sim.py, docs/BENCHMARKS.md). The spread (``groups_spread``) is over the groups we hold, with
        the weights their members' words allow (the same for every witness); the smaller of two
        weighted medians, because the distance to the nearest other alone gave one honest group
        and a made-up one far off a spread of their distance apart (a search schedule). A group
        alone, or one with most of the weight, has no spread: the mean must be ours. A
        void mean is never far (it applies nobody's values: every group keeps its own)."""
        if not theirs:
            return ""
        numel = self._sub_numel(k, j)
        try:
            d = self.ctx.codec.for_results(enc).decode(theirs, numel)
        except CodecError as err:
            return f"its mean does not decode: {err}"
        rows: list[torch.Tensor] = []
        weights: list[float] = []
        for c, weight in self._words(unit):
            if weight > 0:
                with contextlib.suppress(CodecError):
                    rows.append(self.ctx.codec.for_results(c.enc).decode(c.body, numel))
                    weights.append(float(weight))
        ours = self._weighed(k, j, list(unit.entries.values()), quiet=True)
        if len(ours) > 1 and self._minority(ours, quiet=True):
            ours = []
        mine, _, _, mine_enc = self._mean(k, j, ours)
        if mine:
            m = self.ctx.codec.for_results(mine_enc).decode(mine, numel)
        elif rows:
            m = weighted_robust_mean(rows, weights) if self.ctx.spec.aggregation == "robust" else \
                sum((r * w for r, w in zip(rows, weights, strict=True)), torch.zeros(numel)) / sum(weights)
        else:
            return "we hold no group whose values count"
        spread = groups_spread(rows, weights)
        rounding = float(m.abs().max()) / 127.0 * math.sqrt(numel)  # (half an int8 step per value, each side)
        dist = float(torch.linalg.vector_norm(d - m))
        if math.isfinite(dist) and dist <= CHOICE_SPREAD * spread + rounding:
            return ""
        return (f"its mean lies {dist:.4g} from our own mean of the groups we hold, and the groups lie "
                f"{spread:.4g} apart (allowed: {CHOICE_SPREAD} x that + {rounding:.3g} rounding)")

    def _minority(self, entries: list[_Entry], quiet: bool = False) -> bool:
        """Whether the groups that sent a sub-piece (more than one) may not decide it, so that we sign it
        void (no values; every group that sent it applies the same): when they cover no more than half
        of the round's peers we wait for (a minority's mean is whoever it holds: three attackers alone
        in groups of one outweighed an honest pair, 611x, after the round's largest group went to a
        designee that crashed; search seed 3,001,409), or when the only groups that weigh are groups
        of one and a group that weighs nothing would get their values (unchecked values: an attacker
        alone was the mean of a 9-member group whose attacker reducer its auditor had rejected,
        9.2e5x; search seed 3,001,993). Groups of one that all weigh are averaged as a pair is (two
        peers that each derived a group of one voided every round, and never met: CI on this machine,
        test_reach.py's restarted owner). A group that sent it alone gets its own values back, as
        when it trains alone."""
        counted = [e for e in entries if e.counts()]
        if counted and all(len(e.members) == 1 for e in counted) and len(counted) < len(entries):
            why = "the only groups that weigh are groups of one, and a group that weighs nothing would get their values"
        elif self.waiting:
            # (a group whose word has not come is not here yet: the designee's wait counts from the first
            # arrival, anybody's to choose; a made-up group sent early, and honest groups whose auditors'
            # words came after the wait, made the made-up group the mean: search seed 3,001,529, 441x)
            covered = set().union(*(e.covers(self.on_board) for e in entries if e.heard())) & self.waiting
            if 2 * len(covered) > len(self.waiting):
                return False
            why = f"its groups cover {len(covered)} of the round's {len(self.waiting)} peers"
        else:
            return False
        if not quiet:
            logger.warning("round %d: a sub-piece's groups may not decide it (%s): it is void", self.round, why)
        return True

    async def _vouched_of(self, group: str, k: int, header: dict[str, Any]) -> frozenset[str]:
        """``vouched`` for a group's sub-piece (checked once per group and shard: every sub-piece of
        the shard carries the same words)."""
        key = (group, k, header["vouch"])
        if key not in self._vouched:
            if len(self._vouched) >= MAX_VOUCH_MEMO:
                self._vouched.clear()
            self._vouched[key] = await asyncio.to_thread(vouched, self.ctx.run, self.round, group, k,
                                                         header["members"], header["vouch"])
        return self._vouched[key]

    def _seen(self, peers: Iterable[str]) -> None:
        for p in peers:
            if len(self.on_board) >= MAX_DESIGNEES:
                break
            self.on_board.add(p)

    def _weighed(self, k: int, j: int, entries: list[_Entry], quiet: bool = False) -> list[_Entry]:
        """The groups' entries with the weight we count: at most the members that vouched for the group
        and that we saw ready on our board and alive in the round (``silent``: a record whose peer
        never showed itself is in no group), each in one group only (a member that vouched for two
        groups of the round counts in neither), and none we never completed a round with (the
        reducers' Sybil brake, reduce.py ``probation_claims``, one stage up), unless every member
        counted is one. Unlike a reducer's, this brake holds when the newcomers are the majority: a
        peer alone at its state (the others moved on) met two identities' made-up group of two
        there, and the group outweighed it (search seed 3,000,827)."""
        times = Counter(m for e in entries for m in e.vouched)
        twice = {m for m, n in times.items() if n > 1}
        counted = {e.group: {m for m in (e.vouched - twice) & self.on_board if not self.silent(m)} for e in entries}
        everyone = set().union(*counted.values())
        newcomers = {m for m in everyone if m != self.ctx.me and self.ctx.trust.on_probation(m, self.round)}
        if newcomers == everyone:  # (nobody we completed a round with is here: nobody to vet them by)
            newcomers = set()
        out = []
        for e in entries:
            weight = len(counted[e.group] - newcomers)
            if weight < e.weight:
                if not quiet:
                    logger.info("round %d: group %s claims weight %d in sub-piece (%d, %d); %d of its members vouched, "
                                "are on our board and are no newcomers to us", self.round, e.group[:12], e.weight, k,
                                j, weight)
                e = dataclasses.replace(e, weight=weight)
            out.append(e)
        return out

    def _send_late(self, unit: _Unit) -> None:
        """The mean, to the buckets that came after it was computed (each once)."""
        assert unit.out is not None
        header, body = unit.out
        late, unit.told = unit.late[unit.told:], len(unit.late)
        if late:
            for holder, label in late:
                if holder == self.ctx.me:
                    self.returned(self.ctx.me, dict(header, group=label), body)
            self._send_soon([(holder, dict(header, group=label), body) for holder, label in late
                             if holder != self.ctx.me])

    def _send_soon(self, sends: list[tuple[str, dict[str, Any], bytes]]) -> None:
        """Means to late groups (buckets), in the background, within ``allreduce_timeout`` (kept from the GC)."""
        deadline = clock.now() + self.ctx.spec.allreduce_timeout
        task = asyncio.ensure_future(send_all(self.ctx, self.round, deadline, sends, strict=False))
        self._late_sends.add(task)
        task.add_done_callback(self._late_sends.discard)

    async def _up(self, k: int, j: int, unit: _Unit, body: bytes, weight: int, groups: int,
                  enc: int) -> tuple[dict[str, Any], bytes] | None:
        """Our bucket's mean of sub-piece (k, j) to its first top designee that takes it and sends the
        signed mean back in time (then the next); None if none does: our bucket's reducers then
        apply their groups' own values (``fallen_back``), loudly."""
        assert self.plan is not None
        result = hashlib.sha256(body).hexdigest() if body else VOID
        header = self.ctx.header("cross", self.round, self.base, group=self.label, shard=k, sub=j, members=[],
                                 weight=weight, result=result, enc=enc, attest=False, ok=True, tier=1,
                                 bucket=self.bucket, groups=groups, vouch=b"", witness="", sig="")
        unit.sent = (result, body)
        patience = LONG_WAIT * self.ctx.spec.allreduce_timeout + DESIGNEE_MARGIN
        for designee in self.plan.ranked(k, j):
            unit.back = asyncio.get_running_loop().create_future()
            deadline = clock.now() + patience
            try:
                if designee == self.ctx.me:
                    code, why = await self.accept(self.ctx.me, header, body)
                    if code not in (Code.OK, Code.DUPLICATE):
                        raise RoundFailed(why)
                else:
                    await deliver(self.ctx, deadline, designee, header, body)
                return await asyncio.wait_for(asyncio.shield(unit.back), max(0.0, deadline - clock.now()))
            except (RoundFailed, TimeoutError) as e:
                logger.info("round %d: top designee %s of sub-piece (%d, %d): %r", self.round, designee, k, j, e)
        logger.warning("round %d: no top designee averaged sub-piece (%d, %d) of our bucket", self.round, k, j)
        return None

    def _mean(self, k: int, j: int, entries: list[_Entry], used: list[_Entry] | None = None) -> tuple[bytes, int, int, int]:
        """The weighted mean of the groups' (buckets') sub-pieces, in label order, encoded once
        (worker thread): (bytes, weight, groups, enc). ``used`` gets the entries whose values it holds."""
        plan = self.plan
        assert plan is not None
        start, end = shard_bounds(self.ctx.numel, plan.units)[k]
        a, b = plan.sub_bounds(start, end)[j]
        counted = [e for e in sorted(entries, key=lambda e: e.group) if e.counts()]
        if len(counted) == 1:  # one group's values: its own bytes, as its reducer encoded them
            e = counted[0]
            if used is not None:
                used.append(e)
            return e.body, e.weight, e.groups, e.enc
        rows: list[torch.Tensor] = []  # (b - a,) fp32 each
        weights: list[int] = []
        groups = 0
        for e in counted:
            try:
                rows.append(self.ctx.codec.for_results(e.enc).decode(e.body, b - a))
            except CodecError as err:
                logger.warning("round %d: the sub-piece (%d, %d) of group %s is malformed: %s", self.round, k, j,
                               e.group[:12], err)
                continue
            weights.append(e.weight)
            groups += e.groups
            if used is not None:
                used.append(e)
        if not rows:
            return b"", 0, groups, MAX_GROUP
        values = combine(rows, weights, self.ctx.spec.aggregation, b - a)
        return cross_codec(self.ctx.codec).encode(values), sum(weights), groups, MAX_GROUP

    def prove(self, sender: str, header: dict[str, Any]) -> tuple[Code, str, bytes]:
        """Our mean of sub-piece (k, j) shown to a reducer that got it (``proven`` on its side): every
        group we held, with its reducer's signature of its values, its members' vouches, another
        member's signed word on them and the weight it counted with."""
        k, j = header["shard"], header["sub"]
        unit = self.work.get((0, k, j))
        signed = unit.out[0]["result"] if unit is not None and unit.out is not None else \
            self.countersigned.get((k, j), ("", ""))[0]  # (as its witness: the mean we countersigned)
        if unit is None or not signed or unit.used is None:
            return Code.NOT_READY, f"we signed no mean of sub-piece ({k}, {j})", b""
        if signed != header["result"]:
            return Code.MALFORMED, "that is not the mean we signed", b""
        if not any(sender in e.members for e, _ in unit.used):
            return Code.NOT_MEMBER, "a proof is for the members of the groups in the mean", b""
        if len(unit.used) > MAX_PROOF:
            return Code.BUSY, f"our mean holds {len(unit.used)} groups: more than a proof carries", b""
        if unit.served[sender] >= PROOF_SERVED:  # (a member asking again and again would have us upload it each time)
            return Code.DUPLICATE, f"we sent you that proof {PROOF_SERVED} times", b""
        unit.served[sender] += 1
        if unit.proof is None:  # (no word: attester "", verdict false, weight 0, enc 1, no signature)
            unit.proof = msgpack.packb([
                [bytes.fromhex(e.group), e.holder, list(e.order or sorted(e.members)), e.weight, counted, e.enc, e.vouch,
                 e.sig, e.attester if e.word else "", *(e.word or (False, 0, 1, b"")), e.body]
                for e, counted in unit.used])
        return Code.OK, "", unit.proof

    def hand(self, sender: str, header: dict[str, Any]) -> tuple[Code, str, dict[str, Any], bytes]:
        """Our signed mean of sub-piece (k, j), as we sent it to the reducer of ``sender``'s group: for a
        member whose reducer died before passing it on (``AllReduceRunner._fetch``). Only to a member
        its own reducer named, of a group we held, PROOF_SERVED times at most (each is the mean's bytes)."""
        k, j = header["shard"], header["sub"]
        unit = self.work.get((0, k, j))
        if unit is None or unit.out is None:
            return Code.NOT_READY, f"we hold no signed mean of sub-piece ({k}, {j})", {}, b""
        entry = unit.entries.get(header["group"])
        if entry is None or entry.bucket >= 0 or entry.witness == self.ctx.me or sender not in entry.members:
            return Code.NOT_MEMBER, "a mean is handed to the members of the groups we held", {}, b""
        if unit.handed[sender] >= PROOF_SERVED:
            return Code.DUPLICATE, f"we sent you that mean {PROOF_SERVED} times", {}, b""
        unit.handed[sender] += 1
        out, body = unit.out
        return Code.OK, "", dict(out, group=entry.group), body

    def _signed(self, k: int, j: int, body: bytes, weight: int, groups: int, enc: int) -> tuple[dict[str, Any], bytes]:
        result = hashlib.sha256(body).hexdigest() if body else VOID
        sig = self.ctx.identity.sign(message(self.ctx.run, self.round, self.base, k, j, result, weight, groups, enc))
        header = self.ctx.header("cross_out", self.round, self.base, group=ZERO, shard=k, sub=j, result=result,
                                 weight=weight, groups=groups, enc=enc, signer=self.ctx.me, sig=sig.hex(),
                                 witness="", wsig="")
        return header, body

    def stop(self) -> None:
        for task in [self._poller, self._planning, self._reading, *self._late_sends, *(u.task for u in self.work.values())]:
            if task is not None and not task.done():
                task.cancel()
