"""`megatron-rl` commands run one after the other in this one process, so that commands that fail
before they start anything pay the imports once, not once each. The first argument is the file
to write the results to; each other argument is a command, a JSON list of its arguments. The
results: a JSON list with each command's exit code and stderr."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from megatron_rl import cli

if __name__ == "__main__":
    results = []
    for command in sys.argv[2:]:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = cli.main(json.loads(command))
        results.append({"returncode": code, "stderr": stderr.getvalue()})
    Path(sys.argv[1]).write_text(json.dumps(results))
