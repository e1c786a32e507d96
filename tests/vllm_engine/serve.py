"""Serve one vLLM engine on CPU: vLLM's own CLI parser and HTTP app, the harness's engine client and workers.

    python -m tests.vllm_engine.serve --vllm-dir .vllm/0.33.0 -- --model /any/dir --port 8100 \
        --tensor-parallel-size 2 --weight-transfer-config '{"backend": "dcs"}' [--api-key KEY]

Everything after `--` goes to vLLM's `make_arg_parser` (the flags of `vllm serve`). The app is vLLM's
`build_app` (every router it registers, the dev-mode RL router only when VLLM_SERVER_DEV_MODE=1, its exception
handlers, CORS and API-key middleware); `app.state.engine_client` is `client.HarnessEngineClient`. One route is
the harness's own, for tests only: `GET /harness/weights` -> {name: {dtype, shape, hex}} of the full tensors
(TP shards joined). vLLM's general plugins (DCS's, installed under .vllm/plugins) are loaded as `vllm serve`
loads them, and `app.state.vllm_config` is set as vLLM's `init_app_state` sets it (dev mode's `/server_info`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def use_vllm_dir(vllm_dir: Path) -> None:
    """Put the vLLM environment (`vllm_dir`, its `deps` and `plugins` beside it) and the repository first on this
    process's path and PYTHONPATH (idempotent: `launcher.py` did it already in a server it forks)."""
    vllm_dir = vllm_dir.resolve()
    repo = str(Path(__file__).resolve().parents[2])
    paths = [str(vllm_dir), str(vllm_dir.parent / "deps"), str(vllm_dir.parent / "plugins"), repo]
    if sys.path[: len(paths)] != paths:
        sys.path[:0] = paths
    pythonpath = os.environ.get("PYTHONPATH", "")
    if not pythonpath.startswith(os.pathsep.join(paths)):
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, pythonpath])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-dir", required=True)
    parser.add_argument("--sink-model", action="store_true", help="hold any weights under any names (benchmarks)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER)
    ours = parser.parse_args(argv)
    use_vllm_dir(Path(ours.vllm_dir))
    args_list = ours.vllm_args[1:] if ours.vllm_args[:1] == ["--"] else ours.vllm_args

    import torch
    import uvicorn
    from fastapi.responses import JSONResponse
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.app import build_app
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tests.vllm_engine.client import make_client
    from tests.vllm_engine.shapes import SHARDED

    load_general_plugins()  # as `vllm serve`'s engine-config step does (vllm/engine/arg_utils.py)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(args_list)
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )
    config = VllmConfig(parallel_config=parallel, weight_transfer_config=args.weight_transfer_config)
    backend = args.weight_transfer_config.backend if args.weight_transfer_config is not None else None
    client = make_client(config, backend, ours.sink_model)
    app = build_app(args, supported_tasks=())
    app.state.engine_client = client
    app.state.vllm_config = config
    app.state.log_stats = False

    @app.get("/harness/weights")
    async def weights() -> JSONResponse:
        shards = await client.collective_rpc("harness_weights")
        out = {}
        for name, (dtype, _shape, _) in shards[0].items():
            parts = [torch.frombuffer(bytearray(s[name][2]), dtype=torch.uint8) for s in shards]
            parts = [p.view(getattr(torch, dtype)).reshape(s[name][1]) for p, s in zip(parts, shards, strict=True)]
            full = torch.cat(parts) if name in SHARDED and len(parts) > 1 else parts[0]
            out[name] = {
                "dtype": dtype,
                "shape": list(full.shape),
                "hex": full.view(torch.uint8).numpy().tobytes().hex(),
            }
        return JSONResponse(out)

    try:
        uvicorn.run(app, host=args.host or "127.0.0.1", port=args.port, log_level="info")
    finally:
        client.shutdown()


if __name__ == "__main__":
    main()
