"""What every part of the averaging protocol of one peer shares: the run, the link, the keys, the
ledgers, and how this peer behaves. Built once by the averager, passed to its collaborators."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hivetrain.dht.identity import Identity
from hivetrain.kernels.error_feedback import ErrorFeedback
from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging.behaviour import Behaviour
from hivetrain.peer.averaging.rates import Rates
from hivetrain.peer.config import RunSpec
from hivetrain.peer.net.link import Link, Traffic
from hivetrain.peer.trust import Bans, Trust

PROTOCOL_VERSION = 19  # 19: a group whose sub-piece comes after its mean was written gets that mean without its values (designee, or its witness once it countersigned: ``cross_check`` carries the designee's signature), its sub-piece in the proof with weight 0; 18: a member asks its reducer for a mean it did not pass on (``cross_mean_req``: BUSY until it has), and the sub-piece's designees once the reducer no longer holds the round (cross.py ``hand``); 17: a reducer and its group's attester sign the sub-piece they send the designees (cross.py ``sub_message``), and in a round of at most 4 full groups every reducer asks the designee for the proof of a mean and recomputes it (``proven``) before passing it on; 16: a view or its reply says whether its sender derived its group (only then does it count as agreement; a peer derives again when its board grew, until it decided), groups are runs of consecutive ranks, the anchor rank of a base without a population doubles each round; 15: a designee's mean counts only with its witness's signature (the second designee of the pair a reducer sends its sub-piece to recomputes it: cross.py ``check``); 14: a result carries the members' signatures of the parts it used, a verdict the proof of a member that signed its auditor another part (both ban it); 13: every part signed with the cross stage, a group's members vouch for it to the designees (cross.vouched: its weight counts only them, on the designee's board, each in one group), no view decided before the partition, members only from the board; 12: a pair's two parts clipped to the smaller norm, designees take the weighted robust mean of the groups' means (aggregation.py); 11: a two-tier cross stage with buckets (bucket designees, then the top bucket's; a peer reads two buckets), buckets the same every round; 10: ready peers pinged before the partition (silent records left out), BUSY asked again; 9: at least 4 pieces per member where each keeps 128K values (api.pieces_per_member); 5: uplink claims (ready records, views) and shares by them; 6: the cross stage's cutoff (out records), statements on request; 7: ready buckets (from the base state's population); 8: a slow member's audit copies relayed by its reducers (signed parts, pledges)


@dataclass
class PeerContext:
    spec: RunSpec
    numel: int
    codec: Codec
    link: Link
    identity: Identity  # the key of ``link``'s peer id: signs our statements
    trust: Trust
    bans: Bans
    behaviour: Behaviour
    ef: ErrorFeedback | None = None
    traffic: Traffic = field(default_factory=Traffic)
    run: str = ""  # the spec hash, hex: every message carries it
    protocol: str = ""  # the stream protocol name
    closed: bool = False  # nobody can dial us (peer/reach.py found out): we join groups as an outbound-only member
    rates: Rates = field(default_factory=Rates)  # our measured uplink, claimed in ready records and views

    def __post_init__(self) -> None:
        self.run = self.spec.spec_hash().hex()
        self.protocol = f"hivetrain/avg/{PROTOCOL_VERSION}/{self.run[:32]}"
        if self.link.me != self.identity.peer_id:
            raise ValueError("the link's peer id is not the identity's")

    @property
    def me(self) -> str:
        return self.identity.peer_id

    def header(self, kind: str, round_: int, base: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "run": self.run, "round": round_, "base": base, **fields}
