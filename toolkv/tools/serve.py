"""``toolkv serve``: an sglang-compatible server on CPU (a stand-in model over sglang's real caches
and toolkv's real HTTP app), for trying the agent example, the client and ``toolkv doctor``
without a GPU. What is real and what is not: :mod:`toolkv.twin.serve`.

Exit status: 0 after Ctrl-C; 2 for a usage error, a port already in use, or a ``TOOLKV_*`` setting
the plugin would refuse (one line each).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from toolkv.argtypes import floats, ints
from toolkv.errors import InputError

DEFAULT_PORT = 30000  # sglang's own default port: the examples' --base-url default
port = ints(0, 65535)
device_tokens = ints(1024, 4_194_304)
host_ratio = floats(1, 64, lo_open=True)
timeout_s = floats(1, 600)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        help=f"port on 127.0.0.1 (default {DEFAULT_PORT}, sglang's; 0: a free port, printed at start)",
    )
    p.add_argument(
        "--device-tokens",
        type=device_tokens,
        default=16_384,
        metavar="N",
        help="device (GPU) KV pool in tokens (1024-4194304, default 16384)",
    )
    p.add_argument(
        "--host-ratio",
        type=host_ratio,
        default=4.0,
        metavar="R",
        help="host pool size as a multiple of the device pool, as sglang's --hicache-ratio (> 1 and <= 64,"
        " default 4)",
    )
    p.add_argument(
        "--request-timeout",
        type=timeout_s,
        default=30.0,
        metavar="S",
        help="seconds a generate or chat request may take before a 504 (1-600, default 30)",
    )


def run(args: argparse.Namespace) -> int:
    # Offloads free their device copy unless TOOLKV_LAZY_FREE says otherwise: a real server frees it
    # only under memory pressure, which one agent on this server never makes, so with the plugin's
    # default no tool call would show a restore.
    # sglang's cache needs a process group; this server's is a single rank of its own, on a port of
    # its own (a MASTER_PORT inherited from the shell, or a test runner's, may be taken already)
    import socket

    from toolkv.sglang.config import ToolKVConfig
    from toolkv.twin.serve import ServeConfig, serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(sock.getsockname()[1])
    env = dict(os.environ)
    env.setdefault("TOOLKV_LAZY_FREE", "0")
    try:  # the TOOLKV_* settings, refused as the plugin refuses them at server start
        tk_config = ToolKVConfig.from_env(env)
    except ValueError as e:
        raise InputError(str(e)) from None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log = logging.getLogger("toolkv.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    cfg = ServeConfig(
        port=args.port,
        device_tokens=args.device_tokens,
        host_ratio=args.host_ratio,
        request_timeout_s=args.request_timeout,
    )

    notes: list[str] = []
    if "TOOLKV_LAZY_FREE" not in os.environ:
        notes = [
            "  TOOLKV_LAZY_FREE=0 here unless set: each offload frees its device copy, so every tool call",
            "  shows an offload and a restore (a real server's default frees it only under memory pressure)",
        ]
    return serve(cfg, tk_config, out=lambda line: print(line, flush=True), notes=notes)
