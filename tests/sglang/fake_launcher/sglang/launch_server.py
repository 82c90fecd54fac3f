"""Test-only stand-in for sglang.launch_server (see ../README.md)."""

import argparse
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    """/health to anyone, as SGLang; anything else only with the server's API key."""

    api_key = ""

    def do_GET(self) -> None:
        allowed = self.path.startswith("/health") or (
            self.headers.get("Authorization") == f"Bearer {self.api_key}"
        )
        self.send_response(200 if allowed else 401)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--api-key")
    args, _ = parser.parse_known_args()
    Health.api_key = args.api_key
    mode = os.environ.get("FAKE_SGLANG_MODE", "ok")
    print(f"fake sglang: mode {mode}, argv {sys.argv[1:]}", flush=True)
    launcher = {
        name: os.environ.get(name) for name in ("RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    }
    print(f"fake sglang: launcher variables {launcher}", flush=True)
    if mode == "exit":
        print("fake sglang: boom", flush=True)
        sys.exit(3)
    # A child in the same process group, as SGLang's scheduler and detokenizer are.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"fake sglang: child pid {child.pid}", flush=True)
    if mode == "hang":
        time.sleep(600)
    HTTPServer((args.host, args.port), Health).serve_forever()


if __name__ == "__main__":
    main()
