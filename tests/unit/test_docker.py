"""docker/: what can be checked without a Docker daemon (there is none on these machines): every
path the image copies exists and is not ignored, the state folder is a volume, every path a
container mounts is made and owned by the image's user, and every command the compose swarm runs
is one `peer` accepts."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import yaml

from hivetrain.peer import flags
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
        if service.get("entrypoint") == ["/opt/hivetrain/docker/join.sh"]:  # join.sh adds the join string
            command = ["start", "--join", f"hivetrain://{KEY}@{MADDR}", *command]
        args = parser.parse_args(command)
        assert args.command == "start" and flags.listen_on(args) == ["/ip4/0.0.0.0/tcp/31337"], name
        assert service["restart"] == "unless-stopped" and "31337" in " ".join(service["healthcheck"]["test"]), name
        assert any(v.endswith(":/data") for v in service["volumes"]), name  # its own state folder
        address = service["networks"]["swarm"]["ipv4_address"]
        assert args.announce_maddrs == [f"/ip4/{address}/tcp/31337"], name
    owner = parser.parse_args(services["owner"]["command"])
    assert owner.info_file == "/shared/owner.json" and owner.new_run
    assert owner.dashboard_private and not owner.dashboard_public  # its own data, to the host's loopback
    assert parse_bind(owner.dashboard, owner.dashboard_public, owner.dashboard_private) == ("0.0.0.0", 8080)
    assert services["owner"]["ports"] == ["127.0.0.1:8080:8080"]  # published on the host's loopback only


def _user_and_owned(lines: list[str]) -> tuple[str, set[str]]:
    """The Dockerfile's USER, and the paths its RUN lines make (mkdir -p) and give to that user (chown)."""
    user = next(line.split()[1] for line in lines if line.startswith("USER "))
    text = " ".join(line.rstrip("\\") for line in lines)
    made = {p for m in re.finditer(r"mkdir -p ((?:/[\w/.-]+ ?)+)", text) for p in m.group(1).split()}
    owned = {p for m in re.finditer(rf"chown {user}:{user} ((?:/[\w/.-]+ ?)+)", text) for p in m.group(1).split()}
    return user, made & owned


def test_the_images_user_can_write_every_path_a_container_mounts() -> None:
    """A named volume takes its owner from the image's folder: a mount point the image does not make
    and give to its user is root's, and the peer (not root) cannot write there (/shared was)."""
    user, owned = _user_and_owned((ROOT / "docker" / "Dockerfile").read_text().splitlines())
    assert user == "peer"
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    mounted = {v.split(":")[1] for service in compose["services"].values() for v in service["volumes"]}
    assert mounted == {"/data", "/shared"} and mounted <= owned, (mounted, owned)
    assert 'HEALTHCHECK' in (ROOT / "docker" / "Dockerfile").read_text()


def test_the_gpu_variant_builds_the_cuda_wheel_and_reserves_the_gpus_of_every_peer() -> None:
    base = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    gpu = yaml.safe_load((ROOT / "docker" / "compose.gpu.yaml").read_text())
    assert set(gpu["services"]) == set(base["services"])
    for service in gpu["services"].values():
        assert "whl/cu" in service["build"]["args"]["TORCH_INDEX"]
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "--device" not in " ".join(str(c) for s in base["services"].values() for c in s["command"])  # auto
