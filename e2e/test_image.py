"""The container image `make image` builds (deploy/image/build.sh), run as Kubernetes runs it,
without a container runtime: its layers unpacked by umoci, then a broker and an agent, each in
a mount namespace of its own (`unshare --mount`), chrooted into that root bind-mounted
read-only, as the image's user (10001:10001), with the image's environment and the charts'
jemalloc variables, a tmpfs on /tmp, the config read-only at /etc/gpufed and a writable data
directory at /var/lib/gpufed; the network is the host's loopback. A job submitted over HTTP
from the host runs to Succeeded on the image's simulated cluster.

Slow (a build): `make image-test` builds the image and runs this; `make test` leaves it out
(marker `image`). It needs root, umoci and unshare: where any is missing, or no image is built,
it skips with one line, except where `GPUFED_REQUIRE_IMAGE=1` (CI), where it fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import pytest

from e2e.helpers import wait_for
from gpufed import client
from gpufed.local import processes
from tests.builders import make_job

pytestmark = [pytest.mark.image, pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
LAYOUT = Path(os.environ.get("GPUFED_IMAGE_LAYOUT", REPO / "build" / "image" / "oci"))
TAG = (
    os.environ.get("GPUFED_IMAGE_TAG")
    or tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
)
IMAGE = f"{LAYOUT}:{TAG}"
# what both charts set with `allocator: jemalloc` (deploy/helm/*/templates/deployment.yaml)
JEMALLOC_ENV = {
    "PYTHONMALLOC": "malloc",
    "LD_PRELOAD": "/usr/local/lib/libjemalloc.so.2",
    "MALLOC_CONF": "background_thread:true,dirty_decay_ms:5000,muzzy_decay_ms:0",
}
H100 = "NVIDIA-H100-80GB-HBM3"

# A container without a runtime: $1 the rootfs, $2 the config (read-only at /etc/gpufed), $3
# the data directory (/var/lib/gpufed), $4 uid:gid; then VAR=value ... and the command, which
# the image's own env(1) runs with only those variables.
SANDBOX = r"""
root=$1 config=$2 data=$3 user=$4; shift 4
mount --bind "$root" "$root"
mount -o remount,bind,ro "$root"
mount -t tmpfs -o mode=1777,size=64m tmpfs "$root/tmp"
mount --bind "$config" "$root/etc/gpufed"
mount -o remount,bind,ro "$root/etc/gpufed"
mount --bind "$data" "$root/var/lib/gpufed"
mount --rbind /dev "$root/dev"
mount -t proc proc "$root/proc"
exec chroot --userspec="$user" "$root" /usr/bin/env -i "$@"
"""


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("GPUFED_REQUIRE_IMAGE") == "1":
        pytest.fail(f"{reason}, and GPUFED_REQUIRE_IMAGE=1")
    pytest.skip(reason)


def read_blob(digest: str) -> dict[str, Any]:
    algorithm, value = digest.split(":", 1)
    result: dict[str, Any] = json.loads((LAYOUT / "blobs" / algorithm / value).read_text())
    return result


def image_config() -> dict[str, Any]:
    """The OCI image config of IMAGE (its `config`: user, entrypoint, env...)."""
    if not (LAYOUT / "index.json").is_file():
        unavailable(f"no image at {LAYOUT} (make image)")
    for entry in json.loads((LAYOUT / "index.json").read_text())["manifests"]:
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") == TAG:
            config: dict[str, Any] = read_blob(read_blob(entry["digest"])["config"]["digest"])
            return config
    unavailable(f"no image tagged {TAG} in {LAYOUT} (make image)")


def dockerfile() -> dict[str, Any]:
    """member-agent/Dockerfile's ENV, USER, ENTRYPOINT and EXPOSE."""
    text = (REPO / "member-agent" / "Dockerfile").read_text().replace("\\\n", " ")
    found: dict[str, Any] = {"env": {}}
    for line in text.splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction == "ENV":
            found["env"].update(dict(re.findall(r"(\w+)=(\S+)", rest)))
        elif instruction == "USER":
            found["user"] = rest.strip()
        elif instruction == "ENTRYPOINT":
            found["entrypoint"] = json.loads(rest)
        elif instruction == "EXPOSE":
            found["expose"] = {f"{port}/tcp" for port in rest.split()}
    return found


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """IMAGE unpacked: `rootfs/` and the runtime spec umoci derives from the image
    (`config.json`: its process's user, env, args); removed afterwards (300 MB)."""
    if os.geteuid() != 0:
        unavailable("the image test needs root (umoci unpack, unshare --mount, chroot)")
    for tool in ("umoci", "unshare", "chroot"):
        if shutil.which(tool) is None:
            unavailable(f"the image test needs {tool} (apt-get install umoci util-linux)")
    image_config()  # skips (or fails) when there is no image
    path = tmp_path_factory.mktemp("image") / "bundle"
    subprocess.run(
        ["umoci", "unpack", "--image", IMAGE, str(path)], check=True, capture_output=True
    )
    for mount_point in ("etc/gpufed", "var/lib/gpufed", "dev"):  # as a runtime makes them
        (path / "rootfs" / mount_point).mkdir(parents=True, exist_ok=True)
    yield path
    shutil.rmtree(path)


def test_the_image_is_configured_as_the_dockerfile_says() -> None:
    """User, entrypoint, port and environment of the built image are the Dockerfile's, so the
    charts run either the same way."""
    config = image_config()["config"]
    wanted = dockerfile()
    assert config["User"] == wanted["user"] == "10001:10001"
    assert config["Entrypoint"] == wanted["entrypoint"]
    assert set(config["ExposedPorts"]) == wanted["expose"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert {name: env.get(name) for name in wanted["env"]} == wanted["env"]


def test_every_module_of_gpufed_has_its_bytecode_compiled(bundle: Path) -> None:
    """The root is read-only at run time: bytecode not compiled in the build would be
    compiled again by every process, every start."""
    site = next((bundle / "rootfs" / "opt" / "gpufed" / "lib").glob("python3.*/site-packages"))
    sources = [
        p
        for package in ("gpufed", "broker", "member_agent")
        for p in (site / package).rglob("*.py")
    ]
    assert len(sources) > 50, sources
    version = site.parent.name.removeprefix("python").replace(".", "")
    missing = [
        str(p.relative_to(site))
        for p in sources
        if not (p.parent / "__pycache__" / f"{p.stem}.cpython-{version}.pyc").is_file()
    ]
    assert missing == []


@contextlib.asynccontextmanager
async def contained(
    bundle: Path, name: str, argv: list[str], *, config: Path, data: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`argv` run in the image as the runtime spec says (user, env), with the charts' jemalloc
    variables; stopped (SIGTERM, then SIGKILL) on the way out, its output in `name`.log."""
    spec = json.loads((bundle / "config.json").read_text())["process"]
    user = f"{spec['user']['uid']}:{spec['user']['gid']}"
    env = [*spec["env"], *(f"{k}={v}" for k, v in JEMALLOC_ENV.items())]
    log = data.parent / f"{name}.log"
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-euc", SANDBOX, "sandbox",
            str(bundle / "rootfs"), str(config), str(data), user, *env, *argv,
            stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield process
    except BaseException:
        print(f"--- {name}:\n{log.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def wait_http(url: str, process: asyncio.subprocess.Process, *, timeout: float = 60) -> str:
    async with aiohttp.ClientSession() as session:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            assert process.returncode is None, f"{url}: the process exited {process.returncode}"
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url) as response:
                    if response.status == 200:
                        return await response.text()
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def status_ids(pid: int) -> dict[str, list[str]]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return {key: fields[key].split() for key in ("Uid", "Gid", "Groups")}


def root_mount_options(pid: int) -> list[str]:
    """The options of the mount the process sees at / (mountinfo field 6)."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            return fields[5].split(",")
    raise AssertionError(f"no / in the mountinfo of {pid}")


@pytest.fixture
def volumes(tmp_path: Path) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """The config directory (tokens, the agent's token, its cluster), the data directory
    (the broker's user owns it), and the tokens by name."""
    config, data = tmp_path / "config", tmp_path / "data"
    config.mkdir(mode=0o755)
    data.mkdir(mode=0o700)
    os.chown(data, 10001, 10001)
    tokens = {"team-a": "image-team-a", "agent:h100": "image-agent-h100", "admin": "image-admin"}
    (config / "tokens.yaml").write_text(
        json.dumps(
            {
                "tokens": [
                    {"token": tokens["team-a"], "tenant": "team-a"},
                    {"token": tokens["agent:h100"], "agent": "h100"},
                    {"token": tokens["admin"], "admin": True},
                ]
            }
        )
    )
    (config / "h100.token").write_text(tokens["agent:h100"] + "\n")
    shutil.copy(processes.config_dir() / "clusters" / "h100.yaml", config / "h100.yaml")
    for path in config.iterdir():
        path.chmod(0o644)
    yield config, data, tokens


async def test_a_broker_and_an_agent_of_the_image_run_a_job_to_succeeded(
    bundle: Path, volumes: tuple[Path, Path, dict[str, str]]
) -> None:
    config, data, tokens = volumes
    port, metrics_port = processes.free_port(), processes.free_port()
    url = f"http://127.0.0.1:{port}"
    entrypoint = json.loads((bundle / "config.json").read_text())["process"]["args"]
    assert entrypoint[:2] == ["gpufed", "agent"], entrypoint
    broker_argv = [  # as the broker chart: command gpufed, args broker ...
        "gpufed", "broker", "--host", "127.0.0.1", "--port", str(port),
        "--store", "sqlite:////var/lib/gpufed/broker.db", "--tokens", "/etc/gpufed/tokens.yaml",
        "--heartbeat", "0.5",
    ]  # fmt: skip
    agent_argv = [  # as the agent chart: the entrypoint, then its args
        *entrypoint, "--backend", "simulated", "--nodes", "/etc/gpufed/h100.yaml",
        "--broker", url, "--cluster", "h100", "--token-file", "/etc/gpufed/h100.token",
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    async with (
        contained(bundle, "broker", broker_argv, config=config, data=data) as broker,
        contained(bundle, "agent", agent_argv, config=config, data=data) as agent,
    ):
        await wait_http(f"{url}/readyz", broker)
        assert "gpufed" in await wait_http(f"http://127.0.0.1:{metrics_port}/metrics", agent)
        async with client.BrokerClient(url, tokens["team-a"]) as api:
            job = make_job("from-the-image", gpus=8).model(H100).gang(2).duration(0.5)
            job_id = (await api.submit(json.dumps(job.document())))["id"]
            done = await wait_for(api, job_id, {"Succeeded", "Failed", "Cancelled"}, timeout=60)
        assert done["status"]["state"] == "Succeeded", done["status"]

        # the processes themselves (the sandbox execs into them): python, as the image's user,
        # on a read-only root, jemalloc preloaded from where the charts say
        for name, process in [("broker", broker), ("agent", agent)]:
            ids = status_ids(process.pid)
            assert ids["Uid"] == ["10001"] * 4 and ids["Gid"] == ["10001"] * 4, (name, ids)
            assert set(ids["Groups"]) <= {"10001"}, (name, ids)
            assert "ro" in root_mount_options(process.pid), name
            libraries = {
                line.rsplit("/", 1)[-1]
                for line in Path(f"/proc/{process.pid}/maps").read_text().splitlines()
            }
            assert "libjemalloc.so.2" in libraries, f"{name}: no jemalloc among {sorted(libraries)}"
        assert (data / "broker.db").is_file()  # the store is on the data volume
