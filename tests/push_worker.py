"""One process of the two-process push check (tests/test_engine_push.py).

    python tests/push_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.json GOOD_URL BAD_URL DIR

Every process builds the same tiny model and calls the same pushes, as a multi-process
trainer does: version 1 to the replica at GOOD_URL (it accepts every step), then version 2
to BAD_URL (its reset answers success: false). Writes what each push did on this process.
"""

from __future__ import annotations

import json
import sys

import jax

process_id, processes, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out, good, bad, directory = sys.argv[4:8]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=processes, process_id=process_id)

from vllm_helpers import tiny_pretrained  # noqa: E402

from dew_pipe.inference import EngineError, Publication, SafetensorsReload  # noqa: E402

_, pretrained = tiny_pretrained()
result: dict = {"process": jax.process_index()}
weights = Publication(SafetensorsReload(pretrained, directory, [good], "vllm", timeout=30))
written = weights.push.write(pretrained.variables)
result["written"] = [p.name for p in written]
weights.load(pretrained.variables, 1)
result["after_good"] = weights.version
refusing = Publication(SafetensorsReload(pretrained, directory, [bad], "vllm", timeout=30), 1)
try:
    refusing.load(pretrained.variables, 2)
    result["bad"] = "no error"
except EngineError as error:
    result["bad"] = str(error)
result["after_bad"] = refusing.version
with open(out, "w") as handle:
    json.dump(result, handle)
