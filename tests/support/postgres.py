"""A throwaway PostgreSQL server for tests: Debian's ``postgresql`` package, on 127.0.0.1.

The fixtures in ``tests/conftest.py`` wrap this module: ``pg_server`` (one server per test session)
and ``pg_database`` (a fresh database per test, dropped afterwards)::

    def test_something(pg_database):
        pg_database.url                      # postgresql://dagster:dagster@127.0.0.1:PORT/t_xxx (psql, libpq)
        pg_database.sqlalchemy_url           # postgresql+psycopg2://... (SQLAlchemy, Optuna)
        pg_database.dagster_storage_yaml()   # the `storage:` section of a dagster.yaml (dagster-postgres)

* The server: ``initdb`` into a fresh directory under the system temp dir, started with ``pg_ctl`` on a
  free port (``fsync`` off: a test server), stopped (``-m immediate``) and deleted at the end.
* Not installed: ``apt-get install postgresql`` when running as root with apt-get (what CI does;
  ``make system-deps`` does the same), unless ``CAMPAIGN_TESTS_NO_APT=1``. Otherwise, or when that
  fails, :class:`PostgresUnavailable` says why (the fixtures skip with that reason).
* As root: the server refuses to run as root, so ``initdb`` and ``pg_ctl`` run as the ``postgres``
  user the Debian package creates (``runuser``), on a directory owned by it. The directory is not
  under pytest's ``tmp_path`` (``/tmp/pytest-of-root`` is 0700: ``postgres`` cannot enter it). Client
  tools (``createdb``, ``psql``) connect over TCP as the current user.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

USER, PASSWORD = "dagster", "dagster"
APT_TIMEOUT_S = 600
START_TIMEOUT_S = 60
NO_APT_ENV = "CAMPAIGN_TESTS_NO_APT"
# SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; dagster-postgres installs psycopg2
SCHEME = "postgresql+psycopg2"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be started here; the message says why."""


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[4]))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")  # a non-Debian install on PATH
    return Path(pg_ctl).parent if pg_ctl else None


def ensure_installed() -> Path:
    """The directory holding initdb and pg_ctl; installs Debian's postgresql when it can."""
    bin_dir = _bin_dir()
    if bin_dir:
        return bin_dir
    if os.environ.get(NO_APT_ENV) == "1":
        raise PostgresUnavailable(
            f"PostgreSQL is not installed and {NO_APT_ENV}=1: run `apt-get install -y postgresql`"
        )
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PostgresUnavailable(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/pg_ctl) and cannot be "
            "installed here ("
            + ("not root" if os.geteuid() != 0 else "no apt-get")
            + "): run `apt-get install -y postgresql` or `make system-deps` as root"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "postgresql"],
    ):
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise PostgresUnavailable(f"`{' '.join(cmd)}` timed out after {APT_TIMEOUT_S} s") from None
        if r.returncode != 0:
            raise PostgresUnavailable(
                f"`{' '.join(cmd)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}"
            )
    bin_dir = _bin_dir()
    if not bin_dir:
        raise PostgresUnavailable("apt-get installed postgresql but no /usr/lib/postgresql/*/bin/pg_ctl is there")
    return bin_dir


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable("running as root, and there is no `postgres` user to run the server as") from None
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *argv]
    return ["su", "-s", "/bin/sh", "postgres", "-c", shlex.join(argv)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class PgServer:
    host: str
    port: int
    user: str
    password: str
    bin_dir: Path
    root: Path
    timings: dict

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{db}"

    def _client(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin_dir / tool), "-h", self.host, "-p", str(self.port), "-U", self.user, *args],
            env=dict(os.environ, PGPASSWORD=self.password),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    def create_database(self, name: str | None = None) -> PgDatabase:
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        self._client("createdb", name)
        return PgDatabase(self, name)

    def drop_database(self, name: str) -> None:
        # a Dagster instance may still hold pooled connections: force them out (PostgreSQL >= 13)
        self._client(
            "psql", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
        )


@dataclasses.dataclass
class PgDatabase:
    server: PgServer
    name: str

    @property
    def url(self) -> str:
        return self.server.url(self.name)

    @property
    def sqlalchemy_url(self) -> str:
        return self.url.replace("postgresql://", f"{SCHEME}://", 1)

    def dagster_storage_yaml(self) -> str:
        """The ``storage:`` section of a dagster.yaml for this database (dagster-postgres), with
        ``scheme: postgresql+psycopg2`` (SQLAlchemy 2.1's default driver for ``postgresql`` is psycopg 3)."""
        s = self.server
        return (
            f"storage:\n  postgres:\n    postgres_db:\n      hostname: {s.host}\n      port: {s.port}\n"
            f"      username: {s.user}\n      password: {s.password}\n      db_name: {self.name}\n"
            f"      scheme: {SCHEME}\n"
        )


def start_server() -> tuple[PgServer, Callable[[], None]]:
    """Start a server; returns it and the function that stops and deletes it."""
    bin_dir = ensure_installed()
    timings: dict = {}
    root = Path(tempfile.mkdtemp(prefix="campaign-pg-"))  # in the system temp dir (1777): `postgres` can enter
    data, sock, log, pwfile = root / "data", root / "sock", root / "server.log", root / "pwfile"
    sock.mkdir()
    pwfile.write_text(PASSWORD + "\n")
    if os.geteuid() == 0:
        for p in (root, sock, pwfile):
            shutil.chown(p, "postgres", "postgres")
    t = time.perf_counter()
    r = subprocess.run(
        _as_server_user(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                USER,
                f"--pwfile={pwfile}",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    timings["initdb_s"] = round(time.perf_counter() - t, 2)
    if r.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise PostgresUnavailable(f"initdb failed: {(r.stderr or r.stdout).strip()[-800:]}")

    def stop() -> None:
        subprocess.run(
            _as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(root, ignore_errors=True)

    last = ""
    for _attempt in range(3):  # a free port can be taken between probing and binding
        port = _free_port()
        opts = (
            f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={sock} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        t = time.perf_counter()
        r = subprocess.run(
            _as_server_user(
                [
                    str(bin_dir / "pg_ctl"),
                    "-D",
                    str(data),
                    "-l",
                    str(log),
                    "-o",
                    opts,
                    "-w",
                    "-t",
                    str(START_TIMEOUT_S),
                    "start",
                ]
            ),
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S + 30,
        )
        timings["start_s"] = round(time.perf_counter() - t, 2)
        if r.returncode == 0:
            return PgServer("127.0.0.1", port, USER, PASSWORD, bin_dir, root, timings), stop
        last = (log.read_text()[-800:] if log.exists() else "") or r.stderr
    stop()
    raise PostgresUnavailable(f"the PostgreSQL server did not start: {last.strip()}")
