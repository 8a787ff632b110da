"""NCCLPush without a GPU: what can run here, and what could not.

Run here: the chunk plan against vLLM's own ``pack_tensors`` (in the vLLM environment, on
CPU tensors), the HTTP sequence of a push against a failure-injecting loopback replica
(`test_engine_push.Replica`), the library loading errors, a real CUDA runtime's refusal
when there is no GPU, and the refusal of a device that is not a GPU. Not run here (no GPU
and no libnccl on these machines): joining a group, the warm-up all-reduce and the
broadcast itself, which need a GPU and a vLLM built for it.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest
from test_engine_push import Replica, replicas  # noqa: F401 - the fixture
from vllm_helpers import tiny_pretrained, vllm_python

from dew_pipe.inference import EngineError, NCCLPush
from dew_pipe.inference.servers.http_json import JSONClient
from dew_pipe.inference.servers.nccl import NCCL, CUDARuntime, NCCLError
from dew_pipe.inference.servers.nccl_push import TransferSequence, plan_chunks

CUDART = Path("/usr/local/cuda-13.0/lib/libcudart.so.13")

VLLM_CHUNKS = """
import json, sys, torch
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors
plans = []
for sizes, limit in json.loads(sys.argv[1]):
    tensors = iter([(str(i), torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)])
    chunks = []
    while (chunk := pack_tensors(tensors, lambda item: item[1], limit)) is not None:
        chunks.append([int(name) for name in chunk.names])
    plans.append(chunks)
print(json.dumps(plans))
"""


@pytest.mark.slow
def test_chunk_plan_equals_vllm_pack_tensors():
    python = vllm_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("no vLLM interpreter: run benchmarks/vllm_env.sh")
        pytest.skip("no vLLM interpreter: run benchmarks/vllm_env.sh")
    cases = [
        ([4, 4, 4, 9, 1], 8),
        ([100], 8),
        ([3, 5, 8, 1, 1, 1], 8),
        ([8, 8, 8], 8),
        ([1] * 7, 3),
    ]
    out = subprocess.run(
        [str(python), "-c", VLLM_CHUNKS, json.dumps(cases)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    vllm = json.loads(out.stdout.strip().splitlines()[-1])
    assert [plan_chunks(sizes, limit) for sizes, limit in cases] == vllm


def test_transfer_sequence_requests(replicas):  # noqa: F811
    replica = replicas({"/get_world_size?include_dp=true": (200, {"world_size": 2})})
    sequence = TransferSequence(JSONClient(replica.url, timeout=10))
    assert sequence.world_size() == 2
    sequence.init(bytes(range(128)), 3, 1 << 20)
    sequence.begin()
    sequence.update(["lm_head.weight"], ["bfloat16"], [[18, 64]])
    sequence.finish("4")
    assert replica.paths == [
        "/get_world_size?include_dp=true",
        "/init_weight_transfer_engine",
        "/pause?mode=wait",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
    ]
    bodies = dict(replica.requests)
    info = bodies["/init_weight_transfer_engine"]["init_info"]
    assert base64.b64decode(info["nccl_unique_id_b64"], validate=True) == bytes(range(128))
    assert {k: v for k, v in info.items() if k != "nccl_unique_id_b64"} == {
        "rank_offset": 1, "world_size": 3, "packed": True,
        "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2,
    }  # fmt: skip
    assert bodies["/update_weights"] == {
        "update_info": {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"],
                        "shapes": [[18, 64]]},
    }  # fmt: skip
    assert bodies["/finish_weight_update"] == {"weight_version": "4"}


def test_transfer_sequence_refused_reset_leaves_it_paused(replicas):  # noqa: F811
    replica = replicas({"/reset_prefix_cache": (200, {"success": False})})
    sequence = TransferSequence(JSONClient(replica.url, timeout=10))
    with pytest.raises(EngineError, match="success false") as caught:
        sequence.finish("1")
    assert caught.value.step == "reset_prefix_cache"
    assert "/resume" not in replica.paths


def test_library_loading_errors():
    with pytest.raises(NCCLError, match="does not exist"):
        NCCL("/nonexistent/libnccl.so.2")
    with pytest.raises(NCCLError, match="has no symbol ncclGetVersion"):
        NCCL("libc.so.6")
    with pytest.raises(NCCLError, match="has no symbol cudaSetDevice"):
        CUDARuntime("libc.so.6")
    with pytest.raises(NCCLError, match="does not exist"):
        CUDARuntime("/nonexistent/libcudart.so.12")


@pytest.mark.skipif(not CUDART.is_file(), reason=f"no CUDA runtime at {CUDART}")
def test_a_real_cuda_runtime_without_a_gpu_refuses_by_name():
    runtime = CUDARuntime(CUDART)
    with pytest.raises(NCCLError, match="cudaSetDevice failed with CUDA error"):
        runtime.set_device(0)


def test_push_needs_a_gpu_device():
    _, pretrained = tiny_pretrained()
    with pytest.raises(ValueError, match="sends from a GPU"):
        NCCLPush(pretrained, ["http://127.0.0.1:1"], "/nonexistent/libnccl.so.2")
    with pytest.raises(ValueError, match="nonempty"):
        NCCLPush(pretrained, [], "/nonexistent/libnccl.so.2")
