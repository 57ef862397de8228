"""The `pdserve` command line. User errors print one line (`error: ...`) and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import entry_points

from cluster.errors import PdserveError
from cluster.sampling.sampling_params import SamplingParams
from deploy.config import ClusterConfig
from deploy.config_flags import add_config_flags, overrides_from_args

SERVE_DESCRIPTION = ("`pdserve serve`: starts (or joins) Ray, places the workers, forms the KV transfer group, "
                     "runs the router, and starts the API-server processes that serve the OpenAI-compatible HTTP API.")


# The commands' imports are lazy: each loads torch (and the model code) only when it runs, so that
# `pdserve --help` and `pdserve serve --help` answer at once.
def _cmd_demo_model(args) -> None:
    from cluster.model.demo import write_demo_model

    print(write_demo_model(args.dir, seed=args.seed))


def _cmd_generate(args) -> None:
    from cluster.engine.engine import LLMEngine

    from cluster.model.hub import resolve_model_dir

    prompts = args.prompts or []
    if not prompts:
        raise PdserveError("give at least one prompt")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )
    model = resolve_model_dir(args.model) if args.model is not None else None
    dtype = {"auto": None, "half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    engine = LLMEngine(model, dtype=dtype, device=args.device, quantization=args.quantization,
                       kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size)
    try:
        for out in engine.generate(prompts, params):
            print(out.text)
    finally:
        engine.close()


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("pdserve")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH, not installed
        return "0.1.0+source"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    p.add_argument("--version", action="version", version=f"pdserve {version()}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo-model", help="write the tiny random-weight demo checkpoint to DIR")
    d.add_argument("dir")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_cmd_demo_model, parser=d)

    g = sub.add_parser("generate", help="generate completions in-process (prefill + decode in one engine)")
    g.add_argument("prompts", nargs="*")
    g.add_argument("--model", default=None, help="Hugging Face model directory, a .gguf file, or a hub id in the "
                   "local Hugging Face cache (default: the demo model)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "float", "float16", "half", "bfloat16"],
                   help="activation dtype (default, and auto: the checkpoint's torch_dtype)")
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the weights to FP8 at load (default: as the checkpoint is stored)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache dtype (auto: the activation dtype)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, or cuda:i (tensor-parallel ranks take cuda:i, i+1, ...)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes (one GPU each on CUDA)")
    g.set_defaults(func=_cmd_generate, parser=g)

    _add_extra_commands(sub)
    return p


# The tools `pdserve NAME` runs, each an entry point of the group TOOL_GROUP (pyproject.toml):
# `pdserve loadtest` is the `pdserve-loadtest` command (loadtest/run.py).
TOOL_GROUP = "pdserve.commands"
TOOL_COMMANDS = {"loadtest": "Locust load test: ITL per decode batch size (pdserve loadtest --help)"}


def _add_extra_commands(sub) -> None:
    """`serve` (the launcher) and the tools installed beside pdserve (`loadtest`). A tool is found
    through the `pdserve.commands` entry-point group and imported only when it runs, by name: this
    package never imports a tool (tests/test_layering.py), and a tool parses its own arguments."""
    add_serve_command(sub)
    # Listed here for `pdserve --help`; main() hands their arguments to the tool's own parser.
    for name, help_text in TOOL_COMMANDS.items():
        sub.add_parser(name, add_help=False, help=help_text)


def add_serve_command(sub) -> None:
    """`pdserve serve`: one flag per ClusterConfig field (deploy/config.py)."""
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (prefill/decode on Ray)",
                       description=SERVE_DESCRIPTION,
                       usage="pdserve serve [MODEL_DIR] [--config FILE] [--FLAG VALUE ...] (pdserve serve --help lists them)")
    s.add_argument("model_dir", nargs="?", default=None, help="Hugging Face model directory, a .gguf file, "
                   "or a hub id (org/name) in the local Hugging Face cache (default: the demo model)")
    s.add_argument("--config", default=None, help="YAML file with any of the settings below (flags win)")
    add_config_flags(s)
    s.set_defaults(func=_cmd_serve, parser=s)


def _cmd_serve(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    cfg = ClusterConfig.load(args.config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if overrides.get("api_key") is not None:
        logging.getLogger("pdserve.launch").warning(
            "--api-key is visible to every user of this machine (ps, /proc/<pid>/cmdline); "
            "prefer --api-key-file FILE or the PDSERVE_API_KEY environment variable")
    # Lazy: the serving cluster imports Ray, torch, the workers and the router; `pdserve --help`,
    # `serve --help`, `generate` and `demo-model` must not pay for them (tests/deploy/test_cli.py).
    from deploy.serving_cluster import ServingCluster

    # The model, tokenizer, chat template and sampling defaults are checked before Ray starts: an
    # error there raises (one `error:` line, nothing to stop); later ones are printed by serve_forever.
    code = ServingCluster(cfg).serve_forever()
    # Stopped: the workers, Ray and the API servers are gone and `pdserve: stopped` is printed. The
    # interpreter's teardown (Ray's and torch's modules, threads and atexit hooks) would take 1-1.5 s
    # more on a small machine, which a supervisor restarting the service (or a test) waits for; as
    # the API servers do (deploy/api_server.py), the launcher exits without it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_tool(name: str, argv: list[str]) -> int:
    # Lazy, by entry point: only `pdserve loadtest` loads Locust, gevent and plotting.
    found = entry_points(group=TOOL_GROUP, name=name)
    if not found:
        print(f"error: `pdserve {name}` is not installed (pip install 'pdserve[{name}]' from a checkout, "
              f"then `pdserve {name}` or `pdserve-{name}`)", file=sys.stderr)
        return 2
    tool_main = next(iter(found)).load()
    return tool_main(argv, prog=f"pdserve {name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in TOOL_COMMANDS:
        return _run_tool(argv[0], argv[1:])
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # a subcommand's flag it does not know: that subcommand's usage, not the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        code = args.func(args)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
