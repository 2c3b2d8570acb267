"""A real Mooncake store on loopback for the CPU tests and the scripts: ``mooncake_master`` (with its
built-in HTTP metadata server) and one ``mooncake_client`` process that mounts the memory the
objects live in.

Why a separate storage process: a Mooncake object's bytes live in the memory segments that clients
mount (``global_segment_size``), not in the master. A server whose HiCache client mounted the
segment takes its objects with it when it is drained, so the tier that outlives a server is a
storage node of its own; each server's HiCache then mounts nothing (``global_segment_size`` 0) and
only reads and writes.

Both binaries come with the ``mooncake-transfer-engine-non-cuda`` wheel (``requirements/mooncake.txt``)
and need ``libibverbs.so.1`` (Debian's ``libibverbs1``) even with the TCP transport. When either
cannot start, :func:`start` raises :class:`MooncakeUnavailable` with the command and its output, so
a test can skip with the exact reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HOST = "127.0.0.1"
_START_S = 30.0


class MooncakeUnavailable(RuntimeError):
    """The Mooncake package or one of its processes cannot run here; the message says why."""


def _free_port() -> int:
    """A TCP port nothing listens on now (the kernel's choice on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


def binary(name: str) -> Path:
    """The path of one of the wheel's executables (``mooncake_master``, ``mooncake_client``): it
    ships them inside the ``mooncake`` package; its console scripts only ``exec`` them."""
    try:
        import mooncake
    except ImportError as e:
        raise MooncakeUnavailable(
            f"the mooncake package is not installed ({e}): requirements/mooncake.txt"
        ) from e
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise MooncakeUnavailable(f"{name} is not in the mooncake package nor on PATH")
        path = Path(found)
    if not os.access(path, os.X_OK):  # pip keeps the wheel's mode; a --target install may not
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    """Wait until ``port`` accepts a connection, or raise with the process's output if it died."""
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise MooncakeUnavailable(
                f"{what} exited with {proc.returncode}: {' '.join(map(str, proc.args))}\n"  # type: ignore[arg-type]
                + log.read_text(errors="replace")[-2000:]
            )
        with contextlib.suppress(OSError), socket.create_connection((_HOST, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise MooncakeUnavailable(f"{what} did not listen on {_HOST}:{port} within {_START_S:.0f} s")


@dataclass
class MooncakeStore:
    """A running master, its HTTP metadata server and one storage node, all on loopback.

    ``extra_config`` is what each server passes to ``--hicache-storage-backend-extra-config`` (and
    the CPU harness to sglang's ``MooncakeStore``). ``soft_pin_ttl_ms`` and ``lease_ttl_ms`` are the
    master's ``-default_kv_soft_pin_ttl`` and ``-default_kv_lease_ttl``; the master is started with
    ``-allow_evict_soft_pinned_objects=false`` so that a soft pin is a guarantee until its deadline
    (``spec/storage/StorageTier.tla``, ``Tier = "mooncake"``), not only an eviction priority."""

    segment_bytes: int = 64 << 20
    soft_pin_ttl_ms: int = 30 * 60 * 1000
    lease_ttl_ms: int = 200
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="toolkv-mooncake-")))
    rpc_port: int = 0
    metadata_port: int = 0
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def master_address(self) -> str:
        return f"{_HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{_HOST}:{self.metadata_port}/metadata"

    def extra_config(self, **more: Any) -> dict[str, Any]:
        """sglang's mooncake backend config for a server that only reads and writes (it mounts no
        memory: ``global_segment_size`` 0; the storage node holds the objects)."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "device_name": "",
            "local_hostname": _HOST,
            "global_segment_size": 0,
            "check_server": False,
            **more,
        }

    def extra_config_json(self, **more: Any) -> str:
        return json.dumps(self.extra_config(**more))

    def _spawn(self, args: list[str], name: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.workdir / f"{name}.log"
        out = log.open("wb")
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir)
        self._procs.append(proc)
        return proc, log

    def start_master(self) -> None:
        """Start ``mooncake_master`` (RPC, HTTP metadata server, admin port all on loopback)."""
        self.rpc_port = self.rpc_port or _free_port()
        self.metadata_port = self.metadata_port or _free_port()
        args = [
            str(binary("mooncake_master")),
            f"-rpc_port={self.rpc_port}",
            f"-rpc_address={_HOST}",
            "-rpc_thread_num=2",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={_HOST}",
            f"-http_metadata_server_port={self.metadata_port}",
            f"-metrics_port={_free_port()}",
            f"-default_kv_lease_ttl={self.lease_ttl_ms}",
            f"-default_kv_soft_pin_ttl={self.soft_pin_ttl_ms}",
            "-allow_evict_soft_pinned_objects=false",
            "-enable_metric_reporting=false",
        ]
        proc, log = self._spawn(args, "master")
        _wait_port(self.rpc_port, proc, log, "mooncake_master")
        _wait_port(self.metadata_port, proc, log, "mooncake_master's HTTP metadata server")

    def start_storage_node(self) -> None:
        """Start one ``mooncake_client`` that mounts ``segment_bytes`` of memory for the objects."""
        port = _free_port()
        args = [
            str(binary("mooncake_client")),
            f"-host={_HOST}",
            f"-port={port}",
            f"-global_segment_size={self.segment_bytes}",
            f"-master_server_address={self.master_address}",
            f"-metadata_server={self.metadata_server}",
            "-protocol=tcp",
        ]
        proc, log = self._spawn(args, "storage-node")
        _wait_port(port, proc, log, "mooncake_client")
        self._await_capacity(proc, log)

    def _await_capacity(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        """The node's segment is mounted once the master reports capacity (its log says so)."""
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise MooncakeUnavailable(
                    f"mooncake_client exited with {proc.returncode}\n" + log.read_text()[-2000:]
                )
            text = log.read_text(errors="replace")
            if "mount" in text.lower() or "Successfully" in text:
                return
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every process this object started (its own, by pid), newest first."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()

    def restart_master(self) -> None:
        """Kill the master and start it again on the same ports (a fault: its objects are gone;
        the storage node re-registers its segment)."""
        master = self._procs[0]
        master.terminate()
        master.wait(timeout=10)
        self._procs.remove(master)
        self.start_master()
        self._procs.insert(0, self._procs.pop())


@contextlib.contextmanager
def running(**kw: Any) -> Iterator[MooncakeStore]:
    """A started master and storage node; stopped at the end, whatever happens."""
    store = MooncakeStore(**kw)
    try:
        store.start_master()
        store.start_storage_node()
        yield store
    finally:
        store.stop()


def main() -> None:
    """``python -m toolkv.testing.mooncake``: start the master and one storage node on loopback,
    print the flags each sglang server takes to use them, and keep them up until interrupted."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--segment-mb", type=int, default=1024, help="the storage node's memory (MiB)")
    ap.add_argument("--soft-pin-ttl-ms", type=int, default=30 * 60 * 1000)
    args = ap.parse_args()
    with running(segment_bytes=args.segment_mb << 20, soft_pin_ttl_ms=args.soft_pin_ttl_ms,
                 lease_ttl_ms=10_000) as store:  # fmt: skip
        print("--hicache-storage-backend mooncake --hicache-mem-layout page_first "
              f"--hicache-storage-backend-extra-config '{store.extra_config_json()}'", flush=True)  # fmt: skip
        print(f"logs: {store.workdir}", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})  # then the context stops both processes


if __name__ == "__main__":
    main()
