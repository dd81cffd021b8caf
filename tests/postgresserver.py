"""A real PostgreSQL server on this machine for tests and benchmarks (never a mock).

Where it comes from, the first that works:

1. `GPUFED_POSTGRES_URL`: a server someone already runs (it is only used, never stopped);
2. the `pgserver` wheel (the test extras, Linux x86_64): PostgreSQL 16 in a folder of ours, no
   root needed (run as root, it runs the server as a `pgserver` user it creates);
3. `initdb` and `pg_ctl` on PATH, else Debian's `/usr/lib/postgresql/*/bin` (CI installs
   Debian's `postgresql`): a cluster in a folder of ours on a Unix socket only, with fsync
   off; as root it runs as `nobody` (`runuser`), since initdb refuses root.

`GPUFED_POSTGRES=pgserver` or `=binaries` insists on one of 2 and 3. Each user of the server
takes a schema of its own (`PostgresServer.dsn(schema)`): the server is shared by a session.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

URL_VARIABLE = "GPUFED_POSTGRES_URL"
WHICH_VARIABLE = "GPUFED_POSTGRES"
REQUIRE_VARIABLE = "GPUFED_REQUIRE_POSTGRES"
TMPFS = Path("/dev/shm")
START_TIMEOUT = 30
HOW_TO_GET_ONE = (
    "no PostgreSQL server for the history tests: `pip install -e '.[test]'` (brings pgserver) or"
    " `apt-get install postgresql`, or set GPUFED_POSTGRES_URL"
)


class PostgresNotFoundError(RuntimeError):
    """Neither a URL, nor pgserver, nor PostgreSQL's binaries."""


class PostgresStartError(RuntimeError):
    """A server was found but did not start."""


@dataclass
class PostgresServer:
    url: str  # the `postgres` database, as asyncpg reads a URL
    source: str  # where it came from: url, pgserver or the binaries' folder
    stop: Callable[[], None] = field(default=lambda: None, repr=False)

    def dsn(self, schema: str | None = None) -> str:
        """The URL with `search_path` set to `schema` (created by the caller)."""
        if schema is None:
            return self.url
        return f"{self.url}{'&' if '?' in self.url else '?'}search_path={schema}"

    @staticmethod
    def new_schema_name() -> str:
        return f"t_{uuid.uuid4().hex[:16]}"


def required() -> bool:
    """Whether a missing server fails the run (CI) instead of skipping its tests."""
    return os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0")


def start(root: Path | None = None) -> PostgresServer:
    """A running server; PostgresNotFoundError (HOW_TO_GET_ONE) if none can be had.

    `root` holds the data (a temporary folder, on tmpfs when there is one, by default).
    """
    url = os.environ.get(URL_VARIABLE)
    if url:
        return PostgresServer(url, "url")
    which = os.environ.get(WHICH_VARIABLE, "")
    problems = []
    if which in ("", "pgserver"):
        try:
            return start_pgserver(root)
        except (ImportError, PostgresStartError) as exc:
            problems.append(f"pgserver: {exc}")
    if which in ("", "binaries"):
        try:
            return start_binaries(root)
        except (PostgresNotFoundError, PostgresStartError) as exc:
            problems.append(str(exc))
    tried = f" (tried: {'; '.join(problems)})" if problems else ""
    raise PostgresNotFoundError(f"{HOW_TO_GET_ONE}{tried}")


def make_root(root: Path | None) -> Path:
    parent = TMPFS if TMPFS.is_dir() and os.access(TMPFS, os.W_OK) else None
    if root is None:
        return Path(tempfile.mkdtemp(prefix="gpufed-pg-", dir=parent))
    root.mkdir(parents=True, exist_ok=True)
    return root


def start_pgserver(root: Path | None) -> PostgresServer:
    with warnings.catch_warnings():  # platformdirs warns of no XDG_RUNTIME_DIR at import
        warnings.simplefilter("ignore")
        import pgserver
    folder = make_root(root)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = pgserver.get_server(folder / "pgdata", cleanup_mode="stop")
    except Exception as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise PostgresStartError(f"{type(exc).__name__}: {exc}") from exc

    def stop() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server.cleanup()
        if root is None:
            shutil.rmtree(folder, ignore_errors=True)

    return PostgresServer(server.get_uri(), "pgserver", stop)


def find_binaries() -> Path:
    """The folder of `initdb` and `pg_ctl`: PATH first, else Debian's newest."""
    on_path = shutil.which("initdb")
    if on_path is not None and shutil.which("pg_ctl") is not None:
        return Path(on_path).resolve().parent
    debian = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0,
    )
    if debian:
        return Path(debian[-1]).parent
    raise PostgresNotFoundError("no initdb/pg_ctl on PATH nor in /usr/lib/postgresql/*/bin")


def start_binaries(root: Path | None) -> PostgresServer:
    binaries = find_binaries()
    folder = make_root(root)
    data, log = folder / "data", folder / "server.log"
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: the server runs as nobody
        if shutil.which("runuser") is None:
            raise PostgresStartError("running as root and no runuser to start PostgreSQL as nobody")
        as_user = ["runuser", "-u", "nobody", "--"]
        shutil.chown(folder, "nobody")
        folder.chmod(0o700)
    options = f"-k {folder} -c listen_addresses='' -F -c max_connections=100"

    def run(*args: str) -> None:
        done = subprocess.run(
            [*as_user, *args],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT + 10,
            cwd=folder,
            check=False,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise PostgresStartError(f"{Path(args[0]).name} ({binaries}): {' / '.join(tail)}")

    try:
        initdb = str(binaries / "initdb")
        run(initdb, "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
        pg_ctl = [str(binaries / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options]
        run(*pg_ctl, "-w", "-t", str(START_TIMEOUT), "start")
    except (PostgresStartError, OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise PostgresStartError(str(exc)) from exc

    def stop() -> None:
        with contextlib.suppress(PostgresStartError, OSError, subprocess.TimeoutExpired):
            run(str(binaries / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        if root is None:
            shutil.rmtree(folder, ignore_errors=True)

    return PostgresServer(f"postgresql://postgres@/postgres?host={folder}", str(binaries), stop)
