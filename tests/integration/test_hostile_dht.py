"""Hostile bytes at the DHT layer, sent by a raw hivemind node to a real peer process."""

from __future__ import annotations

import asyncio
import time

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import get_dht_time

from hivetrain.dht.hardening import nested_tuple_payload
from hivetrain.dht.identity import Identity
from hivetrain.dht.records import Envelope, encode_payload, heartbeat_key
from hivetrain.peer.averaging.context import PROTOCOL_VERSION
from hivetrain.peer.net.wire import Code


async def _attack(maddr: str, run_key: str) -> dict[str, object]:
    """A node without our validator tries: the nested-tuple payload as a dictionary value and as a
    subkey, and an overwrite of another peer's heartbeat."""
    attacker = await DHTNode.create(initial_peers=[maddr], client_mode=False)
    try:
        victim = PeerID.from_base58(maddr.rsplit("/", 1)[1])
        stub = attacker.protocol.get_stub(victim)
        key = DHTID.generate(source=heartbeat_key(run_key)).to_bytes()
        payload = nested_tuple_payload(200)
        results = {}
        for name, subkey, value in [("dict_value", b"", payload), ("subkey", payload, b"\x00")]:
            request = dht_pb2.StoreRequest(keys=[key], subkeys=[subkey], values=[value],
                                           expiration_time=[get_dht_time() + 30], in_cache=[False],
                                           peer=attacker.protocol.node_info)
            try:
                response = await stub.rpc_store(request, timeout=10)
                results[name] = list(response.store_ok)
            except Exception as e:  # an error reply is the right outcome too
                results[name] = type(e).__name__
        # a forged heartbeat: signed by the attacker, but placed under someone else's subkey
        liar, honest = Identity.generate(), Identity.generate()
        fields = dict(peer_id=honest.peer_id, round=99, state_hash="0" * 64, parent="0" * 64, throughput=1.0,
                      train_loss=None, eval_loss=None)
        forged = Envelope.sign(liar, "hb", heartbeat_key(run_key), encode_payload("hb", fields), time.time() + 30)
        results["overwrite"] = await attacker.store(heartbeat_key(run_key), forged.encode(), time.time() + 30,
                                                    subkey=honest.fingerprint)
        # the same claim under the liar's own subkey: well signed, but it names another libp2p id
        results["misattributed"] = await attacker.store(heartbeat_key(run_key), forged.encode(), time.time() + 30,
                                                        subkey=liar.fingerprint)
        return results
    finally:
        await attacker.shutdown()


def test_nested_tuples_and_forged_records_do_not_hurt_a_peer(swarm) -> None:
    peer = swarm("target", "--new-run", "hostile", "--sync-every", "2", "--matchmaking-timeout", "1")
    info = peer.wait_info()
    results = asyncio.run(_attack(info["maddrs"][0], info["run_key"]))
    # the peer refused every one of them and is alive; it goes on to complete rounds afterwards
    assert results["dict_value"] in ([False], "P2PHandlerError"), results
    assert results["subkey"] in ([False], "P2PHandlerError"), results
    assert results["overwrite"] is False, results
    assert results["misattributed"] is False, results
    before = len(peer.records())
    deadline = time.monotonic() + 60
    while len(peer.records()) < before + 2:
        assert peer.proc.poll() is None, f"the peer died:\n{peer.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the peer stopped training after the attack"
        try:
            peer.proc.wait(0.2)
        except Exception:
            pass
    assert "Segmentation" not in peer.log.read_text()


async def _frames(maddr: str, spec_hash: str) -> dict[str, object]:
    """Raw frames on the averaging protocol from a libp2p peer that is not part of the run."""
    from hivemind.p2p import P2P

    from hivetrain.peer.net.wire import MAGIC, MAX_HEADER, PREFIX, read_frame

    attacker = await P2P.create(initial_peers=[maddr])
    handler = f"hivetrain/avg/{PROTOCOL_VERSION}/{spec_hash[:32]}"
    victim = PeerID.from_base58(maddr.rsplit("/", 1)[1])
    out: dict[str, object] = {}
    try:
        for name, frame in [
            ("oversized_header", PREFIX.pack(MAGIC, MAX_HEADER + 1, 0)),  # claims more than the cap, sends nothing
            ("oversized_body", PREFIX.pack(MAGIC, 8, 1 << 40)),  # a 1 TiB body for a part
            ("bad_magic", b"EVIL" + bytes(12)),
        ]:
            deadline = time.monotonic() + 60
            while True:  # the handler is registered once the peer has built its model: wait for it
                try:
                    _, reader, writer = await attacker.call_binary_stream_handler(victim, handler)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            writer.write(frame)
            await writer.drain()
            reply, _ = await read_frame(reader, 10.0, 0)  # answered at once: it does not wait for the claimed bytes
            out[name] = (reply["type"], reply["code"], reply["reason"])
            writer.close()
    finally:
        await attacker.shutdown()
    return out


def test_oversized_frames_are_refused_before_reading(swarm) -> None:
    peer = swarm("target", "--new-run", "frames", "--sync-every", "2", "--matchmaking-timeout", "1")
    info = peer.wait_info()
    results = asyncio.run(_frames(info["maddrs"][0], info["spec_hash"]))
    malformed = ("ack", Code.MALFORMED)
    assert results["oversized_header"][:2] == malformed and "exceeds" in results["oversized_header"][2], results
    assert results["oversized_body"][:2] == malformed and "exceeds" in results["oversized_body"][2], results
    assert results["bad_magic"][:2] == malformed and "magic" in results["bad_magic"][2], results
    before = len(peer.records())
    deadline = time.monotonic() + 60
    while len(peer.records()) < before + 2:  # and it goes on training
        assert peer.proc.poll() is None, f"the peer died:\n{peer.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the peer stopped training after the frames"
        time.sleep(0.2)


async def _forge_spec(maddr: str, run_key: str) -> dict[str, object]:
    """A node without our validator stores run specs for someone else's run: under the owner's
    subkey with its own signature, and under its own subkey."""
    from hivetrain.dht.records import spec_key
    from hivetrain.peer.config import RunSpec

    attacker = await DHTNode.create(initial_peers=[maddr], client_mode=False)
    try:
        liar = Identity.generate()
        name, owner_fp = run_key.split(".")
        evil = RunSpec.from_preset(name, "tiny", outer_lr=9.0)
        out: dict[str, object] = {}
        for label, subkey in [("as_owner", owner_fp), ("as_itself", liar.fingerprint)]:
            forged = Envelope.sign(liar, "spec", spec_key(run_key), evil.encode(), time.time() + 600)
            out[label] = await attacker.store(spec_key(run_key), forged.encode(), time.time() + 600, subkey=subkey)
        return out
    finally:
        await attacker.shutdown()


def test_forged_run_spec_is_refused_and_joiners_get_the_owners(swarm) -> None:
    owner = swarm("owner", "--new-run", "forged", "--sync-every", "2", "--until-round", "3",
                  "--wait-for-peers", "2", "--quiet")
    info = owner.wait_info()
    results = asyncio.run(_forge_spec(info["maddrs"][0], info["run_key"]))
    assert results == {"as_owner": False, "as_itself": False}, results
    joiner = swarm("joiner", "--run", info["run_key"], "--initial-peers", info["maddrs"][0],
                   "--until-round", "3", "--wait-for-peers", "2", "--quiet")
    assert joiner.wait(240) == 0 and owner.wait(120) == 0, joiner.log.read_text()[-3000:]
    assert joiner.wait_info()["spec_hash"] == info["spec_hash"]
    last = [p.records()[-1] for p in (owner, joiner)]
    assert last[0]["state_hash"] == last[1]["state_hash"] and not last[1]["void"], last
