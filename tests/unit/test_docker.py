"""docker/: what can be checked without a Docker daemon (there is none on these machines): every
path the image copies exists and is not ignored, the state folder is a volume, and every command
the compose swarm runs is one `peer` accepts."""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

import yaml

from hivetrain.peer.cli import build_parser
from hivetrain.peer.dashboard import parse_bind

ROOT = Path(__file__).resolve().parents[2]
KEY, MADDR = "compose." + "a" * 32, "/ip4/172.28.0.10/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def _ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and p[0] != "#"]
    return any(fnmatch.fnmatch(path, p.rstrip("/")) or path.startswith(p.rstrip("/") + "/") for p in patterns)


def test_the_image_copies_what_exists_and_keeps_its_state_in_a_volume() -> None:
    lines = (ROOT / "docker" / "Dockerfile").read_text().splitlines()
    copied = [word for line in lines if line.startswith("COPY ") for word in line.split()[1:-1]]
    assert {"peer", "dht", "kernels", "pyproject.toml"} <= set(copied)
    for path in copied:
        assert (ROOT / path).exists() and not _ignored(path), path
    assert 'VOLUME ["/data"]' in lines and "ENV XDG_DATA_HOME=/data" in lines
    assert any("download.pytorch.org/whl/cpu" in line for line in lines)  # the CPU wheel, not the CUDA build
    assert 'ENTRYPOINT ["peer"]' in lines
    assert subprocess.run(["sh", "-n", str(ROOT / "docker" / "join.sh")]).returncode == 0


def test_every_command_of_the_compose_swarm_is_one_peer_accepts() -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"owner", "peer1", "peer2"}
    parser = build_parser()
    for name, service in services.items():
        command = service["command"]
        if service.get("entrypoint") == ["/opt/hivetrain/docker/join.sh"]:  # join.sh adds the run and the address
            command = ["start", "--run", KEY, "--initial-peers", MADDR, *command]
        args = parser.parse_args(command)
        assert args.command == "start" and args.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"], name
        assert any(v.endswith(":/data") for v in service["volumes"]), name  # its own state folder
        address = service["networks"]["swarm"]["ipv4_address"]
        assert args.announce_maddrs == [f"/ip4/{address}/tcp/31337"], name
    owner = parser.parse_args(services["owner"]["command"])
    assert owner.info_file == "/shared/owner.json" and owner.new_run
    assert parse_bind(owner.dashboard, owner.dashboard_public) == ("0.0.0.0", 8080)
    assert services["owner"]["ports"] == ["127.0.0.1:8080:8080"]  # published on the host's loopback only
