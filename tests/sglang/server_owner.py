"""A process that starts a stand-in server (tests/sglang/test_server_process.py), prints the
server's pid, and waits to be killed.

    python -m tests.sglang.server_owner PORT LOG_DIR
"""

from __future__ import annotations

import sys
import time

from tests.sglang.test_server_process import _servers

if __name__ == "__main__":
    port, log_dir = int(sys.argv[1]), sys.argv[2]
    group = _servers("ok", port, log_dir).start()
    print(group.servers[0].process.pid, flush=True)
    time.sleep(600)
