"""``python tools/audit_template.py template --tokenizer DIR`` / ``... sessions traces.jsonl``.

The spec's path for the chat-template and calls-per-chain audits; the same command as
``dew-pipe audit`` (:mod:`dew_pipe.cli_tools`), with the same arguments and exit status.
"""

from __future__ import annotations

import sys

from dew_pipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["audit", *sys.argv[1:]]))
