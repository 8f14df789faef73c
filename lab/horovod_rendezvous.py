"""Horovod's Gloo rendezvous server for workers the lab starts itself (no ssh, no horovodrun).

Run inside the namespace of machine 0: ``python -m whatif.lab.horovod_rendezvous HOSTS NP
PORT_FILE``, with HOSTS as horovodrun's ``-H`` (``m0:2,m1:2``). It writes the port it listens on
to PORT_FILE and serves until it is terminated.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    hosts, processes, port_file = argv[0], int(argv[1]), Path(argv[2])
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(get_host_assignments(parse_hosts(hosts), processes))
    port_file.write_text(str(port))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
